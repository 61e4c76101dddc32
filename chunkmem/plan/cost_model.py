"""The planner's cost model: seconds of one training step from counted work and measured throughputs.

Two parts:

* **compute** (:func:`trace_compute`): one forward and backward of the model on the meta device, in
  the dtype chunkmem computes in, under a dispatch mode that records every operator with its shapes,
  strides and dtypes (its *signature*). Each distinct signature is timed on real tensors of those
  shapes (:meth:`~chunkmem.plan.machine_profile.MachineProfile.measure_operators`, kept in the profile), or,
  where it was not, estimated from its FLOPs (``torch.utils.flop_counter``'s formulas; the CPU's fused
  attention kernel as ``4 b h s^2 d`` forward, twice that backward) at the profile's matrix-product
  rate, or from the bytes it reads and writes at the profile's elementwise bandwidth. Views cost nothing.
* **the rest of the step** (:func:`step_time`): the bytes a placement moves between tiers (the planner's
  meta run counts them exactly) at the copy bandwidth, every trainable parameter's Adam update at the
  host kernel's rate (the 8-bit update's own rate for 8-bit state), the disk tier's step traffic (bytes read
  and written) at the rate of the library's
  streamed disk step measured as a whole (``MachineProfile.disk_step_bytes_per_s``; without it, reads and
  writes at the disk's separate bandwidths, their times added), overlapping the updates; the parameters read for the
  forward and backward at the disk's read bandwidth, added: the fetch thread reads ahead, but measured
  steps did not hide those reads behind the compute), and the bytes each rank sends in collectives at the
  measured gloo rate.

On a machine without a GPU the device tier is the CPU, so nothing overlaps compute except what the disk
tier's threads do; the model adds the parts. Units: seconds, bytes, FLOPs, elements.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from .machine_profile import MachineProfile

__all__ = ["OperatorCount", "ComputeTrace", "StepTime", "flash_attention_on_meta", "trace_compute", "step_time",
           "missing_figure"]

aten = torch.ops.aten
_FREE = {aten.detach.default, aten.lift_fresh.default, aten.alias.default, aten._unsafe_view.default}
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 8}


@contextmanager
def flash_attention_on_meta() -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` on meta tensors count as the fused (flash) kernel that runs
    on real devices, instead of the decomposed math kernel meta tensors otherwise get, which holds every
    (sequence x sequence) attention matrix. An explicit mask or grouped-query attention keeps the math
    kernel (an over-estimate)."""
    original = F.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if query.device.type != "meta" or attn_mask is not None or enable_gqa:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                          scale=scale)[0]

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@dataclass
class OperatorCount:
    """One signature of the traced iteration: how often it ran, its FLOPs and bytes per call, and how to
    run it once on real tensors (``replay``)."""

    key: str
    calls: int
    flops: int
    nbytes: int
    dtype: torch.dtype
    replay: Callable[[], Any] | None


@dataclass
class ComputeTrace:
    """The operators of one forward and backward (see :func:`trace_compute`)."""

    operators: dict[str, OperatorCount]

    @property
    def flops(self) -> int:
        return sum(op.flops * op.calls for op in self.operators.values())

    def seconds(self, profile: MachineProfile) -> float:
        """Seconds of the traced iteration's operators on the profiled machine."""
        total = 0.0
        for op in self.operators.values():
            measured = profile.op_seconds.get(op.key)
            if measured is None:
                measured = (op.flops / profile.matmul_rate(op.dtype) if op.flops
                            else op.nbytes / profile.elementwise_bytes_per_s)
            total += measured * op.calls
        return total

    def replays(self) -> dict[str, Callable[[], Any]]:
        """Signature -> a function running that operator once on real tensors, slowest first."""
        ordered = sorted(self.operators.values(), key=lambda op: -(op.flops * 8 + op.nbytes) * op.calls)
        return {op.key: op.replay for op in ordered if op.replay is not None}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}+{value.storage_offset()}{str(value.dtype)[6:]}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe(v) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``t``'s shape, strides, offset and dtype (normal values; integers zero)."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) if t.numel() else 0
    base_numel = t.storage_offset() + span
    if t.dtype.is_floating_point:
        base = torch.randn(base_numel).to(t.dtype)
    else:
        base = torch.zeros(base_numel, dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _replay(func: Any, args: tuple, kwargs: dict) -> Callable[[], Any]:
    made: list[Any] = []

    def run() -> Any:
        if not made:
            made.append(tree_map(lambda x: _real_like(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)))
        real_args, real_kwargs = made[0]
        with torch.no_grad():
            return func(*real_args, **real_kwargs)
    return run


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if func in _ATTENTION:  # (query, key, value, ...) or (grad_out, query, key, value, ...): b h s d
        query = args[0] if func is aten._scaled_dot_product_flash_attention_for_cpu.default else args[1]
        b, h, s, d = query.shape
        return _ATTENTION[func] * b * h * s * s * d
    return 0


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.operators: dict[str, OperatorCount] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE or getattr(func, "is_view", False):
            return out
        tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not tensors_out:
            return out
        key = func.__name__ + "(" + ",".join(_describe(a) for a in args) + \
            "".join(f",{k}={_describe(v)}" for k, v in sorted(kwargs.items())) + ")"
        op = self.operators.get(key)
        if op is None:
            tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors_in + tensors_out)
            dtype = next((t.dtype for t in tensors_in if t.dtype.is_floating_point), tensors_out[0].dtype)
            op = self.operators[key] = OperatorCount(key, 0, _flops(func, args, kwargs, out), nbytes, dtype,
                                                     _replay(func, args, kwargs))
        op.calls += 1
        return out


