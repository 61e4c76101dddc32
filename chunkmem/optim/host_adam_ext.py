"""The one-pass host Adam kernel (``csrc/host_adam.cpp``): built on first use, loaded with ctypes.

:func:`try_update` runs one Adam step over flat CPU buffers in a single pass over memory (read the
gradient once, update master and both moments in registers, write them and the 16-bit parameter copy)
and returns ``True``, or returns ``False`` when the kernel does not apply (CUDA or non-contiguous
tensors, another dtype, overlapping buffers, the kernel unavailable or disabled), leaving everything
untouched so that the caller runs the torch-op formulation instead.

The kernel is a plain C ABI library compiled from one source file by the C++ compiler (``$CXX``, else
``g++``, ``c++`` or ``clang++``) with no torch headers, no pybind11 and no ninja, so it builds in some
ten seconds wherever a compiler is installed. Its vector body is compiled for AVX2 and for AVX-512 and
runs the AVX-512 one where the CPU has it (``HostAdamKernel.avx512``; the same bits either way). Where
torch runs its operators on an OpenMP runtime (GNU's ``libgomp`` in the PyPI Linux wheels), the library
is built with ``-fopenmp`` and splits an update over the threads of that same runtime (``openmp``): a
pool of its own would start threads for each update and, right after a torch operator, share the cores
with torch's threads, which spin for a while after each operator (measured: 5-7% slower at 50M
parameters on 2 cores). Where ``-fopenmp`` does not build, or the library would bring a runtime of its
own (a compiler whose OpenMP is another library than torch's), it starts threads for each update.

Nothing happens at ``import chunkmem``: the first host update builds the library into chunkmem's cache
folder (see :mod:`chunkmem.core.native_build`: a changed source rebuilds), later processes load the
cached library. A failed build (no compiler, not x86-64, a CPU without AVX2/FMA/F16C, ...) is remembered
for the process, reported once with a warning, and every update then takes the torch-op path.
``CHUNKMEM_DISABLE_CPP_ADAM=1`` disables the kernel (checked at every update).

Rounding. The kernel performs the torch-op path's operations in the same order with the same fp32
roundings. Two things differ from one torch build and CPU to another, and the kernel has a variant for
each, chosen at load by comparing the kernel with the torch-op path on a sample (:func:`_pick_rounding`):

* FMA: torch's AVX2 / AVX-512 kernels round the lerp, addcmul and add-with-alpha as fused
  multiply-adds, its DEFAULT build does not.
* The square root: ``"ieee"``, the instruction set's (correctly rounded, as in torch's own fused
  AdamW), or ``"vml"``, MKL's ``vmsSqrt`` in high-accuracy mode, the function torch's CPU
  ``Tensor.sqrt`` calls in the MKL builds (the PyPI x86-64 wheels), looked up in torch's own library.
  On some CPUs (AMD EPYC with AVX2, for one) that sqrt is one ulp off for about a sixth of the inputs;
  a denominator one ulp off tips the rounding of the updated master in about 1 element in 400 to 2,000,
  and over a few steps such ulps exceed a 1e-6 relative tolerance. With ``"vml"`` the kernel still reads
  and writes each buffer once, computing tiles of 512 elements held in the L1 cache in two halves
  around one ``vmsSqrt`` call per tile.

fp32 gradients first: where the kernel reproduces ``torch.optim.AdamW(fused=True)`` (FMA, IEEE square
root, and the last ``numel % 8`` elements of each parameter rounded as that kernel's per-element loop
does: :func:`tail_runs`, checked at load by :func:`_probe_fused_tail`), fp32 updates take that variant,
one pass at the bandwidth bound, and equal the fused AdamW bit for bit (:func:`fp32_reference`). Only
where it does not do they follow the torch-op path (the for-loop AdamW) as below.

The first variant (IEEE square root before VML, FMA before none) that equals the torch-op path bit
for bit on the sample, moments, masters and 16-bit copies alike, is taken (``exact``). Where none does,
the kernel keeps the IEEE square root and the rounding that gives equal moments; fp32 gradients then
keep the torch-op path, so fp32 training stays bitwise equal to ``torch.optim.AdamW``, unless
``CHUNKMEM_CPP_ADAM_FP32=1`` or a caller's ``fp32_within_ulp=True`` asks for the kernel (speed over
bitwise equality); 16-bit gradients, whose reference tests compare to a tolerance, always use the
kernel, and always with the IEEE square root: the mixed-precision step is the offload hot path, MKL's
square root costs it 1.2-1.4x per thread, and its masters stay within one fp32 ulp of the torch-op
path's either way.
"""
from __future__ import annotations

