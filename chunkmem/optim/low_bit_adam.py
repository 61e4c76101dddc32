"""Adam and AdamW with blockwise 8-bit moments: the update of torchao's ``AdamW8bit`` / ``Adam8bit``.

The state of one parameter is either **quantized**, where it holds at least 4096 elements in whole blocks of 256
(:func:`chunkmem.optim.blockwise.quantizes`, decided on the whole parameter): ``exp_avg`` and ``exp_avg_sq`` as
``uint8`` codes, one per element, and one fp32 scale per block of the parameter (:mod:`chunkmem.optim.blockwise`);
or **plain**: fp32 moments, as the reference keeps them for small tensors. Sharded over ranks, a block may be cut
by a shard boundary: each rank steps its part (:func:`step_cut_segment_`), and once the ranks agree on the
block's largest magnitudes, quantizes it with the whole block's scale (:func:`store_cut_segment_`).

One step of a segment (a run of elements with one set of hyper-parameters and one step count), in the order and
with the roundings of the reference's step run eagerly (``single_param_adam``)::

    g = grad (fp32) [* multiplier]
    p = p - (lr * weight_decay) * p                 AdamW        g = g + weight_decay * p     Adam
    m = dequantize(m).lerp(g, 1 - beta1)            v = dequantize(v).lerp(g * g, 1 - beta2)
    m, v quantized into the state (the update reads the unquantized m and v)
    p = p - lr * (m / (1 - beta1**step)) / (sqrt(v) / sqrt(1 - beta2**step) + eps)

``lr``, the bias corrections and ``lr * weight_decay`` are fp32 scalars computed with torch from an fp32 ``lr``
and an fp32 ``step``, as the reference holds them. :func:`update_segments_` runs every segment of a chunk in one
call: the one-pass C++ kernel (``csrc/low_bit_adam.cpp``) on contiguous host buffers, checked bit for bit against
:func:`update_segment_torch_` when it loads, else (another device, ``CHUNKMEM_DISABLE_CPP_ADAM=1``, no compiler)
the torch-op formulation segment by segment.

torchao runs its step under ``torch.compile``: the compiled code fuses and reorders some fp32 operations, so its
parameters differ from the eager formulation's by about one fp32 rounding per step, and a code flips only where a
scaled moment lies within such a rounding of a half-way point (``tests/test_low_bit_state.py`` measures both).
"""
from __future__ import annotations

import ctypes
import functools
import platform
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..core.native_build import CSRC, LoadedOnce, env_flag
from ..errors import InvalidArgumentError
from . import host_adam_ext
from .blockwise import (BLOCK_SIZE, block_scale, bucket_words, dequantize, dequantize_part, dynamic_map,
                        quantize_, quantize_part_)

SOURCE = CSRC / "low_bit_adam.cpp"
ABI_VERSION = 6
_APPLY_MULT, _DECOUPLED, _L2, _QUANTIZED = 1, 2, 4, 8
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class LowBitHyper:
    """One param group's hyper-parameters (as torchao's ``AdamW8bit`` takes them; ``decoupled``: AdamW's weight
    decay, else Adam's L2 term)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @staticmethod
    def of_group(group: dict[str, Any], decoupled: bool) -> "LowBitHyper":
        """The hyper-parameters of one param group of torchao's 8-bit Adams (``decoupled``: the optimizer's) or of
        a :class:`~chunkmem.HybridAdam` with 8-bit state (its ``adamw_mode``; its ``bias_correction`` must be
        ``True``: the update always corrects the moments' bias, as torchao's does)."""
        if not group.get("bias_correction", True):
            raise InvalidArgumentError("bias_correction", group["bias_correction"],
                                       "True with state_dtype='8bit' (8-bit Adam always corrects the moments' bias)")
        beta1, beta2 = group["betas"]
        return LowBitHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                           float(group["weight_decay"]), bool(group.get("adamw_mode", decoupled)))


@dataclass(frozen=True)
class StepScalars:
    """The fp32 scalars of one step (each a Python float holding an fp32 value)."""

    lr: float
    lr_wd: float
    bias_correction1: float
    bias_correction2_sqrt: float

    @staticmethod
    @functools.lru_cache(maxsize=1024)  # every segment of every chunk asks; few (group, step) pairs differ
    def of(hyper: LowBitHyper, step: int) -> "StepScalars":
        """The scalars of step number ``step`` (1 for the first), computed as the reference does."""
        lr = torch.tensor(hyper.lr, dtype=torch.float32)
        count = torch.tensor(float(step), dtype=torch.float32)
        bc1 = 1 - hyper.beta1 ** count
        bc2 = 1 - hyper.beta2 ** count
        return StepScalars(lr.item(), (lr * hyper.weight_decay).item(), bc1.item(), bc2.sqrt().item())


@dataclass(frozen=True)
class Segment:
    """A run of a chunk's elements updated alike: ``numel`` elements from ``start`` (in the chunk's flat buffers)
    whose state is quantized (``state_base``: the index of its first block scale) or plain (``state_base``: the
    index of its first fp32 moment). A ``cut`` segment is the part of one quantized block that lies in this
    rank's shard, the block cut by a shard boundary: its scale (at ``state_base``) is the whole block's, which
    the ranks holding its parts agree on (:func:`step_cut_segment_`, :func:`store_cut_segment_`)."""

    start: int
    numel: int
    quantized: bool
    state_base: int
    hyper: LowBitHyper
    step: int
    cut: bool = False

    @property
    def blocks(self) -> int:
        """The block scales the segment's state holds (0 for plain state)."""
        if not self.quantized:
            return 0
        return 1 if self.cut else self.numel // BLOCK_SIZE


