"""The one-pass C++ host Adam kernel (chunkmem.optim.host_adam_ext) against an fp64 oracle and against the
torch-op formulation, and the fallback to torch ops when it is disabled or cannot be built.

Nothing here skips: on a machine where the kernel cannot be built, test_kernel_builds and every test
that uses the kernel fail (the fallback has tests of its own below)."""
import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from adam_oracle import adam_fp64
from chunkmem.optim import host_adam_ext
from chunkmem.core import native_build
from chunkmem.optim.adam_kernels import adam_update_
from chunkmem.optim.adam_math import AdamHyper, adam_update_torch_

ULP = 2.0**-24
N = 10_007  # no multiple of a vector width (8, 16) or of a loop step (16, 32)


@pytest.fixture(autouse=True)
def _kernel_enabled(monkeypatch):
    monkeypatch.delenv(host_adam_ext.DISABLE_ENV, raising=False)
    monkeypatch.delenv(host_adam_ext.FP32_ENV, raising=False)


def get_kernel():
    k = host_adam_ext.kernel()
    assert k is not None, f"the host Adam kernel did not build: {host_adam_ext.load_error()}"
    return k


def make_state(n, grad_dtype, seed=1, grad_scale=64.0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-4
    grad = (torch.randn(n, generator=gen) * grad_scale).to(grad_dtype)
    return master, grad, m, v


def padded_pieces(sizes, gap):
    """Parameters of ``sizes`` elements, each followed by ``gap`` elements of padding: (total elements,
    their ``[start, end)`` spans)."""
    offsets = [i * gap + sum(sizes[:i]) for i in range(len(sizes))]
    return offsets[-1] + sizes[-1] + gap, [(o, o + s) for o, s in zip(offsets, sizes)]


def each_thread_count(counts=(1, 3)):
    """Run the loop body with torch's thread count set to each of ``counts`` in turn, then restore it."""
    threads = torch.get_num_threads()
    try:
        for nthreads in counts:
            torch.set_num_threads(nthreads)
            yield nthreads
    finally:
        torch.set_num_threads(threads)




def test_kernel_builds():
    k = get_kernel()
    assert k.path.exists()
    assert host_adam_ext.load_error() is None


@pytest.mark.parametrize("grad_dtype,out_dtype", [
    (torch.float32, None), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, None),
    (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("multiplier", [1.0, 1 / 64])
def test_kernel_against_fp64(grad_dtype, out_dtype, adamw_mode, bias_correction, multiplier):
    k = get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=adamw_mode,
                  bias_correction=bias_correction)
    master, grad, m, v = make_state(N, grad_dtype, grad_scale=64.0 if multiplier != 1 else 1.0)
    want_p, want_m, want_v = adam_fp64(master, grad, m, v, 3, h, multiplier)
    g = grad.double() * multiplier
    m_terms = h.beta1 * m.double().abs() + (1 - h.beta1) * g.abs()
    v_terms = h.beta2 * v.double() + (1 - h.beta2) * g * g
    p_terms = master.double().abs() + h.lr * 10
    out = None if out_dtype is None else torch.full((N,), float("nan"), dtype=out_dtype)
    grad_before = grad.clone()
    k.update(master, grad, m, v, 3, h, multiplier, out)
    assert torch.equal(grad, grad_before)
    assert ((m.double() - want_m).abs() <= 8 * ULP * m_terms).all()
    assert ((v.double() - want_v).abs() <= 8 * ULP * v_terms).all()
    assert ((master.double() - want_p).abs() <= 16 * ULP * p_terms).all()
    if out is not None:
        assert torch.equal(out, master.to(out_dtype))


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 33, N, (1 << 20) + 37])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_kernel_against_torch_ops(n, grad_dtype, adamw_mode):
    """The same operations and roundings as the torch-op path. The moments are bitwise equal; the
    masters differ by at most one ulp (torch's MKL sqrt is not always correctly rounded, the kernel's
    is), and only in a small fraction of the elements."""
    k = get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adamw_mode=adamw_mode,
                  bias_correction=True)
    ref = make_state(n, grad_dtype, seed=n)
    ours = [t.clone() for t in ref]
    out_dtype = torch.float16 if grad_dtype == torch.float32 else grad_dtype
    ref_out, our_out = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
    for step in (1, 2, 3):  # three steps on the same state, so that differences could compound
        size = ref[0].abs() + 10 * h.lr  # the master and the step (at most about lr / (1 - beta1))
        adam_update_torch_(ref[0], ref[1], ref[2], ref[3], step, h, 1 / 8, ref_out)
        k.update(ours[0], ours[1], ours[2], ours[3], step, h, 1 / 8, our_out)
        assert torch.equal(ours[2], ref[2]) and torch.equal(ours[3], ref[3]), "moments differ"
        diff = (ours[0] - ref[0]).abs()
        assert (diff <= 4 * ULP * size).all()
        assert (diff != 0).sum() <= max(2, n // 100)
        same = ours[0] == ref[0]
        assert torch.equal(our_out[same], ref_out[same])
        assert torch.equal(our_out, ours[0].to(out_dtype))
        ref[0].copy_(ours[0])  # continue both from the same master


def test_large_lerp_weight_and_no_decay():
    """beta1 < 0.5 takes the other branch of torch's lerp; weight decay 0 skips both decays."""
    k = get_kernel()
    for beta1, wd in ((0.3, 0.0), (0.3, 0.1), (0.5, 0.0), (0.9, 0.0)):
        h = AdamHyper(lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-6, weight_decay=wd, adamw_mode=False,
                      bias_correction=True)
        ref = make_state(N, torch.float32)
        ours = [t.clone() for t in ref]
        size = ref[0].abs() + 10 * h.lr
        adam_update_torch_(*ref[:4], 2, h)
        k.update(*ours[:4], 2, h)
        assert torch.equal(ours[2], ref[2]) and torch.equal(ours[3], ref[3])
        assert ((ours[0] - ref[0]).abs() <= 4 * ULP * size).all()


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_threads_and_streaming_stores_change_nothing(out_dtype):
    k = get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    n = (1 << 18) + 3
    results = []
    for nthreads, nt_min in ((1, 1 << 62), (2, 0), (3, 0), (4, 1 << 62)):
        state = make_state(n, out_dtype, seed=5)
        out = torch.empty(n + 1, dtype=out_dtype)[1:]  # misaligned: streaming stores need a head
        k.update(state[0], state[1], state[2], state[3], 4, h, 0.5, out, nthreads=nthreads, nt_min=nt_min)
        results.append((state[0], state[2], state[3], out))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_copy_over_its_own_gradient(dtype):
    """reuse_fp16_shard: the 16-bit copy is written into the memory the gradient was read from."""
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    n = (1 << 20) + 9
    ref = make_state(n, dtype, seed=7)
    ours = [t.clone() for t in ref]
    ref_out = torch.empty(n, dtype=dtype)
    get_kernel().update(ref[0], ref[1], ref[2], ref[3], 2, h, 1 / 64, ref_out)
    assert host_adam_ext.try_update(ours[0], ours[1], ours[2], ours[3], 2, h, 1 / 64, ours[1])
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2]) and torch.equal(ours[1], ref_out)