import ctypes
import math
import platform
import sys
import threading
from pathlib import Path

import torch

from ..core.native_build import CSRC, LoadedOnce, env_flag, load_library

DISABLE_ENV = "CHUNKMEM_DISABLE_CPP_ADAM"
FP32_ENV = "CHUNKMEM_CPP_ADAM_FP32"
SOURCE = CSRC / "host_adam.cpp"
CXXFLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno")
ABI_VERSION = 7
# VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode in which torch's Tensor.sqrt calls vmsSqrt
VML_SQRT_MODE = 0x2 | 0x140000 | 0x100
SQRT_VARIANTS = ("ieee", "vml")
# The 16-bit parameter copy is written with streaming (non-temporal) stores from this many elements
# on: it is not read back by the update, and streaming stores spare the read-for-ownership of its
# cache lines (2 of the 30 bytes per parameter an ordinary store moves). Below it, it may stay in cache.
NT_MIN_ELEMENTS = 1 << 20

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
GradPieces = list[tuple[int, torch.Tensor]]
"""A gradient in pieces: ``(offset, tensor)``, each tensor the gradient of its ``numel()`` elements from
element ``offset`` of the buffers it updates (sorted by offset, disjoint)."""
_APPLY_MULT, _DECOUPLED, _L2 = 1, 2, 4


def disabled() -> bool:
    """Whether ``CHUNKMEM_DISABLE_CPP_ADAM`` turns the kernel off."""
    return env_flag(DISABLE_ENV)