def trace_compute(template: nn.Module, args: tuple, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                  dtype: torch.dtype) -> ComputeTrace:
    """The operators of one forward and backward of ``template`` (on the meta device) as chunkmem runs it
    in ``dtype``: parameters in ``dtype``, floating inputs cast to it and floating outputs to fp32 (in
    16-bit mode), the loss ``loss_fn(output, batch)`` or the output's mean."""
    module = copy.deepcopy(template).to(dtype)
    if dtype != torch.float32:
        args = tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, args)
    recorder = _Recorder()
    with flash_attention_on_meta(), recorder:
        out = module(*args)
        if dtype != torch.float32:
            out = tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, out)
        if loss_fn is not None:
            loss = loss_fn(out, args[0] if len(args) == 1 else args)
        else:
            loss = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)).float().mean()
        loss.backward()
    return ComputeTrace(recorder.operators)


@dataclass
class StepTime:
    """Predicted seconds of one training step and its parts (seconds)."""

    compute: float
    copies: float
    adam: float
    disk: float
    collectives: float

    @property
    def total(self) -> float:
        return self.compute + self.copies + self.adam + self.disk + self.collectives


def missing_figure(profile: MachineProfile, dtype: torch.dtype, *, disk_read_step: int = 0,
                   disk_written_step: int = 0, disk_read_compute: int = 0, collective_bytes_sent: float = 0.0,
                   optimizer_state: str = "fp32", **_: Any) -> str | None:
    """What :func:`step_time` (same arguments, after the compute seconds) needs and ``profile`` lacks, in words
    (``None``: nothing): the disk's bandwidths for disk traffic, the collective rate for collectives, the 8-bit
    update's rate for 8-bit state."""
    if (disk_read_step or disk_written_step or disk_read_compute) and not profile.has_disk:
        return "disk bandwidth"
    if collective_bytes_sent and profile.collective_bytes_per_s is None:
        return "collective bandwidth"
    if profile.update_rate(dtype, optimizer_state) is None:
        return (f"rate of the {optimizer_state} host update "
                + ("(rounded_adam_elements_per_s)" if optimizer_state == "8bit-bf16"
                   else f"(low_bit_adam_elements_per_s[{str(dtype)[6:]!r}])"))
    return None


def step_time(profile: MachineProfile, compute_s: float, dtype: torch.dtype, *, moved_bytes: int,
              adam_elements: int, disk_adam_elements: int = 0, disk_read_step: int = 0, disk_written_step: int = 0,
              disk_read_compute: int = 0, collective_bytes_sent: float = 0.0,
              optimizer_state: str = "fp32") -> StepTime | None:
    """The predicted :class:`StepTime` (``None`` when a needed figure is missing from the profile:
    :func:`missing_figure` says which).

    ``compute_s``: the traced iteration's seconds (:meth:`ComputeTrace.seconds`); ``moved_bytes``: bytes
    copied between the device and host tiers per step; ``adam_elements``: parameters this rank updates,
    of which ``disk_adam_elements`` in the disk tier's streamed step, which reads ``disk_read_step`` and
    writes ``disk_written_step`` bytes; ``disk_read_compute``: parameter bytes read from disk for the
    forward and backward; ``collective_bytes_sent``: bytes this rank sends in collectives per step;
    ``optimizer_state``: the update's (``"fp32"``, ``"8bit"``, ``"8bit-bf16"``: see
    :meth:`MachineProfile.update_rate <chunkmem.plan.machine_profile.MachineProfile.update_rate>`)."""
    if missing_figure(profile, dtype, disk_read_step=disk_read_step, disk_written_step=disk_written_step,
                      disk_read_compute=disk_read_compute, collective_bytes_sent=collective_bytes_sent,
                      optimizer_state=optimizer_state) is not None:
        return None
    adam_rate = profile.update_rate(dtype, optimizer_state)
    disk = 0.0
    if profile.has_disk:
        if profile.disk_step_bytes_per_s is not None:  # the library's streamed step, measured as a whole
            io = (disk_read_step + disk_written_step) / profile.disk_step_bytes_per_s
        else:  # one disk serves the streamed step's reads and writes: their times add
            io = disk_read_step / profile.disk_read_bytes_per_s + disk_written_step / profile.disk_write_bytes_per_s
        streamed = max(io, disk_adam_elements / adam_rate)  # the updates overlap the I/O
        # the forward's and backward's parameter reads: the fetch thread reads ahead of use, but on this
        # project's machine (benchmarks/plan_accuracy.py) they did not hide behind the compute: they add
        disk = streamed + disk_read_compute / profile.disk_read_bytes_per_s
    return StepTime(compute=compute_s, copies=moved_bytes / profile.copy_bytes_per_s,
                    adam=(adam_elements - disk_adam_elements) / adam_rate, disk=disk,
                    collectives=collective_bytes_sent / (profile.collective_bytes_per_s or 1.0))
