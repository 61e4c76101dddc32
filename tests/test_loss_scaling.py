"""Overflow handling and the DynamicGradScaler rules."""
import pytest
import torch

import chunkmem as cm
from chunkmem.core.chunk import EXP_AVG, EXP_AVG_SQ, MASTER
from models import TinyGPT, batches, build_sharded, lm_loss


def expected_scales(initial, events, *, backoff, growth, interval, hysteresis, lo, hi):
    """Independent statement of the rules: back off on each overflow once `hysteresis` overflows were
    seen since the last growth; grow after `interval` clean steps in a row."""
    scale, overflows, clean, out = initial, 0, 0, []
    for overflow in events:
        if overflow:
            clean = 0
            overflows += 1
            if overflows >= hysteresis:
                scale = max(scale * backoff, lo)
        else:
            clean += 1
            if clean == interval:
                clean, overflows = 0, 0
                scale = min(scale * growth, hi)
        out.append(scale)
    return out


def test_scaler_rules_step_by_step():
    events = [True, False, True, True, False, False, False, True, False, False, False, False, True, True, True,
              True, True, True, True, True, True, True, True, True, True, True]
    kwargs = dict(backoff=0.5, growth=2.0, interval=3, hysteresis=2, lo=1.0, hi=2.0**7)
    scaler = cm.DynamicGradScaler(initial_scale=2.0**6, min_scale=1, growth_factor=2, backoff_factor=0.5,
                                  growth_interval=3, hysteresis=2, max_scale=2.0**7)
    got = []
    for overflow in events:
        scaler.update(overflow)
        got.append(scaler.scale)
    assert got == expected_scales(2.0**6, events, **kwargs)
    assert got[-1] == 1.0  # clamped at min_scale
    # growth clamps at max_scale
    scaler = cm.DynamicGradScaler(initial_scale=2.0**7, growth_interval=1, max_scale=2.0**7)
    scaler.update(False)
    assert scaler.scale == 2.0**7


def snapshot(model):
    return {(c.index, f): c.optim[f].tensor.clone() for c in model.chunks if c.trainable
            for f in (MASTER, EXP_AVG, EXP_AVG_SQ)}


@pytest.mark.parametrize("policy,reuse", [("cpu", True), ("cpu", False), ("cuda", True)])
def test_injected_inf_skips_step_and_follows_scaler(policy, reuse):
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(d=16, layers=1), policy, torch.float16, reuse=reuse,
                                 initial_scale=2.0**8, hysteresis=2, growth_interval=2)
    data = batches(7, batch=2, seq=8)
    inject = [False, True, True, False, False, True, False]
    kwargs = dict(backoff=0.5, growth=2.0, interval=2, hysteresis=2, lo=1.0, hi=2.0**32)
    want_scales = expected_scales(2.0**8, inject, **kwargs)
    for x, bad, want in zip(data, inject, want_scales):
        before = snapshot(model)
        params_before = model.state_dict()
        loss = lm_loss(model(x), x)
        if bad:
            loss = loss * float("inf")
        optim.backward(loss)
        updated = optim.step()
        optim.zero_grad()
        assert updated is (not bad)
        after = snapshot(model)
        for key, value in before.items():
            assert torch.equal(value, after[key]) is bad, key
        if bad:
            for name, value in params_before.items():
                assert torch.equal(value, model.state_dict()[name])
            # the 16-bit parameters still equal the masters rounded (reuse mode restores them)
            for chunk in model.chunks:
                if chunk.trainable:
                    assert torch.equal(chunk.param.current(), chunk.optim[MASTER].tensor.to(torch.float16))
        assert optim.loss_scale == want


def test_bf16_and_fp32_have_no_scaler():
    for dtype in (torch.bfloat16, torch.float32):
        model, optim = build_sharded(TinyGPT(d=16, layers=1), "cpu", dtype)
        assert optim.grad_scaler is None and optim.loss_scale == 1.0


def test_clip_grad_norm_returns_total_norm_and_clips():
    torch.manual_seed(0)
    reference = TinyGPT(d=16, layers=1)
    model, optim = build_sharded(reference, "cpu", torch.float32, lr=1e-2, weight_decay=0.0)
    import copy
    plain = copy.deepcopy(reference)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    for x in batches(3, batch=2, seq=8):
        optim.backward(lm_loss(model(x), x))
        norm = optim.clip_grad_norm(0.1)
        lm_loss(plain(x), x).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        assert norm == pytest.approx(ref_norm.item(), rel=1e-5)
        optim.step()
        optim.zero_grad()
        popt.step()
        popt.zero_grad()
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
