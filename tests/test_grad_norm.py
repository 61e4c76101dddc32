"""The gradient norm's sum of squares on the host (:mod:`chunkmem.optim.norms`): the native kernel bit for bit
its torch reference, both within double rounding of an exact (``math.fsum``) oracle, inf and NaN kept, and a
clipped step the same with the kernel disabled."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import chunkmem as cm
from chunkmem.optim import host_adam_ext, norms
from tests.models import TinyGPT, batches, build_sharded, lm_loss

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 15, 16, 17, 1000, norms.BLOCK - 1, norms.BLOCK, norms.BLOCK + 1, 3 * norms.BLOCK + 17]


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so that the order of the additions matters
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(8) * 100).to(dtype)


def _kernel():
    kernel = host_adam_ext.kernel()
    if kernel is None:
        pytest.skip(f"host kernel unavailable: {host_adam_ext.load_error()}")
    return kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_is_bitwise_the_reference_and_within_rounding_of_the_exact_sum(dtype):
    kernel = _kernel()
    for seed, n in enumerate(SIZES):
        x = _values(n, dtype, seed)
        exact = math.fsum(v * v for v in x.double().tolist())  # every square exact in double
        fast, reference = kernel.sum_squares(x), norms.sum_of_squares_reference(x)
        assert fast == reference, (n, fast, reference)
        assert fast == pytest.approx(exact, rel=1e-13), n
        assert kernel.sum_squares(x, nthreads=1) == kernel.sum_squares(x, nthreads=3) == fast


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_element_gives_a_non_finite_sum(bad):
    kernel = _kernel()
    for dtype in DTYPES:
        x = _values(norms.BLOCK + 5, dtype, 3)
        x[norms.BLOCK + 2] = bad
        fast, reference = kernel.sum_squares(x), norms.sum_of_squares_reference(x)
        assert not math.isfinite(fast) and not math.isfinite(reference)
        assert math.isnan(fast) == math.isnan(bad)


def test_sum_of_squares_refuses_what_it_cannot_sum():
    with pytest.raises(ValueError, match="float64"):
        norms.sum_of_squares(torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_clipped_training_is_the_same_without_the_kernel(monkeypatch, dtype):
    """The norm, and so the clipping coefficient and the step, do not depend on the kernel being there."""
    _kernel()
    torch.manual_seed(0)
    reference = TinyGPT()

    def run():
        model, optim = build_sharded(reference, "cpu", dtype, max_norm=0.05)
        norms_seen = []
        for x in batches(3):
            optim.backward(lm_loss(model(x), x))
            optim.step()
            norms_seen.append(optim.global_grad_norm)
            optim.zero_grad()
        return model.state_dict(), norms_seen

    with_kernel, norms_with = run()
    # the norm's fallback alone (CHUNKMEM_DISABLE_CPP_ADAM would switch the Adam kernel off too, whose 16-bit
    # path is within an ulp of the torch ops, not bitwise)
    import chunkmem.optim.mixed_precision as mixed
    monkeypatch.setattr(mixed, "sum_of_squares", lambda t: norms.sum_of_squares_reference(t.reshape(-1)))
    without, norms_without = run()
    assert norms_with == norms_without and all(n > 0.05 for n in norms_with)  # clipping triggered every step
    assert all(torch.equal(with_kernel[k], without[k]) for k in with_kernel)


def test_clip_grad_norm_is_the_exact_norm_of_the_gradients():
    """fp32, ``cpu`` placement: the norm chunkmem clips with is the fp64 norm of plain PyTorch's gradients of
    the same batch (within the fp32 rounding of the gradients themselves)."""
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(1)[0]
    plain = TinyGPT()
    plain.load_state_dict(reference.state_dict())
    lm_loss(plain(x), x).backward()
    oracle = math.sqrt(math.fsum(v * v for p in plain.parameters() if p.grad is not None
                                 for v in p.grad.double().flatten().tolist()))
    model, optim = build_sharded(reference, "cpu", torch.float32)
    optim.backward(lm_loss(model(x), x))
    assert optim.clip_grad_norm(1e9) == pytest.approx(oracle, rel=1e-6)


@pytest.mark.parametrize("optimizer", ["ShardedOptimizerV2", "LowLevelZeroOptimizer"])
def test_a_step_without_gradients_reports_no_norm(optimizer):
    """``global_grad_norm`` is the norm the last step computed, or ``None`` when it computed none: a step with no
    gradients since the last one computes none (before 2026-11-28 it still reported the previous step's norm)."""
    torch.manual_seed(0)
    reference = TinyGPT()
    if optimizer == "ShardedOptimizerV2":
        model, optim = build_sharded(reference, "cpu", torch.float32, max_norm=1.0)
    else:
        model = copy.deepcopy(reference)
        optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=1e-3), clip_grad_norm=1.0)
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    assert optim.step() is True and optim.global_grad_norm > 0
    assert optim.step() is False and optim.global_grad_norm is None
