"""What the machine at hand does per second: the inputs of the planner's cost model (:mod:`chunkmem.plan.cost_model`).

A :class:`MachineProfile` holds throughputs measured here (or given explicitly, so that a plan can be
reproduced on another machine or in a test):

* ``matmul_flops``: FLOP/s of a matrix product per dtype (the fallback for operators not measured one by one);
* ``elementwise_bytes_per_s``: bytes/s of a memory-bound operator (read + written; the other fallback);
* ``op_seconds``: seconds of individual operators of a traced iteration, keyed by their signature
  (operator, shapes, strides, dtypes, arguments), measured by running each on real tensors of those shapes
  (:meth:`MachineProfile.measure_operators`); this is where most of a step's compute time comes from, since
  a matrix product's speed depends on its shapes and layout (on an AVX-512 CPU fp16 products are 10-300x
  slower than bf16 ones, and transposed operands change that again);
* ``adam_elements_per_s``: parameters/s of one update by the library's host Adam kernel, per model dtype;
* ``low_bit_adam_elements_per_s``: parameters/s of one update by the 8-bit Adam's host update
  (:func:`chunkmem.optim.low_bit_adam.update_segments_`: its C++ kernel where it loads), per model dtype (fp32
  masters of a 16-bit model); on an AVX2 CPU about 3-4x slower than the fp32 one, which reads and writes fewer
  bytes but dequantizes and quantizes both moments; empty when not measured;
* ``rounded_adam_elements_per_s``: the same over bf16 parameters that are their own masters, rounded
  stochastically, the random numbers drawn included (``AdamW8bit(bf16_stochastic_round=True)``), ``None`` when
  not measured;
* ``copy_bytes_per_s``: bytes/s of a copy between two tier buffers (a chunk move);
* ``disk_read_bytes_per_s`` / ``disk_write_bytes_per_s``: the disk tier's I/O engine on ``nvme_path``
  (:func:`chunkmem.storage.disk_io.measure_bandwidth`, direct I/O), ``None`` when not measured;
* ``disk_step_bytes_per_s``: bytes read plus written per second by the library's own streamed optimizer
  step over state on the disk tier (a 67M-parameter bf16 model, its second and third steps timed: the disk's
  sustained rate with reads, writes and updates interleaved as a step interleaves them, which on this
  project's virtual disk is about half of what the separate read and write figures add up to), ``None``
  when not measured;
* ``collective_bytes_per_s``: bytes each rank sends per second in a gloo all-reduce between 2 processes of
  this machine, ``None`` when not measured.

:meth:`MachineProfile.measure` takes about a second (the disk adds a few seconds: 1 GiB written twice and
read once, large enough that a virtual machine's host cache does not answer for the disk; the collective a
few seconds); ``to_dict`` / ``from_dict`` (JSON-able) let a profile be kept and passed in again.
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError, check_number
from ..optim.adam_kernels import adam_update_
from ..optim.adam_math import AdamHyper
from ..storage.disk_io import measure_bandwidth

__all__ = ["MachineProfile", "dtype_name"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"``: the keys of a profile's per-dtype figures."""
    return str(dtype).removeprefix("torch.")


