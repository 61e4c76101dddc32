"""Module and gradient hooks that fetch chunks before compute and collect gradients after it.

Hooks sit on the wrapped root module and on every module that owns chunk-managed parameters (or was
given one with :func:`~chunkmem.register_external_parameter`). Each hooked module's forward acquires
the chunks of its own parameters (and of parameters it was seen using from other modules) and
releases them when it returns, also when the forward raises (``always_call``), so an exception inside
a forward (or the early stop of non-reentrant activation checkpointing) leaves nothing held. The
gradient of a module's outputs holds its chunks on the device for its backward. Each parameter's
post-accumulate-grad hook hands its gradient to the chunk manager.

A parameter used outside its own module (``F.linear(x, other.weight)``, a tied head) is seen by the
parameter guard (:mod:`chunkmem.core.param_guard`) at its first use in any forward: the innermost hooked
module running is given that chunk now and from then on (:meth:`ChunkHooks.use_foreign`).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves

from ..core.chunk import Chunk
from .manager import ChunkManager
from ..core.param_guard import set_owner, slot_of
from .parameter_access import registered_external_parameters


def _weak_method(method: Any) -> Any:
    """``method`` called through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


class _Running:
    """One module call in progress: the module and the chunks it holds."""

    __slots__ = ("module", "chunks")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.chunks: list[Chunk] = []


class ChunkHooks:
    """Installs and runs the hooks of one wrapped module."""

    def __init__(self, root: nn.Module, manager: ChunkManager) -> None:
        self.root = root
        self.manager = manager
        self.module_chunks: dict[nn.Module, list[Chunk]] = {}
        self.stack: list[_Running] = []
        self.end_of_backward_queued = False
        self.handles: list[Any] = []
        self.hooked: set[nn.Module] = set()
        self.foreign_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.module_names = {module: name or type(module).__name__ for name, module in root.named_modules()}
        for module in root.modules():
            owns = any(slot_of(p) is not None for p in module.parameters(recurse=False))
            external = list(registered_external_parameters(module))
            if external:
                self.foreign_params[module] = external
            if owns or external or module is root:
                self.hook_module(module)
        on_grad = _weak_method(self._on_grad)  # held from C++ by the parameter: a strong reference would keep
        with DisableTorchFunctionSubclass():   # the model alive forever (a cycle the collector cannot see)
            for param in root.parameters():
                if param.requires_grad and slot_of(param) is not None:
                    self.handles.append(param.register_post_accumulate_grad_hook(on_grad))
        self.refresh_chunks()

    def hook_module(self, module: nn.Module) -> None:
        """Give ``module`` the forward hooks (once)."""
        if module in self.hooked:
            return
        self.hooked.add(module)
        self.module_chunks.setdefault(module, [])
        self.handles.append(module.register_forward_pre_hook(self._pre_forward))
        self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))

    def remove(self) -> None:
        """Remove every hook (the model is being unwrapped)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.hooked.clear()

    def refresh_chunks(self) -> None:
        """(Re-)read which chunks each hooked module's own and foreign parameters are in (after a re-pack)."""
        for module in self.module_chunks:
            fresh = []
            for param in module.parameters(recurse=False):
                slot = slot_of(param)
                if slot is not None and slot.chunk not in fresh:
                    fresh.append(slot.chunk)
            self.module_chunks[module] = fresh
        for module, params in self.foreign_params.items():
            for param in params:
                chunk = slot_of(param).chunk
                if chunk not in self.module_chunks[module]:
                    self.module_chunks[module].append(chunk)
        for chunk in self.manager.chunks:
            set_owner(chunk, self)

    # ---- forward -----------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        running = _Running(module)
        self.stack.append(running)  # first: the post hook runs even if what follows raises
        chunks = list(self.module_chunks[module])
        if chunks:
            self.manager.scheduler.begin_period(self.module_names[module], "forward", chunks)
        self.manager.acquire(chunks)
        running.chunks = chunks

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.stack or self.stack[-1].module is not module:
            return  # the stack was cleared (a new forward began after an interrupted one)
        running = self.stack.pop()
        self.manager.release(running.chunks)
        if output is not None and torch.is_grad_enabled():
            pre_backward = self._make_pre_backward(module)
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(pre_backward)

    def use_foreign(self, param: nn.Parameter) -> None:
        """``param`` is used while the innermost running hooked module does not hold its chunk: fetch it
        for that module now and remember it for the module's later forwards and backwards."""
        running = self.stack[-1]
        chunk = slot_of(param).chunk
        if chunk in running.chunks:
            return
        self.manager.acquire([chunk])  # refuses a chunk whose memory holds gradients (reuse_fp16_shard)
        running.chunks.append(chunk)
        self.add_foreign(running.module, param)

    def add_foreign(self, module: nn.Module, param: nn.Parameter) -> None:
        """Fetch ``param``'s chunk with ``module`` from now on."""
        params = self.foreign_params.setdefault(module, [])
        if not any(p is param for p in params):
            params.append(param)
        chunk = slot_of(param).chunk
        if chunk not in self.module_chunks[module]:
            self.module_chunks[module].append(chunk)
            self.manager.scheduler.module_chunks_changed()

    def clear_interrupted(self) -> None:
        """Before a forward: release what module calls left on the stack (a forward interrupted by an
        exception whose post hooks could not run, e.g. a KeyboardInterrupt inside a hook), and let the
        coming backward queue its end-of-backward callback (autograd drops the one a backward that
        raised had queued)."""
        while self.stack:
            self.manager.release(self.stack.pop().chunks)
        self.end_of_backward_queued = False

    # ---- backward ----------------------------------------------------------------------------------

    def _make_pre_backward(self, module: nn.Module):
        """A hook for the gradients of one forward call's outputs: the call's backward begins with the
        first of them (a period boundary when the module has chunks)."""
        fired = False

        def pre_backward(grad: torch.Tensor) -> None:
            nonlocal fired
            if module is self.root and not self.end_of_backward_queued:
                self.end_of_backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if fired:
                return
            fired = True
            chunks = self.module_chunks[module]
            if chunks:
                self.manager.scheduler.begin_period(self.module_names[module], "backward", chunks)
            self.manager.hold_for_backward(chunks)
        return pre_backward

    def _on_grad(self, param: nn.Parameter) -> None:
        with DisableTorchFunctionSubclass():
            grad = param.grad
            param.grad = None
        self.manager.accumulate_grad(slot_of(param), grad)

    def _end_of_backward(self) -> None:
        self.end_of_backward_queued = False
        self.manager.end_backward()