def test_adam_update_dispatch():
    """adam_update_ takes the kernel for 16-bit gradients on the host, keeps fp32 gradients bitwise equal
    to the torch-op path, and leaves other tensors to torch ops."""
    k = get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    master, grad, m, v = make_state(N, torch.float16)
    out = torch.empty(N, dtype=torch.float16)
    assert host_adam_ext.try_update(master, grad, m, v, 1, h, 1.0, out)
    # fp32 gradients: bitwise the torch-op path where the kernel follows it; taken by the kernel where it
    # reproduces that path or torch's fused AdamW (test_fp32_is_bitwise_torch_fused_adamw)
    if host_adam_ext.fp32_reference() == "for-loop":
        ref = make_state(N, torch.float32)
        ours = [t.clone() for t in ref]
        adam_update_torch_(*ref, 5, h)
        adam_update_(*ours, 5, h)
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    taken = host_adam_ext.try_update(*make_state(N, torch.float32), 5, h, 1.0, None)
    assert taken is (k.exact or k.fused_tail is not None)
    # not for the kernel: strided, fp64, mismatched sizes, overlapping buffers, fp32 copy out
    master, grad, m, v = make_state(2 * N, torch.float16)
    assert not host_adam_ext.try_update(master[::2], grad[::2], m[::2], v[::2], 1, h, 1.0, None)
    assert not host_adam_ext.try_update(master, grad.double(), m, v, 1, h, 1.0, None)
    assert not host_adam_ext.try_update(master, grad[:N], m, v, 1, h, 1.0, None)
    assert not host_adam_ext.try_update(master, grad, master, v, 1, h, 1.0, None)
    assert not host_adam_ext.try_update(master, grad, m, v, 1, h, 1.0, torch.empty(2 * N))
    assert not host_adam_ext.try_update(master, grad, m, v, 1, h, 1.0, master.view(torch.float16)[:2 * N])


