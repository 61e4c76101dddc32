"""Which chunks each module's call fetches: those of its own parameters, and those of parameters of other
modules it uses (a tied head, ``F.linear(x, w)``), found at the wrap (remembered by the parameter guard),
declared (``register_external_parameter``) or met in a forward. Before a module takes another module's
parameter, the device capacity check runs again with that use (the chunk then stays on the device from
that module's backward on). Every module that fetches chunks, and the root, gets its forward hooks from
:class:`~chunkmem.runtime.hooks.ModelHooks`.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..core.chunk import Chunk
from ..core.param_guard import remembered_externals, slot_of
from ..errors import InvalidArgumentError
from .capacity import CapacityCheck
from .hooks import ModelHooks


class ModuleChunks:
    """The chunks of each watched module of one model (see the module docstring): ``names`` (module ->
    its name in the model) and ``chunks`` (module -> the chunks its call fetches) are read by the runtime.
    ``changed`` is called when a module is found to need one more chunk (the scheduler traces again)."""

    def __init__(self, root: nn.Module, hooks: ModelHooks, check_capacity: CapacityCheck,
                 changed: Callable[[], None]) -> None:
        self.root = root
        self._hooks = hooks
        self._check_capacity = check_capacity
        self._changed = changed
        self.names = {module: name or type(module).__name__ for name, module in root.named_modules()}
        self.chunks: dict[nn.Module, list[Chunk]] = {}
        self._foreign: dict[nn.Module, list[nn.Parameter]] = {}
        for module in root.modules():
            owns = any(slot_of(p) is not None for p in module.parameters(recurse=False))
            external = remembered_externals(module)
            if owns or external or module is root:
                self.watch(module)
            for param in external:
                self.add_foreign(module, param)

    def watch(self, module: nn.Module) -> None:
        """``module``'s call fetches the chunks of its own parameters (hooked once)."""
        if module not in self.chunks:
            self.chunks[module] = []
            for param in module.parameters(recurse=False):
                slot = slot_of(param)
                if slot is not None and slot.chunk not in self.chunks[module]:
                    self.chunks[module].append(slot.chunk)
            self._hooks.watch_module(module)

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """``register_external_parameter(module, param)``: ``module`` fetches ``param``'s chunk from now on."""
        if module not in self.names:
            raise InvalidArgumentError("module", type(module).__name__,
                                       "a submodule of the model that owns the parameter")
        self.check_capacity_with(module, param, "declared with register_external_parameter")
        self.watch(module)
        self.add_foreign(module, param)

    def check_capacity_with(self, module: nn.Module, param: nn.Parameter, how: str) -> None:
        """Before ``module`` fetches another module's ``param`` from now on: the device tier must still hold
        the step (the chunk now stays there from ``module``'s backward on); raises DeviceCapacityError, with
        nothing registered, when it does not."""
        if any(p is param for p in self._foreign.get(module, ())):
            return
        foreign = dict(self._foreign)
        foreign[module] = foreign.get(module, []) + [param]
        named = list(self.names.items())
        users = [(name, [p for p in sub.parameters(recurse=False) if slot_of(p) is not None] + foreign.get(sub, []))
                 for sub, name in named[:1] + list(reversed(named[1:]))]
        param_name = next((name for name, p in self.root.named_parameters() if p is param), "a parameter")
        self._check_capacity(users, f" ({how}: module {self.names[module]!r} uses parameter {param_name!r})")

    def add_foreign(self, module: nn.Module, param: nn.Parameter) -> None:
        """Fetch ``param``'s chunk with ``module`` from now on."""
        params = self._foreign.setdefault(module, [])
        if not any(p is param for p in params):
            params.append(param)
        chunk = slot_of(param).chunk
        if chunk not in self.chunks[module]:
            self.chunks[module].append(chunk)
            self._changed()