@dataclass
class MachineProfile:
    """Throughputs of this machine (see the module docstring). Units: FLOP/s, bytes/s, elements/s, seconds."""

    matmul_flops: dict[str, float]
    elementwise_bytes_per_s: float
    adam_elements_per_s: dict[str, float]
    copy_bytes_per_s: float
    disk_read_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None
    collective_bytes_per_s: float | None = None
    disk_step_bytes_per_s: float | None = None
    op_seconds: dict[str, float] = field(default_factory=dict)
    threads: int = field(default_factory=torch.get_num_threads)
    low_bit_adam_elements_per_s: dict[str, float] = field(default_factory=dict)
    rounded_adam_elements_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("matmul_flops", "adam_elements_per_s"):
            table = getattr(self, name)
            if not isinstance(table, dict) or not table:
                raise ArgumentTypeError(name, table, "a non-empty dict {dtype name: per second}")
            for key, value in table.items():
                if key not in DTYPES:
                    raise InvalidArgumentError(f"{name}[{key!r}]", key, "'float32', 'bfloat16' or 'float16'")
                check_number(f"{name}[{key!r}]", value, low=0.0, low_open=True)
        for name in ("elementwise_bytes_per_s", "copy_bytes_per_s"):
            check_number(name, getattr(self, name), low=0.0, low_open=True)
        if not isinstance(self.low_bit_adam_elements_per_s, dict):
            raise ArgumentTypeError("low_bit_adam_elements_per_s", self.low_bit_adam_elements_per_s,
                                    "a dict {dtype name: parameters per second} (empty: not measured)")
        for key, value in self.low_bit_adam_elements_per_s.items():
            if key not in DTYPES:
                raise InvalidArgumentError(f"low_bit_adam_elements_per_s[{key!r}]", key,
                                           "'float32', 'bfloat16' or 'float16'")
            check_number(f"low_bit_adam_elements_per_s[{key!r}]", value, low=0.0, low_open=True)
        for name in ("disk_read_bytes_per_s", "disk_write_bytes_per_s", "collective_bytes_per_s",
                     "disk_step_bytes_per_s", "rounded_adam_elements_per_s"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value, low=0.0, low_open=True)

    # ---- reading ---------------------------------------------------------------------------------------

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """FLOP/s of a matrix product in ``dtype`` (the slowest dtype measured when this one was not)."""
        return self.matmul_flops.get(dtype_name(dtype), min(self.matmul_flops.values()))

    def adam_rate(self, dtype: torch.dtype) -> float:
        """Parameters/s of the host Adam update of a model in ``dtype``."""
        return self.adam_elements_per_s.get(dtype_name(dtype), min(self.adam_elements_per_s.values()))

    def update_rate(self, dtype: torch.dtype, optimizer_state: str = "fp32") -> float | None:
        """Parameters/s of the host update of a model in ``dtype`` keeping ``optimizer_state`` (the planner's
        :data:`~chunkmem.plan.meta_run.OPTIMIZER_STATES`): :meth:`adam_rate` for ``"fp32"``; the 8-bit update's
        (the slowest dtype measured when this one was not) for ``"8bit"``; the bf16 update rounding stochastically
        for ``"8bit-bf16"``. ``None``: the profile lacks that figure."""
        if optimizer_state == "fp32":
            return self.adam_rate(dtype)
        if optimizer_state == "8bit-bf16":
            return self.rounded_adam_elements_per_s
        rates = self.low_bit_adam_elements_per_s
        return rates.get(dtype_name(dtype), min(rates.values())) if rates else None

    @property
    def has_disk(self) -> bool:
        return self.disk_read_bytes_per_s is not None and self.disk_write_bytes_per_s is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``MachineProfile.from_dict`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MachineProfile":
        if not isinstance(values, dict):
            raise ArgumentTypeError("values", type(values).__name__, "a dict from MachineProfile.to_dict()")
        return cls(**values)

    # ---- measuring ---------------------------------------------------------------------------------------

    @classmethod
    def measure(cls, *, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                nvme_path: str | os.PathLike | None = None, ranks: int = 1) -> "MachineProfile":
        """Measure this machine (a few seconds): a matrix product, the host Adam kernel and the 8-bit Adam's host
        update per dtype of ``dtypes`` (and the 8-bit update of bf16 parameters rounded stochastically when
        ``torch.bfloat16`` is one), an elementwise operator and a copy; the disk tier's read and write bandwidth on
        ``nvme_path`` (a directory; ``None``: not measured); with ``ranks`` > 1 a gloo all-reduce between
        2 processes (a few seconds more)."""
        if isinstance(dtypes, torch.dtype) or not dtypes:
            raise InvalidArgumentError("dtypes", dtypes, "a non-empty sequence of torch.float32, torch.bfloat16, "
                                                         "torch.float16")
        for dtype in dtypes:
            if dtype not in DTYPES.values():
                raise InvalidArgumentError("dtypes", dtype, "torch.float32, torch.bfloat16 or torch.float16")
        check_number("ranks", ranks, low=1, integer=True)
        read = write = disk_step = None
        if nvme_path is not None:
            read, write = measure_bandwidth(nvme_path, nbytes=2**30, block=16 * 2**20)
            disk_step = _disk_step_bytes_per_s(nvme_path)
        return cls(matmul_flops={dtype_name(d): _matmul_flops(d) for d in dtypes},
                   elementwise_bytes_per_s=_elementwise_bytes_per_s(),
                   adam_elements_per_s={dtype_name(d): _adam_elements_per_s(d) for d in dtypes},
                   low_bit_adam_elements_per_s={dtype_name(d): _low_bit_adam_elements_per_s(d) for d in dtypes},
                   rounded_adam_elements_per_s=(_low_bit_adam_elements_per_s(torch.bfloat16, rounded=True)
                                                if torch.bfloat16 in dtypes else None),
                   copy_bytes_per_s=_copy_bytes_per_s(),
                   disk_read_bytes_per_s=read, disk_write_bytes_per_s=write, disk_step_bytes_per_s=disk_step,
                   collective_bytes_per_s=_collective_bytes_per_s() if ranks > 1 else None)

    def measure_operators(self, signatures: dict[str, Callable[[], Any]], budget_s: float = 30.0,
                          again: bool = False) -> None:
        """Time each not yet measured operator of ``signatures`` (signature -> a function that runs it once
        on real tensors, see :mod:`chunkmem.plan.cost_model`) and keep its seconds in :attr:`op_seconds`. Each
        runs once to warm up and then until about 50 ms have passed (at least twice, at most 7 times); the
        fastest run is kept (on a shared machine the others are the ones another job slowed down). Stops
        measuring after ``budget_s`` seconds in all (the rest falls back on the FLOP and bandwidth figures). ``again``: time the operators already measured too and keep the
        faster figure (a second look, at another moment of a shared machine)."""
        begin = time.perf_counter()
        for key, run in signatures.items():
            if key in self.op_seconds and not again:
                continue
            if time.perf_counter() - begin > budget_s:
                break
            try:
                seconds = _time_call(run)
            except Exception:  # an operator that cannot run on made-up inputs keeps the fallback figures
                continue
            self.op_seconds[key] = min(seconds, self.op_seconds.get(key, seconds))


# ---- the measurements ------------------------------------------------------------------------------------

def _time_call(run: Callable[[], Any], target_s: float = 0.05, most: int = 7) -> float:
    """Seconds of ``run()``: the fastest of at least 2 and at most ``most`` runs after a warm-up, running
    until ``target_s`` seconds have passed."""
    run()
    times: list[float] = []
    while len(times) < most and (len(times) < 2 or sum(times) < target_s):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return min(times)


def _matmul_flops(dtype: torch.dtype) -> float:
    """FLOP/s of a (1024 x 1024) @ (1024 x 1024) product in ``dtype`` (smaller where it is slow)."""
    size = 1024
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    seconds = _time_call(lambda: torch.mm(a, b))
    if seconds > 0.5:  # a slow dtype (fp16 without native support): one smaller product is enough
        size = 256
        a, b = a[:size, :size].contiguous(), b[:size, :size].contiguous()
        seconds = _time_call(lambda: torch.mm(a, b))
    return 2 * size ** 3 / seconds


def _elementwise_bytes_per_s() -> float:
    """Bytes/s (read + written) of ``torch.add`` over 16M fp32 elements into a fresh output."""
    a, b = torch.randn(2**24), torch.randn(2**24)
    return 3 * a.nbytes / _time_call(lambda: torch.add(a, b))


def _copy_bytes_per_s() -> float:
    """Bytes/s of ``copy_`` between two 64 MiB buffers (what moving a chunk between tiers costs here)."""
    src, dst = torch.randn(2**24), torch.empty(2**24)
    return src.nbytes / _time_call(lambda: dst.copy_(src))


def _adam_elements_per_s(dtype: torch.dtype) -> float:
    """Parameters/s of one host Adam update (the library's kernel) of a model in ``dtype``: fp32 master
    and moments, a ``dtype`` gradient and, for 16-bit models, the ``dtype`` parameter copy written."""
    n = 2**22
    master, exp_avg, exp_avg_sq = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad = torch.randn(n).to(dtype)
    out = None if dtype == torch.float32 else torch.empty(n, dtype=dtype)
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    step = [0]

    def run() -> None:
        step[0] += 1
        adam_update_(master, grad, exp_avg, exp_avg_sq, step[0], hyper, 1.0, out)
    return n / _time_call(run)


def _low_bit_adam_elements_per_s(dtype: torch.dtype, rounded: bool = False) -> float:
    """Parameters/s of one host update of the 8-bit Adam (:func:`chunkmem.optim.low_bit_adam.update_segments_`, as
    its rule runs it over a chunk) of a model in ``dtype``: uint8 codes and their block scales, a ``dtype``
    gradient, an fp32 master and, for 16-bit models, the ``dtype`` parameter copy written; ``rounded``: bf16
    parameters that are their own masters, rounded stochastically, their random numbers drawn as the step draws
    them (:mod:`chunkmem.optim.rounding_draws`)."""
    from ..optim.blockwise import BLOCK_SIZE
    from ..optim.low_bit_adam import LowBitHyper, Moments, Segment, update_segments_
    from ..optim.rounding_draws import draws_from

    n = 2**22
    master = torch.randn(n).to(torch.bfloat16 if rounded else torch.float32)
    grad = torch.randn(n).to(dtype)
    moments = Moments(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                      torch.zeros(n // BLOCK_SIZE), torch.zeros(n // BLOCK_SIZE),
                      torch.zeros(1, dtype=master.dtype), torch.zeros(1, dtype=master.dtype))
    out = None if dtype == torch.float32 or rounded else torch.empty(n, dtype=dtype)
    hyper = LowBitHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    step = [0]

    def run() -> None:
        step[0] += 1
        random = draws_from(torch.device("cpu"), torch.get_rng_state()).draw(n) if rounded else None
        update_segments_(master, grad, moments, [Segment(0, n, True, 0, hyper, step[0])], 1.0, out, random)
    return n / _time_call(run)


def _disk_step_bytes_per_s(nvme_path: str | os.PathLike, width: int = 2048, layers: int = 16) -> float:
    """Bytes/s (read + written) of the streamed optimizer step whose state (bf16 model: fp32 master,
    exp_avg, exp_avg_sq) rests on the disk tier under ``nvme_path``: ``layers`` bias-free ``width`` x
    ``width`` linear layers (67M parameters: 800 MB read and 800 MB written a step), over the second and
    third steps."""
    import torch.nn as nn

    from ..distributed.shard_strategy import TensorShardStrategy
    from ..model.sharded_model import ShardedModelV2
    from ..optim.adam import HybridAdam
    from ..optim.sharded_optimizer import ShardedOptimizerV2

    module = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = ShardedModelV2(module, TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.bfloat16,
                           offload_optimizer="disk", nvme_path=nvme_path)
    optim = ShardedOptimizerV2(model, HybridAdam(model.parameters(), lr=1e-6))
    ledger = model.runtime.ledger
    x = torch.randn(1, width)
    moved, seconds = 0, 0.0
    for i in range(3):  # the first step also turns the files' preallocated extents into written ones
        optim.backward(model(x).float().sum())
        before = ledger.read_from_disk + ledger.written_to_disk
        begin = time.perf_counter()
        optim.step()
        if i:
            seconds += time.perf_counter() - begin
            moved += ledger.read_from_disk + ledger.written_to_disk - before
        optim.zero_grad()
    del optim, model, ledger, module
    gc.collect()  # the model's scratch directory goes with it
    return moved / seconds


def _collective_entry(rank: int, directory: str, nbytes: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        buf = torch.ones(nbytes // 4)
        dist.all_reduce(buf)
        times = []
        for _ in range(3):
            dist.barrier()
            begin = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - begin)
        if rank == 0:
            out.put(statistics.median(times))
    finally:
        dist.destroy_process_group()


def _collective_bytes_per_s(nbytes: int = 16 * 2**20) -> float:
    """Bytes each rank sends per second in a gloo all-reduce of ``nbytes`` between 2 processes (a ring
    all-reduce sends ``2 (p - 1) / p`` of the buffer: ``nbytes`` at 2 ranks)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        processes = [context.Process(target=_collective_entry, args=(r, directory, nbytes, out)) for r in range(2)]
        for p in processes:
            p.start()
        try:
            seconds = out.get(timeout=120)
        finally:
            for p in processes:
                p.join(timeout=30)
    return nbytes / seconds
