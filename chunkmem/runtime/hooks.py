"""The hooks of one wrapped model: each makes one call into the model's runtime.

* a watched module's forward pre-hook: :meth:`~chunkmem.runtime.runtime.ChunkRuntime.pre_forward`;
* its forward hook (``always_call``: it runs when the forward raises too, so nothing stays held):
  :meth:`~chunkmem.runtime.runtime.ChunkRuntime.post_forward`; when the call was the running one and
  autograd records, a hook on each output that requires a gradient;
* that output hook: :meth:`~chunkmem.runtime.runtime.ChunkRuntime.pre_backward` (``first`` for the
  first output gradient of that forward call);
* a trainable parameter's post-accumulate-grad hook:
  :meth:`~chunkmem.runtime.runtime.ChunkRuntime.gradient_ready`.

Which modules are watched, and what each call does, is the runtime's business.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Protocol

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves


class StepEdges(Protocol):
    """What the hooks call (:class:`~chunkmem.runtime.runtime.ChunkRuntime` implements it)."""

    def pre_forward(self, module: nn.Module) -> None: ...

    def post_forward(self, module: nn.Module) -> bool: ...

    def pre_backward(self, module: nn.Module, first: bool) -> None: ...

    def gradient_ready(self, param: nn.Parameter) -> None: ...


class ModelHooks:
    """Installs (and removes) the hooks of one runtime's model. The parameters' hooks reach the runtime
    through a weak reference: they are held from C++, where a strong reference would keep the model
    alive forever (a cycle the collector cannot see). The modules' hooks hold it like any attribute."""

    def __init__(self, runtime: StepEdges) -> None:
        self._runtime = weakref.ref(runtime)
        self._handles: list[Any] = []
        self._watched: set[nn.Module] = set()

    def watch_module(self, module: nn.Module) -> None:
        """Give ``module`` its forward hooks (once)."""
        if module in self._watched:
            return
        self._watched.add(module)
        runtime = self._runtime()

        def pre_forward(module: nn.Module, args: Any) -> None:
            runtime.pre_forward(module)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if runtime.post_forward(module) and output is not None and torch.is_grad_enabled():
                _watch_outputs(runtime, module, output)

        self._handles.append(module.register_forward_pre_hook(pre_forward))
        self._handles.append(module.register_forward_hook(post_forward, always_call=True))

    def watch_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Give each parameter its post-accumulate-grad hook."""
        runtime = self._runtime

        def gradient_ready(param: nn.Parameter) -> None:
            live = runtime()
            if live is not None:
                live.gradient_ready(param)

        with DisableTorchFunctionSubclass():
            for param in params:
                self._handles.append(param.register_post_accumulate_grad_hook(gradient_ready))

    def remove(self) -> None:
        """Remove every hook (the model is being unwrapped)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()


def _watch_outputs(runtime: StepEdges, module: nn.Module, output: Any) -> None:
    """Hook the gradients of one forward call's outputs: the call's backward begins with the first."""
    fired = False

    def pre_backward(grad: torch.Tensor) -> None:
        nonlocal fired
        first, fired = not fired, True
        runtime.pre_backward(module, first)

    for tensor in tree_leaves(output):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(pre_backward)