class HostAdamKernel:
    """The loaded library. ``fma``: whether it rounds like torch's FMA kernels; ``sqrt``: its square
    root, ``"ieee"`` or ``"vml"`` (see the module docstring); ``vml_sqrt``: the address of MKL's
    ``vmsSqrt`` in torch's library, ``None`` where torch has none; ``exact``: whether it matched the
    torch-op path bit for bit at load; ``avx512``: whether updates run the AVX-512 body by default
    (where the CPU and the OS have it; else the AVX2 one: both give the same bits); ``openmp``: whether
    it splits updates over torch's OpenMP threads (else threads it starts); ``build_seconds``:
    compile time (``None`` if the library came from the cache); ``path``: the library file."""

    def __init__(self, lib: ctypes.CDLL, path: Path, build_seconds: float | None,
                 vml_sqrt: int | None = None) -> None:
        self.lib, self.path, self.build_seconds = lib, path, build_seconds
        self.fma, self.sqrt, self.exact = True, "ieee", False
        self.fused_tail: int | None = None
        self.vml_sqrt = vml_sqrt
        self._avx512_ok = bool(lib.chunkmem_host_adam_avx512_ok())
        self.avx512 = self._avx512_ok
        self.openmp = bool(lib.chunkmem_host_adam_openmp())
        f, i, i64, ptr = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.chunkmem_host_adam.argtypes = ([ptr, ptr, i, ptr, ptr, ptr, i, i64] + [f] * 9
                                           + [i, i, ptr, i64, i, i64, ptr, i64, ptr, ptr, i64, i, ptr, ptr, ptr])
        lib.chunkmem_host_adam.restype = i
        lib.chunkmem_stream_4r3w.argtypes = [ptr, ptr, ptr, ptr, i64, f, i]
        lib.chunkmem_stream_4r3w.restype = None
        lib.chunkmem_stream_mixed.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, f, i]
        lib.chunkmem_stream_mixed.restype = None
        lib.chunkmem_sum_squares.argtypes = [ptr, i, i64, i, ctypes.POINTER(ctypes.c_double)]
        lib.chunkmem_sum_squares.restype = i
        self._update = lib.chunkmem_host_adam

    @property
    def avx512_available(self) -> bool:
        """Whether the CPU and its OS run the AVX-512 body (AVX512F and AVX512BW)."""
        return self._avx512_ok

    def update(self, master: torch.Tensor, grad: "torch.Tensor | GradPieces", exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: int, hyper, grad_multiplier: float = 1.0,
               param_out: torch.Tensor | None = None, *, fma: bool | None = None, sqrt: str | None = None,
               nt_min: int | None = None, nthreads: int | None = None, tail_runs: list[int] | None = None,
               avx512: bool | None = None, undo: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None
               ) -> None:
        """The update on already validated buffers (see :func:`try_update`); ``hyper`` an AdamHyper;
        ``grad`` one flat tensor or :data:`GradPieces` (elements no piece covers are not updated).
        ``fma``, ``sqrt``: a variant other than the chosen one; ``nt_min``: streaming stores of the
        16-bit copy from this many elements on; ``nthreads``: threads (default torch's); ``tail_runs``:
        flat ``[start, end, ...]`` element pairs (sorted, disjoint) rounded as the per-element tail of
        ``torch.optim.AdamW(fused=True)`` (fp32 gradient, no 16-bit copy, FMA, IEEE square root only);
        ``avx512``: the AVX-512 body (``True``, only where ``avx512_available``) or the AVX2 one (``False``)
        instead of the default (``self.avx512``); ``undo``: three fp32 buffers like ``master`` that receive
        ``master``, ``exp_avg`` and ``exp_avg_sq`` as they were before the update (every element), each block
        copied as the update reads it."""
        pieces = grad if isinstance(grad, list) else None
        grad_ptr = None if pieces is not None else grad.data_ptr()
        if pieces is not None:
            grad = pieces[0][1]  # (for its dtype)
            starts = (ctypes.c_void_p * len(pieces))(*(t.data_ptr() for _, t in pieces))
            bounds = (ctypes.c_int64 * (2 * len(pieces)))(*(x for o, t in pieces for x in (o, o + t.numel())))
        if sqrt is None:  # the probed variant for fp32 gradients, the fast one for 16-bit (module docstring)
            sqrt = self.sqrt if grad.dtype == torch.float32 else "ieee"
        if sqrt not in SQRT_VARIANTS or (sqrt == "vml" and self.vml_sqrt is None):
            raise ValueError(f"sqrt={sqrt!r}: expected one of {SQRT_VARIANTS}, 'vml' only where torch has "
                             f"MKL's vmsSqrt (here: {self.vml_sqrt is not None})")
        if avx512 is None:
            avx512 = self.avx512
        if avx512 and not self._avx512_ok:  # the AVX-512 body would stop the process on an illegal instruction
            raise ValueError("avx512=True: this CPU (or its OS) has no AVX-512 (AVX512F and AVX512BW); use "
                             "avx512=False, and leave HostAdamKernel.avx512 False here")
        flags, decay, wd = 0, 1.0, 0.0
        if grad_multiplier != 1.0:
            flags |= _APPLY_MULT
        if hyper.weight_decay != 0:
            if hyper.adamw_mode:
                flags, decay = flags | _DECOUPLED, 1 - hyper.lr * hyper.weight_decay
            else:
                flags, wd = flags | _L2, hyper.weight_decay
        bias_correction1, bias_correction2 = hyper.bias_corrections(step)
        step_size = hyper.lr / bias_correction1
        out_ptr, out_code = None, -1
        if param_out is not None:
            out_ptr, out_code = param_out.data_ptr(), _DTYPE_CODES[param_out.dtype]
        if out_ptr is not None and out_ptr == grad_ptr:
            nt_min = 1 << 62  # the copy overwrites the gradient it has just read: cached stores
        rc = self._update(master.data_ptr(), grad_ptr, _DTYPE_CODES[grad.dtype], exp_avg.data_ptr(),
                          exp_avg_sq.data_ptr(), out_ptr, out_code, master.numel(), grad_multiplier, decay, wd,
                          1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2, math.sqrt(bias_correction2), hyper.eps,
                          -step_size, flags, int(self.fma if fma is None else fma),
                          self.vml_sqrt if sqrt == "vml" else None, VML_SQRT_MODE,
                          default_threads() if nthreads is None else nthreads,
                          NT_MIN_ELEMENTS if nt_min is None else nt_min,
                          (ctypes.c_int64 * len(tail_runs))(*tail_runs) if tail_runs else None,
                          len(tail_runs) // 2 if tail_runs else 0,
                          *((starts, bounds, len(pieces)) if pieces is not None else (None, None, 0)),
                          int(avx512), *((t.data_ptr() for t in undo) if undo is not None else (None,) * 3))
        if rc != 0:
            raise RuntimeError(f"chunkmem host Adam kernel refused dtypes {grad.dtype} -> "
                               f"{None if param_out is None else param_out.dtype}")

    def sum_squares(self, x: torch.Tensor, nthreads: int | None = None) -> float:
        """The sum of the squares of ``x``'s elements (a contiguous fp32, fp16 or bf16 CPU tensor) in double:
        each square exact, the additions in an order fixed by the element count alone (not by the thread
        count); inf or NaN where an element is. Memory-bound (one read of ``x``); what ``vector_norm`` with
        ``dtype=torch.float32`` gives on a 16-bit CPU tensor at a tenth of the speed."""
        if x.device.type != "cpu" or not x.is_contiguous() or x.dtype not in _DTYPE_CODES:
            raise ValueError(f"sum_squares takes a contiguous fp32, fp16 or bf16 CPU tensor, not {x.dtype} on "
                             f"{x.device} (contiguous: {x.is_contiguous()})")
        out = ctypes.c_double()
        self.lib.chunkmem_sum_squares(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(),
                                      default_threads() if nthreads is None else nthreads, ctypes.byref(out))
        return out.value

    def stream_4r3w(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                    nthreads: int | None = None) -> None:
        """The bandwidth reference: ``a, b, c = (a, b, c) * 0.5 + d`` in place, fp32 (28 bytes/element)."""
        for t in (a, b, c, d):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or t.numel() != a.numel():
                raise ValueError("stream_4r3w takes four contiguous fp32 CPU tensors of one size")
        self.lib.chunkmem_stream_4r3w(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), a.numel(), 0.5,
                                      default_threads() if nthreads is None else nthreads)

    def stream_mixed(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, g: torch.Tensor, out: torch.Tensor,
                     nthreads: int | None = None) -> None:
        """The memory traffic of a mixed-precision update with trivial arithmetic: ``a, b, c = (a, b, c) *
        0.5 + g`` in place (fp32), ``out = half(a)`` (``g``, ``out``: fp16; streaming stores for ``out``)."""
        for t, dtype in ((a, torch.float32), (b, torch.float32), (c, torch.float32), (g, torch.float16),
                         (out, torch.float16)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" or t.numel() != a.numel():
                raise ValueError("stream_mixed takes contiguous CPU tensors of one size: 3 fp32, 2 fp16")
        self.lib.chunkmem_stream_mixed(a.data_ptr(), b.data_ptr(), c.data_ptr(), g.data_ptr(), out.data_ptr(),
                                       a.numel(), 0.5, default_threads() if nthreads is None else nthreads)


_THREADS = threading.local()


def default_threads() -> int:
    """The threads a kernel call without ``nthreads`` splits over: torch's count, unless this thread set
    its own with :func:`set_thread_default`."""
    return getattr(_THREADS, "count", None) or torch.get_num_threads()


def set_thread_default(count: int) -> None:
    """Kernel calls made on the calling thread without ``nthreads`` use ``count`` threads (>= 1)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    _THREADS.count = count


def kernel() -> HostAdamKernel | None:
    """The kernel, building or loading it on the first call; ``None`` if it is unavailable (the reason:
    :func:`load_error`). Ignores ``CHUNKMEM_DISABLE_CPP_ADAM``; :func:`try_update` honours it."""
    return _KERNEL.get(stacklevel=4)


def load_error() -> str | None:
    """Why :func:`kernel` returned ``None`` (after it was called), else ``None``."""
    return _KERNEL.error


def _load() -> HostAdamKernel:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the host kernel is for x86-64, not {platform.machine()}")
    if not sys.platform.startswith(("linux", "darwin")):
        raise RuntimeError(f"the host kernel is built for Linux and macOS only, not {sys.platform}")
    lib, path, build_seconds = _build()
    if lib.chunkmem_host_adam_abi() != ABI_VERSION:
        raise RuntimeError(f"{path} has another ABI version")
    if not lib.chunkmem_host_adam_cpu_ok():
        raise RuntimeError("the CPU lacks AVX2, FMA or F16C")
    k = HostAdamKernel(lib, path, build_seconds, _find_vml_sqrt())
    k.fma, k.sqrt, k.exact = _pick_rounding(k)
    k.fused_tail = _probe_fused_tail(k)
    return k


OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp")


def _openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes this process has loaded (torch's, in its Linux builds); empty
    where there is none or ``/proc/self/maps`` cannot be read (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if any(name in line for name in OPENMP_RUNTIMES)}
    except OSError:
        return set()


def _build() -> tuple[ctypes.CDLL, Path, float | None]:
    return build_on_torchs_openmp(SOURCE, "host_adam")


def build_on_torchs_openmp(source: Path, stem: str) -> tuple[ctypes.CDLL, Path, float | None]:
    """A host kernel's library (see :func:`native_build.load_library`, with :data:`CXXFLAGS`): built with
    ``-fopenmp`` where torch has an OpenMP runtime loaded, that builds, and loading it brings no second runtime
    (its threads then are torch's: ``csrc/parallel_range.h``); else without."""
    runtimes = _openmp_runtimes()
    if runtimes:
        try:
            built = load_library(source, CXXFLAGS + ("-fopenmp",), stem)
        except RuntimeError:  # a compiler without OpenMP
            built = None
        if built is not None and _openmp_runtimes() == runtimes:
            return built
        # else the library resolved OpenMP to a runtime of its own (left loaded: a runtime starts no
        # thread before its first parallel region, and none will run in it)
    return load_library(source, CXXFLAGS, stem)


def _find_vml_sqrt() -> int | None:
    """The address of MKL's ``vmsSqrt`` in torch's CPU library (loaded already), or ``None``."""
    if not torch.backends.mkl.is_available():
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            return ctypes.cast(ctypes.CDLL(str(path)).vmsSqrt, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


_KERNEL = LoadedOnce(_load, "chunkmem: the C++ host Adam kernel is unavailable, using torch ops instead ({error})")


def _pick_rounding(k: HostAdamKernel) -> tuple[bool, str, bool]:
    """``(fma, sqrt, exact)``: the first variant (square root ``"ieee"`` before ``"vml"``, FMA before
    none) with which everything (moments, masters, 16-bit copies) equals the torch-op path bit for bit
    on a sample, with ``exact=True``; where none does, the IEEE square root, the rounding with which the
    moments are equal, and ``exact=False``."""
    from .adam_math import AdamHyper, adam_update_torch_

    gen = torch.Generator().manual_seed(20240605)
    n = 4099  # vector body, tails, and a size that is no multiple of the vector width
    base = (torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01,
            torch.rand(n, generator=gen) * 1e-4, torch.randn(n, generator=gen) * 64)
    cases = [(AdamHyper(1e-3, 0.9, 0.999, 1e-8, wd, adamw, bc), mult, dtype)
             for wd, adamw, bc, mult, dtype in [(0.01, True, True, 1.0, torch.float32),
                                                (0.01, False, True, 1 / 64, torch.float32),
                                                (0.1, False, False, 1.0, torch.float32),
                                                (0.01, True, True, 1 / 3, torch.bfloat16),
                                                (0.0, False, True, 0.5, torch.float16)]]

    def compare(fma: bool, sqrt: str) -> tuple[bool, bool]:
        moments = everything = True
        for hyper, mult, dtype in cases:
            ref = [t.clone() for t in base[:3]]
            ours = [t.clone() for t in base[:3]]
            grad = base[3].to(dtype)
            ref_out, our_out = (None, None) if dtype == torch.float32 else (torch.empty(n, dtype=dtype),
                                                                         torch.empty(n, dtype=dtype))
            adam_update_torch_(ref[0], grad, ref[1], ref[2], 7, hyper, mult, ref_out)
            k.update(ours[0], grad, ours[1], ours[2], 7, hyper, mult, our_out, fma=fma, sqrt=sqrt, nt_min=0)
            moments &= torch.equal(ref[1], ours[1]) and torch.equal(ref[2], ours[2])
            everything &= moments and torch.equal(ref[0], ours[0]) and (
                ref_out is None or torch.equal(ref_out, our_out))
        return moments, everything

    results = {}
    for sqrt in SQRT_VARIANTS if k.vml_sqrt is not None else SQRT_VARIANTS[:1]:
        for fma in (True, False):
            results[fma, sqrt] = compare(fma, sqrt)
            if results[fma, sqrt][1]:
                return fma, sqrt, True
    return (False if results[False, "ieee"][0] and not results[True, "ieee"][0] else True), "ieee", False


def _probe_fused_tail(k: HostAdamKernel) -> int | None:
    """The tail length rule with which the kernel (FMA, IEEE square root) equals
    ``torch.optim.Adam/AdamW(fused=True)`` bit for bit: ``M`` when the last ``numel % M`` elements of each
    tensor are the tail (tried: 8, 16), ``None`` when no rule does (another torch build or CPU)."""
    from .adam_math import AdamHyper

    gen = torch.Generator().manual_seed(20261124)
    sizes = [1, 7, 8, 9, 15, 16, 17, 23, 31, 33, 100, 1029, 4099]
    n = sum(sizes)
    spans, start = [], 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    params0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 0.01 for _ in range(2)]
    cases = [(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True), 1.0),
             (AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, True), 0.37),
             (AdamHyper(2e-3, 0.8, 0.99, 1e-6, 0.0, True, True), 1.0)]
    references = []
    try:
        # the ops torch.optim.AdamW / Adam(fused=True) run (through the optimizer classes the first step
        # costs over a second of imports, which every process would pay at the kernel's load)
        for hyper, mult in cases:
            params = [t.clone() for t in params0.split(sizes)]
            exp_avgs, exp_avg_sqs = [torch.zeros(size) for size in sizes], [torch.zeros(size) for size in sizes]
            steps = [torch.zeros(()) for _ in sizes]
            fused = torch._fused_adamw_ if hyper.adamw_mode else torch._fused_adam_
            for grad in grads:
                torch._foreach_add_(steps, 1)
                fused(params, list((grad * mult).split(sizes)), exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                      lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
                      eps=hyper.eps, maximize=False)
            references.append(torch.cat([torch.cat(params), torch.cat(exp_avgs), torch.cat(exp_avg_sqs)]))
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a torch without the CPU fused kernel
        return None
    for modulus in (8, 16):
        runs = tail_runs(spans, n, modulus)
        for (hyper, mult), reference in zip(cases, references):
            master, exp_avg, exp_avg_sq = params0.clone(), torch.zeros(n), torch.zeros(n)
            for step, grad in enumerate(grads, 1):
                k.update(master, grad, exp_avg, exp_avg_sq, step, hyper, mult, fma=True, sqrt="ieee",
                         tail_runs=runs)
            if not torch.equal(torch.cat([master, exp_avg, exp_avg_sq]), reference):
                break
        else:
            return modulus
    return None


