"""The hooks of one wrapped model: each makes one call into the model's runtime.

* a watched module's forward pre-hook: :meth:`~chunkmem.runtime.runtime.ChunkRuntime.pre_forward`;
* its forward hook (``always_call``: it runs when the forward raises too, so nothing stays held):
  :meth:`~chunkmem.runtime.runtime.ChunkRuntime.post_forward`; when the call was the running one and
  autograd records, a hook on each output that requires a gradient;
* that output hook: :meth:`~chunkmem.runtime.runtime.ChunkRuntime.pre_backward` (``first`` for the
  first output gradient of that forward call);
* a trainable parameter's post-accumulate-grad hook:
  :meth:`~chunkmem.runtime.runtime.ChunkRuntime.gradient_ready` (:func:`watch_gradients`, which
  :class:`~chunkmem.LowLevelZeroOptimizer` uses too, as it does :func:`at_backward_end`);
* for a module that uses frozen chunks (no gradient tells when their backward is over), a post hook on
  every autograd node its forward call created (:class:`FrozenBackward`):
  :meth:`~chunkmem.runtime.runtime.ChunkRuntime.frozen_backward_done` once all of them ran.

Which modules are watched, and what each call does, is the runtime's business.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves


class StepEdges(Protocol):
    """What the hooks call (:class:`~chunkmem.runtime.runtime.ChunkRuntime` implements it)."""

    root: nn.Module
    steady: bool  # the running iteration follows its schedule with nothing to move: only the root's hooks act

    def pre_forward(self, module: nn.Module) -> None: ...

    def post_forward(self, module: nn.Module) -> bool: ...

    def pre_backward(self, module: nn.Module, first: bool, tracked: bool = False) -> None: ...

    @property
    def backward_count(self) -> int: ...

    def gradient_ready(self, param: nn.Parameter) -> None: ...

    def uses_frozen_chunks(self, module: nn.Module) -> bool: ...

    def frozen_backward_done(self, module: nn.Module) -> None: ...


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
        marks: list[int] = []  # one per running call of this module that tracks its frozen chunks' backward
        root = module is runtime.root

        def pre_forward(module: nn.Module, args: Any) -> None:
            if runtime.steady and not root:
                return
            if torch.is_grad_enabled() and runtime.uses_frozen_chunks(module):
                marks.append(_sequence_mark())  # first: the post hook runs even if what follows raises
            runtime.pre_forward(module)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if runtime.steady and not root:
                return
            mark = marks.pop() if marks else None
            if runtime.post_forward(module) and output is not None and torch.is_grad_enabled():
                tracker = FrozenBackward(runtime, module, output, mark) if mark is not None else None
                _watch_outputs(runtime, module, output, tracker)

        self._handles.append(module.register_forward_pre_hook(pre_forward))
        self._handles.append(module.register_forward_hook(post_forward, always_call=True))

    def watch_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Give each parameter its post-accumulate-grad hook."""
        runtime = self._runtime

        def gradient_ready(param: nn.Parameter) -> None:
            live = runtime()
            if live is not None:
                live.gradient_ready(param)

        self._handles.extend(watch_gradients(params, gradient_ready))

    def remove(self) -> None:
        """Remove every hook (the model is being unwrapped)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()


def watch_gradients(params: Iterable[nn.Parameter], gradient_ready: Callable[[nn.Parameter], None]) -> list[Any]:
    """Give each parameter a post-accumulate-grad hook calling ``gradient_ready(param)`` once autograd has
    accumulated its gradient in a backward; returns the hooks' handles. The chunk runtime's hooks
    (:meth:`ModelHooks.watch_gradients`) and :class:`~chunkmem.LowLevelZeroOptimizer`'s are these."""
    with DisableTorchFunctionSubclass():  # past the parameter guard of chunk-managed parameters
        return [param.register_post_accumulate_grad_hook(gradient_ready) for param in params]


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends (autograd's final callback), however it was started
    (``loss.backward()``, ``torch.autograd.backward``, an optimizer's ``backward``)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _watch_outputs(runtime: StepEdges, module: nn.Module, output: Any, tracker: "FrozenBackward | None") -> None:
    """Hook the gradients of one forward call's outputs: the call's backward begins with the first (of each
    backward pass: a second one through a graph kept with ``retain_graph=True`` fetches the chunks again)."""
    fired_in: int | None = None  # the backward pass (the runtime's count) whose first output gradient came

    def pre_backward(grad: torch.Tensor) -> None:
        nonlocal fired_in
        first_ever = fired_in is None
        first, fired_in = fired_in != runtime.backward_count, runtime.backward_count
        runtime.pre_backward(module, first, tracked=tracker is not None and first_ever)
        if first_ever and tracker is not None:
            tracker.begin()

    for tensor in tree_leaves(output):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(pre_backward)


def _sequence_mark() -> int:
    """A number below the autograd sequence number of every node created from now on in this thread
    (each node takes the next number when it is created; this probe takes one)."""
    probe = torch.empty((), requires_grad=True).view(())
    return probe.grad_fn._sequence_nr()


class FrozenBackward:
    """Tells the runtime when the backward of one forward call of a module is over, for the chunks without
    trainable parameters that call used: no gradient of theirs marks it, and without this they would stay
    on the device until the end of the whole backward (a frozen LoRA base would have to fit there).

    The autograd nodes the call created (those with a sequence number above ``mark``, found from its
    outputs) are the only ones that can read its parameters; once every one of them ran, after the first
    output gradient arrived (:meth:`begin`), the runtime may let the chunks go. A node that never runs (a
    branch the loss does not reach) keeps them until the end of the backward, as before."""

    def __init__(self, runtime: StepEdges, module: nn.Module, output: Any, mark: int) -> None:
        self._runtime, self._module = runtime, module
        self._begun = False
        nodes = _nodes_after(output, mark)
        self._pending = len(nodes)
        for node in nodes:
            node.register_hook(self._ran)

    def begin(self) -> None:
        self._begun = True
        if self._pending == 0:
            self._runtime.frozen_backward_done(self._module)

    def _ran(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._pending -= 1
        if self._pending == 0 and self._begun:
            self._runtime.frozen_backward_done(self._module)


def _nodes_after(output: Any, mark: int) -> list[Any]:
    """The autograd nodes behind ``output`` created after ``mark`` (see :func:`_sequence_mark`), found by
    walking back from its tensors' nodes and stopping at older ones (and at leaves' AccumulateGrad)."""
    found: dict[int, Any] = {}
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in found or node._sequence_nr() <= mark or not hasattr(node, "next_functions"):
            continue
        if type(node).__name__ == "AccumulateGrad":
            continue
        found[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())