def test_disabled_by_env_uses_torch_ops(monkeypatch):
    monkeypatch.setenv(host_adam_ext.DISABLE_ENV, "1")

    def must_not_load():
        raise AssertionError("kernel loaded although disabled")

    monkeypatch.setattr(host_adam_ext, "kernel", must_not_load)
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=False,
                  bias_correction=True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        ref = make_state(N, dtype)
        ours = [t.clone() for t in ref]
        ref_out, our_out = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
        adam_update_torch_(*ref, 3, h, 0.25, ref_out)
        adam_update_(*ours, 3, h, 0.25, our_out)
        assert all(torch.equal(a, b) for a, b in zip(ref, ours)) and torch.equal(ref_out, our_out)


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """No compiler: the failure is reported once (a warning), remembered, and updates use torch ops."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(host_adam_ext, "_KERNEL", host_adam_ext._KERNEL.fresh())
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    ref = make_state(N, torch.float16)
    ours = [t.clone() for t in ref]
    ref_out, our_out = torch.empty(N, dtype=torch.float16), torch.empty(N, dtype=torch.float16)
    adam_update_torch_(*ref, 1, h, 1 / 8, ref_out)
    with pytest.warns(RuntimeWarning, match="unavailable"):
        adam_update_(*ours, 1, h, 1 / 8, our_out)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours)) and torch.equal(ref_out, our_out)
    assert host_adam_ext.kernel() is None and "no-such-compiler" in host_adam_ext.load_error()
    adam_update_(*ours, 2, h, 1 / 8, our_out)  # no second attempt, no second warning


def test_no_build_at_import():
    code = ("import chunkmem, chunkmem.optim.host_adam_ext as h, chunkmem.optim.adam_kernels; "
            "assert not h._KERNEL.tried and h._KERNEL.value is None; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_bandwidth_reference_kernel():
    k = get_kernel()
    a, b, c, d = (torch.rand(1003) for _ in range(4))
    want = [x * 0.5 + d for x in (a, b, c)]
    k.stream_4r3w(a, b, c, d)
    assert all(torch.allclose(x, y, rtol=1e-6, atol=0) for x, y in zip((a, b, c), want))


@pytest.mark.parametrize("step", [17_000, 50_000])
def test_late_steps_where_bias_correction_rounds_to_one(step):
    """sqrt(1 - beta2^step) rounds to 1 in fp32 from about step 17,000 on (the kernel then skips that
    division, which cannot change a result)."""
    k = get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    ref = make_state(N, torch.bfloat16, grad_scale=4.0)
    ours = [t.clone() for t in ref]
    ref_out, our_out = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    size = ref[0].abs() + 10 * h.lr
    adam_update_torch_(*ref, step, h, 0.25, ref_out)
    k.update(*ours, step, h, 0.25, our_out)
    assert torch.equal(ours[2], ref[2]) and torch.equal(ours[3], ref[3])
    assert ((ours[0] - ref[0]).abs() <= 4 * ULP * size).all()
    assert torch.equal(our_out, ours[0].to(torch.bfloat16))


# ---- the variant chosen at load is the torch-op path, bit for bit (task H6) --------------------------


def test_vml_sqrt_is_torchs_sqrt():
    """Where torch has MKL, the vmsSqrt the kernel can call rounds exactly as torch's Tensor.sqrt, on
    every kind of input (tiny, denormal, huge, zero, inf, nan) and on any sub-range of an array."""
    k = get_kernel()
    assert (k.vml_sqrt is not None) == torch.backends.mkl.is_available()
    if k.vml_sqrt is None:
        assert k.sqrt == "ieee"
        return
    import ctypes
    vsqrt = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(k.vml_sqrt)
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([torch.rand(5000, generator=gen) * 1e-4, torch.rand(5000, generator=gen) * 100,
                   torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 3e38, 1.0, 4.0])])
    want = torch.sqrt(x)
    for start, n in ((0, x.numel()), (3, 1), (5, 17), (1001, 513), (x.numel() - 8, 8)):
        out = torch.empty(n)
        vsqrt(n, x[start:].data_ptr(), out.data_ptr(), host_adam_ext.VML_SQRT_MODE)
        assert torch.equal(out.nan_to_num(-1.0), want[start:start + n].nan_to_num(-1.0)), (start, n)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chosen_variant_is_bitwise_the_torch_op_path(grad_dtype):
    """Where the probe found an exact variant, it equals the torch-op path bit for bit beyond the probe's
    sample: sizes around the vector width and the tile, several steps, every branch of the arithmetic,
    1 to 3 threads, a misaligned 16-bit copy. Where it found none, fp32 gradients are not given to it."""
    k = get_kernel()
    if not k.exact:
        state = make_state(N, torch.float32)
        h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
        assert not host_adam_ext.try_update(*state, 1, h, 1.0, None)
        return
    hypers = [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True), AdamHyper(1e-2, 0.3, 0.99, 1e-6, 0.1, False, True),
              AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)]
    for n in (1, 15, 17, 511, 512, 529, 4099, (1 << 18) + 37):
        for i, h in enumerate(hypers):
            ref = make_state(n, grad_dtype, seed=n + i, grad_scale=8.0)
            ours = [t.clone() for t in ref]
            out_dtype = torch.bfloat16 if grad_dtype == torch.float32 else grad_dtype
            ref_out = torch.empty(n, dtype=out_dtype)
            our_out = torch.empty(n + 1, dtype=out_dtype)[1:]
            for step, nthreads, mult in ((1, 1, 1.0), (2, 3, 1 / 8), (20_000, 2, 0.5)):
                adam_update_torch_(*ref, step, h, mult, ref_out)
                k.update(*ours, step, h, mult, our_out, sqrt=k.sqrt, nthreads=nthreads,
                         nt_min=0 if nthreads == 3 else None)
                assert all(torch.equal(a, b) for a, b in zip(ref, ours)), (n, h, step)
                assert torch.equal(ref_out, our_out), (n, h, step)


def test_fp32_chunked_training_is_bitwise_the_named_torch_reference(monkeypatch):
    """The chunked optimizer's fp32 training equals, bit for bit, the torch AdamW that
    ``fp32_reference_options`` names: with the kernel (fused AdamW where the probe found the kernel
    reproduces it, which it then does) and with it disabled (the for-loop AdamW, the torch-op path)."""
    from models import TinyGPT, batches, build_sharded, lm_loss, train

    k = get_kernel()
    calls = []
    update = k.update
    monkeypatch.setattr(k, "update", lambda *args, **kwargs: calls.append(1) or update(*args, **kwargs))
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4)
    for disabled in ("1", "0"):
        monkeypatch.setenv(host_adam_ext.DISABLE_ENV, disabled)
        options = host_adam_ext.fp32_reference_options()
        assert options == ({"foreach": False} if disabled == "1" or k.fused_tail is None else {"fused": True})
        plain = copy.deepcopy(reference)
        adamw = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, **options)
        for x in data:
            lm_loss(plain(x), x).backward()
            adamw.step()
            adamw.zero_grad()
        model, optim = build_sharded(reference, "cpu", torch.float32)
        train(model, optim, data)
        state = model.state_dict()
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name], value), (disabled, name)
    assert (len(calls) > 0) is (k.exact or k.fused_tail is not None)


def test_fp32_is_bitwise_torch_fused_adamw():
    """Where the probe found it, the kernel with tail runs equals ``torch.optim.Adam/AdamW(fused=True)``
    on each parameter packed in a flat buffer, beyond the probe's sample: sizes around the vector width,
    Adam and AdamW, a gradient multiplier (as clipping), 1 to 3 threads, a buffer cut through parameters
    (a shard: the tails stay where the parameters end)."""
    k = get_kernel()
    if k.fused_tail is None:
        pytest.skip("this torch build's fused AdamW is not reproduced here: fp32 follows the for-loop AdamW")
    sizes = [3, 8, 13, 16, 29, 64, 1029, 70_001, 5, (1 << 17) + 11]
    n = sum(sizes)
    spans, start = [], 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    for adamw, wd, mult, nthreads in ((True, 0.01, 1.0, 1), (False, 0.1, 0.25, 3), (True, 0.0, 1.0, 2)):
        hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, wd, adamw, True)
        gen = torch.Generator().manual_seed(int(mult * 100) + nthreads)
        start_values = torch.randn(n, generator=gen)
        grads = [torch.randn(n, generator=gen) * 0.01 for _ in range(3)]
        params = [torch.nn.Parameter(t.clone()) for t in start_values.split(sizes)]
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(params, lr=1e-3, weight_decay=wd, fused=True)
        whole = [start_values.clone(), torch.zeros(n), torch.zeros(n)]
        cut = 70_000  # through the 8th parameter: two shards updated apart
        halves = [[t[:cut].clone() for t in whole], [t[cut:].clone() for t in whole]]
        for step, grad in enumerate(grads, 1):
            for param, g in zip(params, (grad * mult).split(sizes)):
                param.grad = g.clone()
            opt.step()
            assert host_adam_ext.try_update(whole[0], grad, whole[1], whole[2], step, hyper, mult, None,
                                            param_spans=spans)
            for (lo, hi), half in zip(((0, cut), (cut, n)), halves):
                assert host_adam_ext.try_update(half[0], grad[lo:hi], half[1], half[2], step, hyper, mult, None,
                                                param_spans=[(a - lo, b - lo) for a, b in spans])
        expected = [torch.cat([p.detach() for p in params]), torch.cat([opt.state[p]["exp_avg"] for p in params]),
                    torch.cat([opt.state[p]["exp_avg_sq"] for p in params])]
        for got, want, half0, half1 in zip(whole, expected, *halves):
            assert torch.equal(got, want), (adamw, wd, mult)
            assert torch.equal(torch.cat([half0, half1]), want), (adamw, wd, mult)


def test_fp32_within_ulp_takes_the_kernel_anyway():
    """A caller may ask for the kernel on fp32 gradients where it reproduces no torch reference (speed
    over bitwise equality)."""
    k = get_kernel()
    if k.exact or k.fused_tail is not None:
        pytest.skip("the kernel reproduces a torch reference here: fp32 gradients take it anyway")
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    ref = make_state(N, torch.float32)
    ours = [t.clone() for t in ref]
    assert host_adam_ext.try_update(*ours, 3, h, 1.0, None, fp32_within_ulp=True)
    k.update(*ref, 3, h, 1.0, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))


def test_unknown_sqrt_variant_is_refused():
    k = get_kernel()
    state = make_state(16, torch.float32)
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match="sqrt='exact'"):
        k.update(*state, 1, AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True), sqrt="exact")
    assert all(torch.equal(a, b) for a, b in zip(before, state))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_16bit_gradients_take_the_ieee_square_root_within_one_ulp(grad_dtype):
    """16-bit gradients (the offload hot path) use the hardware square root whatever the probe chose for
    fp32: the moments equal the torch-op path's, and every master differs from it by at most an ulp of
    itself plus an ulp of the update (the square root of a denominator differs by one ulp at most)."""
    k = get_kernel()
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    ref = make_state(4099, grad_dtype, seed=3, grad_scale=8.0)
    ours, ieee = [t.clone() for t in ref], [t.clone() for t in ref]
    adam_update_torch_(*ref, 3, h, 1.0, None)
    k.update(*ours, 3, h, 1.0, None)
    k.update(*ieee, 3, h, 1.0, None, sqrt="ieee")
    assert all(torch.equal(a, b) for a, b in zip(ours, ieee))
    assert torch.equal(ref[2], ours[2]) and torch.equal(ref[3], ours[3])
    assert torch.allclose(ours[0], ref[0], rtol=2**-23, atol=h.lr * 2**-22)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradient_in_pieces_equals_the_flat_gradient(grad_dtype):
    """A gradient handed over as separate tensors (one a parameter, as autograd made them) updates
    exactly as the same values in one flat buffer: fp32 with the fused tails, 16-bit with the 16-bit
    copy; 1 and 3 threads; the elements between pieces (padding) stay as they are."""
    get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    n, spans = padded_pieces([13, 64, 70_001, 5, (1 << 17) + 11], 51)
    out_dtype = None if grad_dtype == torch.float32 else grad_dtype
    for nthreads in each_thread_count():
        flat, pieced = make_state(n, grad_dtype, seed=nthreads), make_state(n, grad_dtype, seed=nthreads)
        for state in (flat, pieced):
            for lo, hi in zip([0] + [end for _, end in spans], [start for start, _ in spans] + [n]):
                state[1][lo:hi] = 0  # the flat gradient's padding is zero
        pieces = [(start, pieced[1][start:end].clone()) for start, end in spans]
        outs = [torch.empty(n, dtype=grad_dtype) if out_dtype else None for _ in range(2)]
        for out in outs:
            if out is not None:
                out.fill_(7)
        before = [t.clone() for t in pieced]
        assert host_adam_ext.try_update(flat[0], flat[1], flat[2], flat[3], 3, h, 0.5, outs[0], param_spans=spans)
        assert host_adam_ext.try_update(pieced[0], pieces, pieced[2], pieced[3], 3, h, 0.5, outs[1],
                                        param_spans=spans)
        covered = torch.zeros(n, dtype=torch.bool)
        for start, end in spans:
            covered[start:end] = True
        for got, want, old in zip((pieced[0], pieced[2], pieced[3]), (flat[0], flat[2], flat[3]),
                                  (before[0], before[2], before[3])):
            assert torch.equal(got[covered], want[covered])
            assert torch.equal(got[~covered], old[~covered])  # padding untouched
        if out_dtype is not None:
            assert torch.equal(outs[1][covered], outs[0][covered])
            assert (outs[1][~covered] == 7).all()


def test_gradient_pieces_the_kernel_cannot_read_change_nothing():
    """Pieces out of order, overlapping, past the buffers, of mixed dtypes, none at all, or overlapping a
    buffer the update writes: ``try_update`` says no and writes nothing (the caller takes the flat path)."""
    get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                  bias_correction=True)
    master, _, m, v = make_state(100, torch.float32)
    a, b = torch.randn(10), torch.randn(10)
    refused = {
        "out of order": [(50, a), (0, b)],
        "overlapping": [(0, a), (5, b)],
        "past the end": [(95, a)],
        "mixed dtypes": [(0, a), (20, b.half())],
        "none": [],
        "over exp_avg": [(0, m[40:50])],
    }
    for what, pieces in refused.items():
        before = [t.clone() for t in (master, m, v)]
        assert not host_adam_ext.try_update(master, pieces, m, v, 1, h, 1.0, None), what
        assert all(torch.equal(x, y) for x, y in zip(before, (master, m, v))), what


# ---- instruction sets, threads, the build ------------------------------------------------------------


def _isa_cases():
    """(grad dtype, 16-bit copy dtype or None, sqrt, fma, fp32 tail runs)"""
    cases = [(g, o, "ieee", fma, False) for g, o in ((torch.float32, None), (torch.float32, torch.bfloat16),
                                                     (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.float16), (torch.float16, None))
             for fma in (True, False)]
    cases.append((torch.float32, None, "ieee", True, True))
    if host_adam_ext.kernel() is not None and host_adam_ext.kernel().vml_sqrt is not None:
        cases += [(torch.float32, None, "vml", True, False), (torch.float16, torch.float16, "vml", True, False)]
    return cases


@pytest.mark.parametrize("grad_dtype,out_dtype,sqrt,fma,tails", _isa_cases())
def test_avx512_and_avx2_bodies_give_the_same_bits(grad_dtype, out_dtype, sqrt, fma, tails):
    """The AVX-512 body (16 lanes, 32 elements an iteration, 64-byte streaming stores) against the AVX2 one
    (8 lanes, 16, 32-byte) on every path: sizes around both loop steps and the tile, misaligned 16-bit
    copies with and without streaming stores, 1 and 3 threads, every branch of the arithmetic, special
    values in the gradient (inf, nan, denormals, -0)."""
    k = get_kernel()
    if not k.avx512_available:
        pytest.skip("no AVX-512 on this CPU: only the AVX2 body runs here")
    hypers = [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True), AdamHyper(1e-2, 0.3, 0.99, 1e-6, 0.1, False, True),
              AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)]
    for n in (1, 31, 33, 512, 1061, (1 << 17) + 45):
        for i, h in enumerate(hypers):
            results = []
            for avx512, nthreads, nt_min in ((False, 1, 1 << 62), (True, 1, 1 << 62), (True, 3, 0)):
                master, grad, m, v = make_state(n, grad_dtype, seed=n + i, grad_scale=8.0)
                grad[:: max(1, n // 7)] = torch.tensor([float("inf"), float("nan"), 1e-40, -0.0]).repeat(n)[
                    : grad[:: max(1, n // 7)].numel()].to(grad_dtype)
                out = None if out_dtype is None else torch.empty(n + 3, dtype=out_dtype)[3:]
                runs = host_adam_ext.tail_runs([(0, n // 3), (n // 3, n)], n, 8) if tails else None
                for step, mult in ((1, 1.0), (3, 1 / 8)):
                    k.update(master, grad, m, v, step, h, mult, out, fma=fma, sqrt=sqrt, nthreads=nthreads,
                             nt_min=nt_min, tail_runs=runs, avx512=avx512)
                results.append([t.view(torch.int32 if t.element_size() == 4 else torch.int16)  # bits, NaNs too
                                for t in (master, m, v, *(() if out is None else (out,)))])
            for other in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(results[0], other)), (n, h)


def test_avx512_where_there_is_none_is_refused_and_changes_nothing():
    k = get_kernel()
    without = host_adam_ext.HostAdamKernel(k.lib, k.path, None)
    without._avx512_ok = without.avx512 = False  # what loading it on a CPU without AVX-512 gives
    master, grad, m, v = make_state(100, torch.float16)
    before = [t.clone() for t in (master, m, v)]
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(ValueError, match="avx512=True: this CPU"):
        without.update(master, grad, m, v, 1, h, 1.0, None, avx512=True)
    without.avx512 = True  # a user's setting of the default is checked too
    with pytest.raises(ValueError, match="avx512=True: this CPU"):
        without.update(master, grad, m, v, 1, h, 1.0, None)
    with pytest.raises(AttributeError):
        without.avx512_available = True
    assert all(torch.equal(a, b) for a, b in zip(before, (master, m, v)))


def _openmp_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line or "libiomp" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_updates_run_on_torchs_openmp_runtime_and_load_no_second_one():
    """Where torch runs on an OpenMP runtime the kernel is built with OpenMP and shares torch's runtime:
    the library resolves it to the one torch loaded, so the process holds one (two would each keep
    threads spinning on the cores after their parallel regions)."""
    before = _openmp_files()
    k = get_kernel()
    assert k.openmp == bool(before)
    master, grad, m, v = make_state(1 << 18, torch.float16)
    k.update(master, grad, m, v, 1, AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True), 1.0, None, nthreads=2)
    assert _openmp_files() == before


def _recording_build(monkeypatch, runtimes_seen, fail_openmp):
    """host_adam_ext._build with the OpenMP runtimes it sees (one set per look) and a compiler that fails
    with -fopenmp if ``fail_openmp``; returns the flags of each build it asks for."""
    looks = iter(runtimes_seen)
    monkeypatch.setattr(host_adam_ext, "_openmp_runtimes", lambda: next(looks))
    built = []

    def load(source, flags, stem):
        built.append(tuple(flags))
        if fail_openmp and "-fopenmp" in flags:
            raise RuntimeError("compiling host_adam.cpp failed: -fopenmp unsupported")
        return native_build.load_library(source, flags, stem)

    monkeypatch.setattr(host_adam_ext, "load_library", load)
    return built


def test_without_openmp_in_the_compiler_it_builds_with_threads_of_its_own(monkeypatch):
    built = _recording_build(monkeypatch, [{"libgomp.so.1"}], fail_openmp=True)
    lib, _path, _seconds = host_adam_ext._build()
    assert built == [host_adam_ext.CXXFLAGS + ("-fopenmp",), host_adam_ext.CXXFLAGS]
    assert lib.chunkmem_host_adam_openmp() == 0


def test_a_library_that_brings_a_second_openmp_runtime_is_not_used(monkeypatch):
    """A compiler whose OpenMP is another runtime than torch's (clang's libomp beside torch's libgomp):
    the OpenMP build is left unused and updates run on threads of the library's own."""
    built = _recording_build(monkeypatch, [{"libgomp.so.1"}, {"libgomp.so.1", "libomp.so"}], fail_openmp=False)
    lib, _path, _seconds = host_adam_ext._build()
    assert built == [host_adam_ext.CXXFLAGS + ("-fopenmp",), host_adam_ext.CXXFLAGS]
    assert lib.chunkmem_host_adam_openmp() == 0