def tail_runs(spans: list[tuple[int, int]], n: int, modulus: int) -> list[int]:
    """The elements of ``[0, n)`` that ``torch.optim.AdamW(fused=True)`` updates one by one, as flat
    ``[start, end, ...]`` pairs: the last ``numel % modulus`` elements of each tensor, whose
    ``[start, end)`` element spans (sorted, disjoint, relative to the buffer; they may reach beyond it,
    as a parameter cut by a shard does) are ``spans``."""
    runs: list[int] = []
    for start, end in spans:
        tail_start = max(end - (end - start) % modulus, 0)
        tail_end = min(end, n)
        if tail_start < tail_end:
            runs += (tail_start, tail_end)
    return runs


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def try_update(master: torch.Tensor, grad: "torch.Tensor | GradPieces", exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: int, hyper, grad_multiplier: float, param_out: torch.Tensor | None,
               fp32_within_ulp: bool = False, param_spans: list[tuple[int, int]] | None = None,
               undo: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None) -> bool:
    """Run the update with the kernel if it applies (see the module docstring); ``False``: not done (and
    ``undo`` not written either).
    ``grad``: one flat tensor like the others, or :data:`GradPieces` (the elements no piece covers are
    left as they are). ``fp32_within_ulp``: use it for fp32 gradients too where it is only within an
    ulp of the reference (speed over bitwise equality; chunkmem's own optimizers do not ask for it, so
    that fp32 training keeps torch's results bit for bit on every machine). ``param_spans``: the
    ``[start, end)`` element spans of the parameters in these buffers (relative to their start, reaching
    beyond them where a parameter is cut); default: the buffers are one parameter. With fp32 gradients
    the update equals ``torch.optim.AdamW(fused=True)`` on those parameters where
    :func:`fp32_reference` says so. ``undo``: three buffers like ``master`` that receive ``master``,
    ``exp_avg`` and ``exp_avg_sq`` as they were before the update, in the same pass over memory."""
    if master.device.type != "cpu" or disabled():
        return False
    n = master.numel()
    states = (master, exp_avg, exp_avg_sq)
    for t in states + (tuple(undo) if undo is not None else ()):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            return False
    grads = _gradient_tensors(grad, n)
    if grads is None:
        return False
    if param_out is not None and (param_out.dtype not in (torch.float16, torch.bfloat16)
                                  or param_out.device.type != "cpu" or not param_out.is_contiguous()
                                  or param_out.numel() != n):
        return False
    k = kernel()
    if k is None:
        return False
    grad_dtype = grads[0].dtype
    fused = grad_dtype == torch.float32 and param_out is None and k.fused_tail is not None
    if grad_dtype == torch.float32 and not fused and not k.exact and not fp32_within_ulp and not env_flag(FP32_ENV):
        return False
    if n == 0:
        return True
    written = (states if param_out is None else states + (param_out,)) + (tuple(undo) if undo is not None else ())
    for i, a in enumerate(written):  # the kernel streams each buffer once: no two may share memory,
        for b in written[i + 1:]:    # except the 16-bit copy written over the flat gradient it was read from
            if _overlaps(a, b):
                return False
        for g in grads:
            if _overlaps(a, g) and (a is not param_out or isinstance(grad, list)
                                    or param_out.data_ptr() != g.data_ptr() or param_out.dtype != g.dtype):
                return False
    if fused:
        k.update(master, grad, exp_avg, exp_avg_sq, step, hyper, grad_multiplier, fma=True, sqrt="ieee",
                 tail_runs=tail_runs(param_spans if param_spans is not None else [(0, n)], n, k.fused_tail),
                 undo=undo)
    else:
        k.update(master, grad, exp_avg, exp_avg_sq, step, hyper, grad_multiplier, param_out, undo=undo)
    torch.autograd.graph.increment_version(list(written))
    return True