def random_part(random: torch.Tensor | None, segment: Segment) -> torch.Tensor | None:
    """``segment``'s stochastic-rounding numbers from its shard's (``None``: no stochastic rounding)."""
    return None if random is None else random[segment.start:segment.start + segment.numel]


@dataclass
class Moments:
    """A chunk's moments (this rank's shard): ``codes_*`` ``uint8`` per element, ``scales_*`` fp32 per block of the
    quantized segments, ``plain_*`` per element of the plain ones: fp32, or bf16 beside bf16 parameters that are
    their own masters (as the reference keeps the state of a small bf16 tensor in bf16)."""

    codes_m: torch.Tensor
    codes_v: torch.Tensor
    scales_m: torch.Tensor
    scales_v: torch.Tensor
    plain_m: torch.Tensor
    plain_v: torch.Tensor

    def of(self, segment: Any) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], ...]:
        """The ``exp_avg`` and ``exp_avg_sq`` of ``segment`` (a :class:`Segment`): ``(codes, scales)`` pairs, or
        plain tensors."""
        a, n, base = segment.start, segment.numel, segment.state_base
        if segment.quantized:
            blocks = segment.blocks
            return ((self.codes_m[a:a + n], self.scales_m[base:base + blocks]),
                    (self.codes_v[a:a + n], self.scales_v[base:base + blocks]))
        return self.plain_m[base:base + n], self.plain_v[base:base + n]