def test_without_an_openmp_runtime_in_the_process_no_openmp_build(monkeypatch):
    built = _recording_build(monkeypatch, [set()], fail_openmp=False)
    lib, _path, _seconds = host_adam_ext._build()
    assert built == [host_adam_ext.CXXFLAGS] and lib.chunkmem_host_adam_openmp() == 0


def test_a_forked_child_updates_on_threads_of_its_own():
    """A child forked after the parent ran updates on the OpenMP runtime: the runtime counts the parent's
    threads, which the child has not got, and a parallel region there would wait for them forever. The
    child's update finishes, on threads of its own, and equals the parent's."""
    script = textwrap.dedent("""
        import os, sys, torch
        from chunkmem.optim import host_adam_ext
        from chunkmem.optim.adam_math import AdamHyper
        k = host_adam_ext.kernel()
        h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
        n = 1 << 20
        state = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
        k.update(*state, 1, h, 1.0, None, nthreads=2)
        expected = [t.clone() for t in state]
        k.update(*expected, 2, h, 1.0, None, nthreads=2)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            k.update(*state, 2, h, 1.0, None, nthreads=2)
            # compared in pieces below torch's parallel grain: torch's own parallel operators would hang here
            equal = all(torch.equal(a[i:i + 8192], b[i:i + 8192]) for a, b in zip(state, expected)
                        for i in range(0, n, 8192))
            os.write(write, b"1" if equal else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        print("openmp", k.openmp, "child equal", os.read(read, 1) == b"1")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "child equal True" in proc.stdout, proc.stdout


def test_a_changed_included_file_builds_a_new_library(monkeypatch, tmp_path):
    """native_build keys a library on the files its source includes too: an edit of host_adam_vec.h alone
    must not load the library built from the old one."""
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "part.h").write_text("int value() { return 1; }\n")
    source = tmp_path / "lib.cpp"
    source.write_text('#include "part.h"\nextern "C" int get() { return value(); }\n')
    flags = ("-O1", "-shared", "-fPIC")
    first, first_path, built = native_build.load_library(source, flags, "t")
    assert first.get() == 1 and built is not None
    assert native_build.load_library(source, flags, "t")[1] == first_path  # unchanged: from the cache
    (tmp_path / "part.h").write_text("int value() { return 2; }\n")
    second, second_path, built = native_build.load_library(source, flags, "t")
    assert second_path != first_path and second.get() == 2 and built is not None


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pieced", [False, True])
def test_undo_copy_in_the_update_pass(grad_dtype, pieced):
    """``undo`` (step_in_backward's undo copy, filled as the update reads each block) receives every element
    of master, exp_avg and exp_avg_sq as before the update, the padding between pieces too, and the update
    itself is bitwise the one without it: fp32 with the fused tails, 16-bit with the 16-bit copy; 1 and 3
    threads; undo buffers misaligned for streaming stores (a head and a tail copied one by one)."""
    get_kernel()
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    n, spans = padded_pieces([13, 70_001, 5, (1 << 17) + 11], 51)
    out_dtype = None if grad_dtype == torch.float32 else grad_dtype
    for nthreads in each_thread_count():
        plain, with_undo = make_state(n, grad_dtype, seed=nthreads), make_state(n, grad_dtype, seed=nthreads)
        before = [t.clone() for t in with_undo]
        undo = tuple(torch.full((n + 1,), float("nan"))[1:] for _ in range(3))
        outs = [torch.zeros(n, dtype=out_dtype) if out_dtype else None for _ in range(2)]
        grad = [(start, with_undo[1][start:end].clone()) for start, end in spans] if pieced else with_undo[1]
        if pieced:
            plain_grad = [(start, plain[1][start:end].clone()) for start, end in spans]
        assert host_adam_ext.try_update(plain[0], plain_grad if pieced else plain[1], plain[2], plain[3], 3, h,
                                        0.5, outs[0], param_spans=spans)
        assert host_adam_ext.try_update(with_undo[0], grad, with_undo[2], with_undo[3], 3, h, 0.5, outs[1],
                                        param_spans=spans, undo=undo)
        for saved, old in zip(undo, (before[0], before[2], before[3])):
            assert torch.equal(saved, old)
        for got, want in zip((with_undo[0], with_undo[2], with_undo[3]), (plain[0], plain[2], plain[3])):
            assert torch.equal(got, want)
        assert not torch.equal(with_undo[2], before[2])
        if out_dtype is not None:
            assert torch.equal(outs[1], outs[0])


def test_undo_copy_where_the_kernel_does_not_apply():
    """Through :func:`adam_update_`: where the kernel does not run (disabled), ``undo`` is copied before the
    torch-op update; where it refuses a buffer (overlapping the undo copy) nothing is written."""
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                  bias_correction=True)
    master, grad, m, v = make_state(N, torch.bfloat16)
    before = [t.clone() for t in (master, m, v)]
    undo = tuple(torch.empty(N) for _ in range(3))
    assert not host_adam_ext.try_update(master, grad, m, v, 1, h, 1.0, None, undo=(master,) + undo[1:])
    assert torch.equal(master, before[0]) and torch.equal(m, before[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(host_adam_ext.DISABLE_ENV, "1")
        adam_update_(master, grad, m, v, 1, h, undo=undo)
    for saved, old in zip(undo, before):
        assert torch.equal(saved, old)
    assert not torch.equal(m, before[1])


def test_the_update_thread_leaves_a_core_to_autograd_s_thread(monkeypatch):
    """Updates that step_in_backward runs off autograd's thread (chunkmem/optim/host_updates.py) split over one
    thread fewer than torch's count; the kernel calls of any other thread keep torch's count."""
    from chunkmem.optim.host_updates import HostUpdates

    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    seen = []
    updates = HostUpdates()
    updates.submit(lambda: seen.append(host_adam_ext.default_threads()), lambda: None)
    updates.close()
    assert seen == [5] and host_adam_ext.default_threads() == 6
    with pytest.raises(ValueError, match="count must be at least 1, not 0"):
        host_adam_ext.set_thread_default(0)