def _gradient_tensors(grad: "torch.Tensor | GradPieces", n: int) -> list[torch.Tensor] | None:
    """The tensors of a flat gradient of ``n`` elements or of its pieces, or ``None`` if the kernel cannot
    read them (another device or dtype, not contiguous, a flat one of another length, pieces out of order,
    overlapping or past ``n``, no piece at all)."""
    if isinstance(grad, torch.Tensor):
        return [grad] if _kernel_readable(grad, grad.dtype) and grad.numel() == n else None
    if not grad:
        return None
    dtype, end = grad[0][1].dtype, 0
    for offset, t in grad:
        if offset < end or not _kernel_readable(t, dtype):
            return None
        end = offset + t.numel()
    return [t for _, t in grad] if end <= n else None


def _kernel_readable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and dtype in _DTYPE_CODES and t.device.type == "cpu" and t.is_contiguous()


def fp32_reference() -> str:
    """Which torch optimizer chunkmem's Adam equals bit for bit with fp32 gradients on this machine:
    ``"fused"`` (``torch.optim.Adam/AdamW(fused=True)``) where the kernel reproduces it (checked when it
    loads), else ``"for-loop"`` (``foreach=False``, the CPU default), whose formulation is the torch-op
    path. Loads the kernel."""
    if disabled():
        return "for-loop"
    k = kernel()
    return "fused" if k is not None and k.fused_tail is not None else "for-loop"


def fp32_reference_options() -> dict[str, bool]:
    """The keyword arguments of ``torch.optim.Adam`` / ``AdamW`` that give, on this machine, the results
    chunkmem's Adam gives with fp32 gradients, bit for bit: ``{"fused": True}`` or ``{"foreach": False}``
    (see :func:`fp32_reference`)."""
    return {"fused": True} if fp32_reference() == "fused" else {"foreach": False}