@functools.lru_cache(maxsize=None)
def _maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The signed and unsigned maps on ``device``, made once (read only)."""
    return dynamic_map(True, device), dynamic_map(False, device)


def _read(state: torch.Tensor | tuple[torch.Tensor, torch.Tensor], qmap: torch.Tensor, cut: bool) -> torch.Tensor:
    if not isinstance(state, tuple):
        return state.float()
    return dequantize_part(state[0], state[1], qmap) if cut else dequantize(state[0], state[1], qmap)


def _write(state: torch.Tensor | tuple[torch.Tensor, torch.Tensor], values: torch.Tensor, qmap: torch.Tensor) -> None:
    if isinstance(state, tuple):
        quantize_(values, state[0], state[1], qmap)
    else:
        state.copy_(values)


def update_segment_torch_(master: torch.Tensor, grad: torch.Tensor, moments: Moments, segment: Segment,
                          multiplier: float = 1.0, param_out: torch.Tensor | None = None,
                          random: torch.Tensor | None = None) -> None:
    """One step of ``segment`` (not ``cut``) in torch ops (module docstring), in place: ``master`` (fp32, or bf16
    parameters that are their own masters, written back by :func:`round_stochastically` with ``random``, the
    segment's numbers), ``grad`` (any float dtype) and ``param_out`` (the 16-bit copy, or ``None``) are the chunk's
    flat buffers."""
    qmap_m, qmap_v = _maps(master.device)
    m, v = _step_values_(master, grad, moments, segment, multiplier, param_out, random)
    state_m, state_v = moments.of(segment)
    _write(state_m, m, qmap_m)
    _write(state_v, v, qmap_v)


def step_cut_segment_(master: torch.Tensor, grad: torch.Tensor, moments: Moments, segment: Segment,
                      multiplier: float = 1.0, param_out: torch.Tensor | None = None,
                      random: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of a ``cut`` segment's step (arguments as for :func:`update_segment_torch_`): its
    parameters updated, its new ``exp_avg`` and ``exp_avg_sq`` returned unquantized (fp32). Their codes need the
    block's new scale, the largest magnitude over every rank's part of it: :func:`store_cut_segment_` writes them
    once the ranks agree on it. (The parameters read the unquantized moments, so they need no scale.)"""
    return _step_values_(master, grad, moments, segment, multiplier, param_out, random)


def store_cut_segment_(moments: Moments, segment: Segment, new: tuple[torch.Tensor, torch.Tensor],
                       absmax: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The second half of a ``cut`` segment's step: its ``new`` moments (from :func:`step_cut_segment_`)
    quantized with the whole block's largest magnitudes ``absmax`` (of ``exp_avg``, of ``exp_avg_sq``: one fp32
    element each, over every rank's part), which become the block's scales."""
    for state, values, largest, qmap in zip(moments.of(segment), new, absmax, _maps(new[0].device)):
        scale = block_scale(largest.reshape(1))
        quantize_part_(values, state[0], scale, qmap)
        state[1].copy_(scale)


def _step_values_(master: torch.Tensor, grad: torch.Tensor, moments: Moments, segment: Segment,
                  multiplier: float, param_out: torch.Tensor | None,
                  random: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step of ``segment``'s parameters, written; its new moments returned, not yet stored."""
    hyper = segment.hyper
    scalars = StepScalars.of(hyper, segment.step)
    qmap_m, qmap_v = _maps(master.device)
    a, b = segment.start, segment.start + segment.numel
    lr = torch.tensor(scalars.lr, dtype=torch.float32)
    p = master[a:b].float()
    g = grad[a:b].float()
    if multiplier != 1.0:
        g = g * multiplier
    if hyper.decoupled:
        p = p - torch.tensor(scalars.lr_wd, dtype=torch.float32) * p
    else:
        g = g + hyper.weight_decay * p
    state_m, state_v = moments.of(segment)
    m = _read(state_m, qmap_m, segment.cut).lerp(g, 1 - hyper.beta1)
    v = _read(state_v, qmap_v, segment.cut).lerp(g.square(), 1 - hyper.beta2)
    denom = (v.sqrt() / torch.tensor(scalars.bias_correction2_sqrt, dtype=torch.float32)) + hyper.eps
    p = p - lr * (m / torch.tensor(scalars.bias_correction1, dtype=torch.float32)) / denom
    master[a:b].copy_(p if master.dtype == torch.float32 else round_stochastically(p, random))
    if param_out is not None:
        param_out[a:b].copy_(p)
    return m, v


def round_stochastically(values: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` to bf16, away from zero where ``random`` (int32 in ``[0, 2**16)``, one per value) is below
    the 16 bits cut off, else towards zero: torchao's ``bf16_stochastic_round`` with its random numbers given."""
    bits = values.view(torch.int32)
    kept = bits & -65536  # 0xFFFF0000
    rounded = torch.where(random < (bits & 0xFFFF), kept + 0x10000, kept)
    return rounded.view(torch.float32).bfloat16()


# ---- the C++ kernel --------------------------------------------------------------------------------------


class _SegmentStruct(ctypes.Structure):
    _fields_ = [("start", ctypes.c_int64), ("n", ctypes.c_int64), ("state_base", ctypes.c_int64),
                ("flags", ctypes.c_int32), ("pad", ctypes.c_int32), ("random_base", ctypes.c_int64)] + [
        (name, ctypes.c_float) for name in ("lr", "lr_wd", "wd", "w1", "w2", "bc1", "bc2s", "eps", "mult")]


class _BuffersStruct(ctypes.Structure):
    _fields_ = [("master", ctypes.c_void_p), ("master_dtype", ctypes.c_int), ("random", ctypes.c_void_p),
                ("grad", ctypes.c_void_p), ("grad_dtype", ctypes.c_int),
                ("out", ctypes.c_void_p), ("out_dtype", ctypes.c_int),
                ("m_codes", ctypes.c_void_p), ("v_codes", ctypes.c_void_p), ("m_scales", ctypes.c_void_p),
                ("v_scales", ctypes.c_void_p), ("m_plain", ctypes.c_void_p), ("v_plain", ctypes.c_void_p),
                ("plain_dtype", ctypes.c_int),
                ("qmap_signed", ctypes.c_void_p), ("qmap_unsigned", ctypes.c_void_p),
                ("words_signed", ctypes.c_void_p), ("words_unsigned", ctypes.c_void_p),
                ("vsqrt", ctypes.c_void_p), ("vsqrt_mode", ctypes.c_int64)]


class LowBitKernel:
    """The loaded library, its dynamic maps and their tables of rounding thresholds; ``vsqrt``: the square root function torch's
    ``Tensor.sqrt`` calls (MKL VML) where that is not the correctly rounded one, else ``None``; ``exact``: whether
    it matched :func:`update_segment_torch_` bit for bit at load."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.chunkmem_low_bit_adam.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.chunkmem_low_bit_adam.restype = ctypes.c_int
        self.qmap_m, self.qmap_v = _maps(torch.device("cpu"))
        first, count = lib.chunkmem_low_bit_first_bucket(), lib.chunkmem_low_bit_buckets()
        self.words_m, self.words_v = (bucket_words(q, first, count) for q in (self.qmap_m, self.qmap_v))
        self.vsqrt: int | None = None
        self.exact = False

    def update(self, master: torch.Tensor, grad: torch.Tensor, moments: Moments, segments: Sequence[Segment],
               multiplier: float = 1.0, param_out: torch.Tensor | None = None, nthreads: int | None = None,
               random: torch.Tensor | None = None) -> None:
        """Every segment's step in one pass (arguments as for :func:`update_segments_`)."""
        table = (_SegmentStruct * len(segments))()
        for row, s in zip(table, segments):
            row.random_base = s.start  # the numbers are indexed like the master
            h, sc = s.hyper, StepScalars.of(s.hyper, s.step)
            flags = ((_APPLY_MULT if multiplier != 1.0 else 0) | (_QUANTIZED if s.quantized else 0)
                     | (_DECOUPLED if h.decoupled else (_L2 if h.weight_decay != 0 else 0)))
            row.start, row.n, row.state_base, row.flags = s.start, s.numel, s.state_base, flags
            row.lr, row.lr_wd, row.wd, row.w1, row.w2 = sc.lr, sc.lr_wd, h.weight_decay, 1 - h.beta1, 1 - h.beta2
            row.bc1, row.bc2s, row.eps, row.mult = sc.bias_correction1, sc.bias_correction2_sqrt, h.eps, multiplier
        buffers = _BuffersStruct(
            master.data_ptr(), _DTYPE_CODES[master.dtype], None if random is None else random.data_ptr(),
            grad.data_ptr(), _DTYPE_CODES[grad.dtype],
            None if param_out is None else param_out.data_ptr(), -1 if param_out is None else _DTYPE_CODES[param_out.dtype],
            moments.codes_m.data_ptr(), moments.codes_v.data_ptr(), moments.scales_m.data_ptr(),
            moments.scales_v.data_ptr(), moments.plain_m.data_ptr(), moments.plain_v.data_ptr(),
            _DTYPE_CODES[moments.plain_m.dtype],
            self.qmap_m.data_ptr(), self.qmap_v.data_ptr(), self.words_m.data_ptr(), self.words_v.data_ptr(),
            self.vsqrt, host_adam_ext.VML_SQRT_MODE)
        threads = torch.get_num_threads() if nthreads is None else nthreads
        if self.lib.chunkmem_low_bit_adam(ctypes.byref(buffers), table, len(segments), threads) != 0:
            raise ValueError("a quantized segment is not made of whole blocks of 256 elements")


def _load() -> LowBitKernel:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the low-bit kernel is for x86-64, not {platform.machine()}")
    if not sys.platform.startswith(("linux", "darwin")):
        raise RuntimeError(f"the low-bit kernel is built for Linux and macOS only, not {sys.platform}")
    lib, _, _ = host_adam_ext.build_on_torchs_openmp(SOURCE, "low_bit_adam")
    if lib.chunkmem_low_bit_adam_abi() != ABI_VERSION:
        raise RuntimeError("the low-bit kernel library has another ABI version")
    if not lib.chunkmem_low_bit_adam_cpu_ok():
        raise RuntimeError("the CPU lacks AVX2, FMA or F16C")
    kernel = LowBitKernel(lib)
    vml = host_adam_ext._find_vml_sqrt()
    for vsqrt in (None, vml) if vml is not None else (None,):
        kernel.vsqrt = vsqrt
        if _matches_torch(kernel):
            kernel.exact = True
            return kernel
    raise RuntimeError("its results differ from the torch-op formulation on this machine")


def _matches_torch(kernel: LowBitKernel) -> bool:
    """Whether two steps of the kernel equal :func:`update_segment_torch_` bit for bit on random data covering
    both kinds of segment, both weight decays, a multiplier, every 16-bit copy and bf16 masters."""
    gen = torch.Generator().manual_seed(0)
    n = 8192 + 300
    hyper = (LowBitHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True), LowBitHyper(3e-3, 0.8, 0.99, 1e-6, 0.01, False))
    start = torch.randn(n, generator=gen)
    random = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    for out_dtype, master_dtype in ((None, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float32), (None, torch.bfloat16)):
        results = []
        for run_kernel in (True, False):
            master = start.to(master_dtype, copy=True)
            state = Moments(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                            torch.zeros(32), torch.zeros(32), torch.zeros(300, dtype=master_dtype),
                            torch.zeros(300, dtype=master_dtype))
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            drawn = None if master_dtype == torch.float32 else random
            for step in (1, 2):
                grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(out_dtype or master_dtype)
                segments = [Segment(0, 4096, True, 0, hyper[0], step), Segment(4096, 4096, True, 16, hyper[1], step),
                            Segment(8192, 300, False, 0, hyper[step - 1], step)]
                if run_kernel:
                    kernel.update(master, grad, state, segments, 0.5, out, nthreads=2, random=drawn)
                else:
                    for segment in segments:
                        part = None if drawn is None else drawn[segment.start:segment.start + segment.numel]
                        update_segment_torch_(master, grad, state, segment, 0.5, out, part)
            results.append((master, state, out))
        (a, sa, oa), (b, sb, ob) = results
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(vars(sa).values(), vars(sb).values()))
        if not same or (oa is not None and not torch.equal(oa.view(torch.int16), ob.view(torch.int16))):
            return False
    return True


_KERNEL = LoadedOnce(_load, "chunkmem: the C++ low-bit Adam kernel is unavailable, using torch ops instead ({error})")


def kernel() -> LowBitKernel | None:
    """The loaded kernel, or ``None`` where it is unavailable or disabled (``CHUNKMEM_DISABLE_CPP_ADAM=1``)."""
    if env_flag(host_adam_ext.DISABLE_ENV):
        return None
    return _KERNEL.get(stacklevel=3)


def update_segments_(master: torch.Tensor, grad: torch.Tensor, moments: Moments, segments: Sequence[Segment],
                     multiplier: float = 1.0, param_out: torch.Tensor | None = None,
                     random: torch.Tensor | None = None) -> None:
    """One step of every segment of a chunk, in place. ``master``: the fp32 master (or fp32 parameters), or bf16
    parameters that are their own masters, rounded stochastically with ``random`` (int32 in ``[0, 2**16)``, one
    per element, indexed like ``master``: :mod:`chunkmem.optim.rounding_draws`); ``grad``: the chunk's flat gradient (fp32, fp16 or bf16), multiplied
    by ``multiplier`` first (the loss scale's inverse and clipping; 1 leaves it untouched); ``param_out``: the
    16-bit parameter copy to write, or ``None``; all flat, indexed like the chunk's shard. No segment is ``cut``."""
    if any(segment.cut for segment in segments):
        raise ValueError("a cut segment is stepped in two halves (step_cut_segment_, store_cut_segment_)")
    tensors = (master, grad, *vars(moments).values()) + tuple(t for t in (param_out, random) if t is not None)
    host = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    k = kernel() if host and grad.dtype in _DTYPE_CODES else None
    if k is not None:
        k.update(master, grad, moments, segments, multiplier, param_out, random=random)
        return
    for segment in segments:
        part = None if random is None else random[segment.start:segment.start + segment.numel]
        update_segment_torch_(master, grad, moments, segment, multiplier, param_out, part)
