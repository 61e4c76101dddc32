"""Module and gradient hooks that fetch chunks before compute and collect gradients after it.

Each module's forward acquires the chunks of its own parameters (and of parameters it was seen using
from other modules) and releases them when it returns; the gradient of a module's outputs holds those
chunks on the device for its backward. Each parameter's post-accumulate-grad hook hands its gradient to
the chunk manager. The first forward runs under a :class:`ForeignParamDiscovery` mode that sees every
operator, so that a parameter used outside its own module (``F.linear(x, other.weight)``) is fetched
and remembered for that module from then on; later iterations run only the module hooks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .chunk import Chunk
from .manager import ChunkManager, slot_of


class ChunkHooks:
    """Installs and runs the hooks of one wrapped module."""

    def __init__(self, root: nn.Module, manager: ChunkManager) -> None:
        self.root = root
        self.manager = manager
        self.module_chunks: dict[nn.Module, list[Chunk]] = {}
        self.stack: list[tuple[nn.Module, list[Chunk]]] = []
        self.end_of_backward_queued = False
        self.handles: list[Any] = []
        self.foreign_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.module_names = {module: name or type(module).__name__ for name, module in root.named_modules()}
        for module in root.modules():
            self.module_chunks[module] = []
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))
        for param in root.parameters():
            if param.requires_grad and slot_of(param) is not None:
                self.handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
        self.refresh_chunks()

    def refresh_chunks(self) -> None:
        """(Re-)read which chunks each module's own and foreign parameters are in (after a re-pack)."""
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

    # ---- forward -----------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        chunks = list(self.module_chunks[module])
        if chunks:
            self.manager.scheduler.begin_period(self.module_names[module], "forward", chunks)
        self.manager.acquire(chunks)
        self.stack.append((module, chunks))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        popped, chunks = self.stack.pop()
        assert popped is module
        self.manager.release(chunks)
        if torch.is_grad_enabled():
            pre_backward = self._make_pre_backward(module)
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(pre_backward)

    def use_foreign(self, param: nn.Parameter) -> None:
        """A parameter was used while the top module does not hold its chunk: fetch it for that module
        now and remember it for the module's later forwards and backwards."""
        slot = slot_of(param)
        module, held = self.stack[-1]
        chunk = slot.chunk
        if chunk in held:
            return
        self.manager.acquire([chunk])
        held.append(chunk)
        self.foreign_params.setdefault(module, []).append(param)
        if chunk not in self.module_chunks[module]:
            self.module_chunks[module].append(chunk)
            self.manager.scheduler.module_chunks_changed()

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
        grad = param.grad
        param.grad = None
        self.manager.accumulate_grad(slot_of(param), grad)

    def _end_of_backward(self) -> None:
        self.end_of_backward_queued = False
        self.manager.end_backward()


class ForeignParamDiscovery(TorchFunctionMode):
    """Sees every torch operator of one forward and fetches any chunk-managed parameter whose chunk
    the running module does not hold (see :meth:`ChunkHooks.use_foreign`)."""

    def __init__(self, hooks: ChunkHooks) -> None:
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hooks.stack:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, nn.Parameter) and slot_of(leaf) is not None:
                    self.hooks.use_foreign(leaf)
        return func(*args, **kwargs)
