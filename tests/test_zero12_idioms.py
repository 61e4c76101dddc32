"""torch's gradient idioms with LowLevelZeroOptimizer (ZeRO-1/2), against the same loop on the plain module with
``torch.optim.AdamW``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and ``clip_grad_value_`` (what
hand-written loops, Hugging Face ``Trainer``, Accelerate and Lightning call), gradient accumulation, ``p.grad``
reads and ``None`` where torch's ``.grad`` is ``None``; two gloo ranks against one process with the whole batch;
fp16 with a loss scaler. Before 2026-11-28 (issue #37) the optimizer took every gradient out of ``param.grad`` and
left ``None`` there: ``clip_grad_norm_`` returned 0 and clipped nothing, silently."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.optim.host_adam_ext import fp32_reference_options
from distributed import run_ranks

LR, WD, CLIP = 1e-2, 0.01, 0.05
NO_CLIPPING = {"gradient_clipping": 0}  # a DeepSpeed config clips at 1.0 by default, as DeepSpeed does


class Net(nn.Module):
    """A small MLP and a layer no forward uses (torch leaves its .grad None and AdamW does not step it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8))
        self.unused = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().half().float()  # values exact in fp16: a cast to it changes nothing


def data(steps: int, batch: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g).half().float(), torch.randn(batch, 8, generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def plain_pair() -> tuple[Net, torch.optim.Optimizer]:
    model = make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())


def zero_pair(stage: int, via_config: bool = False, **kwargs) -> tuple[Net, cm.LowLevelZeroOptimizer]:
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if via_config:
        model, optim = cm.initialize(model, adamw, {"zero_optimization": {"stage": stage}, **NO_CLIPPING})
    else:
        optim = cm.LowLevelZeroOptimizer(adamw, partition_grad=stage == 2, **kwargs)
    assert isinstance(optim, cm.LowLevelZeroOptimizer)
    return model, optim


def loop(model, optim, batches, clip_fn=torch.nn.utils.clip_grad_norm_, clip=CLIP, micro=1, rank=0, world=1,
         no_sync=False, **clip_kwargs) -> list:
    """``backward`` (``micro`` times per step, of this rank's part of each batch), ``clip_fn(model.parameters(),
    clip)``, ``step``, ``zero_grad``; returns what ``clip_fn`` returned at each step."""
    out = []
    for x, y in batches:
        share = x.shape[0] // world
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        size = share // micro
        for i in range(micro):
            last = i == micro - 1
            context = optim.no_sync() if no_sync and not last else _Nothing()
            with context:
                (loss_fn(model(x[i * size:(i + 1) * size]), y[i * size:(i + 1) * size]) / micro).backward()
        out.append(clip_fn(model.parameters(), clip, **clip_kwargs))
        optim.step()
        optim.zero_grad()
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def assert_weights_close(model: nn.Module, plain: nn.Module, rtol: float = 1e-5) -> None:
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.detach().float(), theirs.detach(), rtol=rtol,
                                   atol=rtol * theirs.detach().abs().max().item(), msg=name)


def assert_norms_equal(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert isinstance(a, torch.Tensor) and a.dim() == 0
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=0)


# ---- one process, fp32 --------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("via_config", [True, False], ids=["initialize", "LowLevelZeroOptimizer"])
def test_clip_grad_norm_on_model_parameters_trains_like_plain_torch(stage, via_config):
    batches = data(4)
    plain, ref = plain_pair()
    theirs = loop(plain, ref, batches)
    model, optim = zero_pair(stage, via_config)
    ours = loop(model, optim, batches)
    assert all(float(t) > CLIP for t in theirs)  # the clipping triggers in every step
    assert_norms_equal(ours, theirs)
    assert_weights_close(model, plain)
    assert torch.equal(model.unused.weight, make_model().unused.weight)  # no gradient: not stepped, as torch


@pytest.mark.parametrize("stage", [1, 2])
def test_foreach_clip_grad_norm_and_the_inf_norm(stage):
    batches = data(3)
    for kwargs in ({"foreach": True}, {"norm_type": float("inf")}, {"norm_type": 1.0}):
        plain, ref = plain_pair()
        theirs = loop(plain, ref, batches, clip=0.01, **kwargs)
        model, optim = zero_pair(stage)
        ours = loop(model, optim, batches, clip=0.01, **kwargs)
        assert all(float(t) > 0.01 for t in theirs), kwargs
        assert_norms_equal(ours, theirs)
        assert_weights_close(model, plain)


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_value_trains_like_plain_torch(stage):
    batches = data(4)
    plain, ref = plain_pair()
    loop(plain, ref, batches, clip_fn=torch.nn.utils.clip_grad_value_, clip=1e-3)
    unclipped, unclipped_optim = plain_pair()
    loop(unclipped, unclipped_optim, batches, clip_fn=lambda *_: None)
    model, optim = zero_pair(stage)
    loop(model, optim, batches, clip_fn=torch.nn.utils.clip_grad_value_, clip=1e-3)
    assert_weights_close(model, plain)
    assert not torch.allclose(plain.body[0].weight, unclipped.body[0].weight)  # the clamping changed the training


@pytest.mark.parametrize("stage", [1, 2])
def test_two_accumulated_backwards_then_clip_like_plain_torch(stage):
    batches = data(3)
    plain, ref = plain_pair()
    theirs = loop(plain, ref, batches, micro=2)
    model, optim = zero_pair(stage)
    ours = loop(model, optim, batches, micro=2)
    assert all(float(t) > CLIP for t in theirs)
    assert_norms_equal(ours, theirs)
    assert_weights_close(model, plain)
    # inside no_sync (one process: the same sum)
    model, optim = zero_pair(stage)
    assert_norms_equal(loop(model, optim, batches, micro=2, no_sync=True), theirs)
    assert_weights_close(model, plain)


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_reads_like_plain_torch_and_is_none_where_torch_has_none(stage):
    plain, ref = plain_pair()
    model, optim = zero_pair(stage)
    (x, y), (x2, y2) = data(2)
    assert all(p.grad is None for p in model.parameters())
    for m in (model, plain):
        loss_fn(m(x), y).backward()

    def same_grads(kept=None) -> None:
        for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
            if theirs.grad is None:
                assert ours.grad is None, name
                continue
            g = ours.grad
            assert isinstance(g, cm.ZeroGradient), name
            assert (g.shape, g.dtype, g.device) == (theirs.grad.shape, theirs.grad.dtype, theirs.grad.device)
            assert torch.equal(g.clone(), theirs.grad), name  # one process, fp32: the same sums, bitwise
            assert torch.equal(g.detach().cpu(), theirs.grad) and torch.equal(g.data.clone(), theirs.grad)
            assert float(g.sum()) == float(theirs.grad.sum()) and torch.allclose(g, theirs.grad)
            assert str(g) == str(theirs.grad)
            torch.testing.assert_close(g.norm(), theirs.grad.norm(), rtol=1e-6, atol=0)
            if kept is not None:
                assert g is kept[name]  # a kept reference to p.grad stays valid over an accumulating backward

    same_grads()
    kept = {name: p.grad for name, p in model.named_parameters()}
    for m in (model, plain):  # accumulation: autograd adds to the stand-in as to torch's .grad
        loss_fn(m(x2), y2).backward()
    same_grads(kept)

    for m in (model, plain):  # setting .grad to None drops that gradient, as in torch
        m.body[0].weight.grad = None
        m.body[2].bias.grad = torch.ones_like(m.body[2].bias)  # a tensor replaces it
        loss_fn(m(x), y).backward()
    same_grads()

    optim.zero_grad(set_to_none=False)  # zeroed, still there
    ref.zero_grad(set_to_none=False)
    same_grads()
    for m in (model, plain):
        loss_fn(m(x2), y2).backward()
    same_grads()

    kept = model.body[0].weight.grad
    optim.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(cm.UnsupportedOperationError, match="read param.grad again"):
        kept.clone()
    loss_fn(model(x), y).backward()
    optim.step()  # the step releases the gradients it used, as the reference does
    assert all(p.grad is None for p in model.parameters())


def test_in_place_changes_reach_what_the_step_applies():
    """g.mul_, g /= c, g.add_, g.copy_, g[i] = v, g.zero_() on the stand-ins change the gradient the step applies
    as they change torch's .grad."""
    batches = data(2)
    runs = []
    for zero in (False, True):
        model, optim = zero_pair(1) if zero else plain_pair()
        for x, y in batches:
            loss_fn(model(x), y).backward()
            w, b = model.body[0].weight, model.body[0].bias
            w.grad.mul_(0.5)
            w.grad /= 3
            b.grad.add_(torch.full_like(b, 0.25))
            model.body[2].weight.grad[0] = 1.0
            model.body[2].bias.grad.copy_(torch.arange(8.0))
            model.body[4].weight.grad.zero_()
            torch._foreach_mul_([model.body[4].bias.grad, model.body[2].weight.grad], 0.1)
            optim.step()
            optim.zero_grad()
        runs.append(model)
    assert_weights_close(runs[1], runs[0])


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_without_set_to_none_zeroes_a_gradient_the_user_set(stage):
    """``p.grad = tensor`` then ``zero_grad(set_to_none=False)``: torch zeroes that tensor in place and the next step
    applies zeros to ``p`` (Adam's moments move it). Before 2026-11-28 the optimizer dropped it: ``p.grad`` read
    ``None`` and ``p`` was not stepped (found by tests/test_zero12_semantics_fuzz.py)."""
    plain, ref = plain_pair()
    model, optim = zero_pair(stage)
    for m, o in ((model, optim), (plain, ref)):
        for x, y in data(2):
            loss_fn(m(x), y).backward()
            assigned = m.body[2].bias.grad = torch.ones(8)
            o.zero_grad(set_to_none=False)
            assert m.body[2].bias.grad is assigned and torch.equal(assigned, torch.zeros(8))
            o.step()
            o.zero_grad()
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(ours, theirs), name
    steps = {i: int(e["step"]) for i, e in optim.state_dict()["state"].items()}
    assert steps == {i: int(e["step"]) for i, e in ref.state_dict()["state"].items()} and steps[3] == 2


# ---- fp16 with a loss scaler -----------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_clip_grad_norm_returns_the_optimizers_own_unscaled_norm(stage):
    """The store holds gradients times the loss scale; torch's idiom returns the unscaled norm, the one the
    optimizer's own clipping (clip_grad_norm=) computes, and the training clips as that does."""
    runs = []
    for idiom in (True, False):
        model = make_model().half()
        optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                                         partition_grad=stage == 2, initial_scale=2**10,
                                         clip_grad_norm=0.0 if idiom else CLIP)
        norms = []
        for x, y in data(3):
            optim.backward(loss_fn(model(x.half()), y))
            if idiom:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            assert optim.step()
            if not idiom:
                norms.append(optim.global_grad_norm)
            optim.zero_grad()
        assert optim.loss_scale == 2**10  # no overflow: the norms are of the same gradients
        runs.append((norms, [optim.master_of(p) for p in model.body.parameters()]))
    (idiom_norms, idiom_masters), (own_norms, own_masters) = runs
    assert all(n > CLIP for n in own_norms)
    torch.testing.assert_close(torch.tensor(idiom_norms), torch.tensor(own_norms), rtol=1e-5, atol=0)
    for a, b in zip(idiom_masters, own_masters):  # (the idiom scales the fp16 store: one more rounding)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_fp16_overflow_still_skips_after_clip_grad_value():
    model = make_model().half()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), initial_scale=2**10)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(1)[0]
    optim.backward(loss_fn(model(x.half()), y) * 1e4)  # overflows fp16 at this scale
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    assert not optim.step()  # skipped (an inf clamped to a finite value would have been applied)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ---- what cannot be exact is refused, naming the alternative ----------------------------------------------

def _sync_then_no_sync(rank: int = 0, world: int = 1) -> dict:
    """A backward, one inside ``no_sync`` and ``clip_grad_norm_`` / ``clip_grad_value_`` then, then a backward
    outside and ``clip_grad_norm_``: what each returned or the refusal's message; the ``.grad`` reads and the
    parameters after the step."""
    model, optim = zero_pair(1)
    out: dict = {}
    batches = [(x[rank::world], y[rank::world]) for x, y in data(3)]
    loss_fn(model(batches[0][0]), batches[0][1]).backward()
    with optim.no_sync():
        loss_fn(model(batches[1][0]), batches[1][1]).backward()
    for name, clip in (("norm", torch.nn.utils.clip_grad_norm_), ("value", torch.nn.utils.clip_grad_value_)):
        try:
            out[name] = clip(model.parameters(), 100.0)
        except cm.UnsupportedOperationError as error:
            out[name] = str(error)
    loss_fn(model(batches[2][0]), batches[2][1]).backward()
    out["read"] = [p.grad.clone() for p in model.body.parameters()]
    out["after"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optim.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_sync_then_no_sync_in_one_process_sums_in_torchs_order():
    """One rank: no_sync has nothing to defer; the gradients are summed as autograd sums torch's ``.grad``, bit for
    bit (before 2026-11-28 the local sum was added to the reduced gradient at the end, ``g1 + (g2 + g3)``, off
    torch's ``(g1 + g2) + g3`` in the last bits: found by tests/test_zero12_semantics_fuzz.py), and clipping works
    inside it."""
    plain, ref = plain_pair()
    (x, y), (x2, y2), (x3, y3) = data(3)
    for xs, ys in ((x, y), (x2, y2)):
        loss_fn(plain(xs), ys).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 100.0)
    torch.nn.utils.clip_grad_value_(plain.parameters(), 100.0)
    loss_fn(plain(x3), y3).backward()
    read = [p.grad.clone() for p in plain.body.parameters()]
    after = torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
    ref.step()
    ours = _sync_then_no_sync()
    assert all(torch.equal(a, b) for a, b in zip(ours["read"], read))
    for (name, _), a, b in zip(plain.named_parameters(), ours["params"], plain.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(ours["norm"], norm) and torch.equal(ours["after"], after)


def test_sync_then_no_sync_over_two_ranks_reads_the_sum_and_refuses_clipping(two_ranks):
    """Two ranks: inside no_sync ``.grad`` is the reduced gradient plus the local one (as DDP's), and clipping it
    is refused (its norm is not the norm of any gradient torch would hold); outside, clipping works again."""
    for result in two_ranks:
        refused = result["no_sync_clip"]
        assert "no_sync" in refused["norm"] and "clip_grad_norm=max_norm" in refused["norm"]
        assert "no_sync" in refused["value"] and isinstance(refused["after"], torch.Tensor)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_with_create_graph_into_a_kept_gradient_is_refused():
    model, optim = zero_pair(1)
    x, y = data(1)[0]
    loss_fn(model(x), y).backward()
    with pytest.raises(cm.UnsupportedOperationError, match="create_graph"):
        loss_fn(model(x), y).backward(create_graph=True)


# ---- two ranks against one process with the whole batch -----------------------------------------------------

def _two_rank_scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    batches = data(3)
    for stage in (1, 2):
        for overlap in (False, True):
            model, optim = zero_pair(stage, overlap_communication=overlap, reduce_bucket_size=64)
            norms = loop(model, optim, batches, rank=rank, world=world)
            out[("norm", stage, overlap)] = (norms, [p.detach().clone() for p in model.parameters()])
        model, optim = zero_pair(stage)
        loop(model, optim, batches, clip_fn=torch.nn.utils.clip_grad_value_, clip=1e-3, rank=rank, world=world)
        out[("value", stage)] = [p.detach().clone() for p in model.parameters()]
        model, optim = zero_pair(stage, reduce_bucket_size=64)
        norms = loop(model, optim, batches, micro=2, no_sync=True, rank=rank, world=world)
        out[("no_sync", stage)] = (norms, [p.detach().clone() for p in model.parameters()])
        # reads after one backward: the mean over the ranks (stage 1); refused, sharded, at stage 2
        model, optim = zero_pair(stage)
        x, y = batches[0]
        loss_fn(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        out[("norms", stage)] = [p.grad.norm() for p in model.body.parameters()]
        if stage == 1:
            out[("read", stage)] = [p.grad.clone() for p in model.body.parameters()]
        else:
            try:
                model.body[0].weight.grad.clone()
                out[("read", stage)] = "read"
            except cm.UnsupportedOperationError as error:
                out[("read", stage)] = str(error)
    out["no_sync_clip"] = _sync_then_no_sync(rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Every two-process scenario of this file in one spawn (starting the processes costs most)."""
    return run_ranks(_two_rank_scenarios, 2)


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_clip_like_one_process_with_the_whole_batch(two_ranks, stage):
    batches = data(3)
    plain, ref = plain_pair()
    theirs = loop(plain, ref, batches)
    for overlap in (False, True):
        for result in two_ranks:
            norms, params = result[("norm", stage, overlap)]
            assert_norms_equal(norms, theirs)
            for (name, ours), want in zip(make_model().named_parameters(), plain.parameters()):
                torch.testing.assert_close(params.pop(0), want.detach(), rtol=1e-5,
                                           atol=1e-5 * want.detach().abs().max().item(), msg=name)
    plain, ref = plain_pair()
    loop(plain, ref, batches, clip_fn=torch.nn.utils.clip_grad_value_, clip=1e-3)
    for result in two_ranks:
        for ours, want in zip(result[("value", stage)], plain.parameters()):
            torch.testing.assert_close(ours, want.detach(), rtol=1e-5, atol=1e-5 * want.detach().abs().max().item())


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_no_sync_accumulation_then_clip(two_ranks, stage):
    batches = data(3)
    plain, ref = plain_pair()
    theirs = loop(plain, ref, batches)
    for result in two_ranks:
        norms, params = result[("no_sync", stage)]
        assert_norms_equal(norms, theirs)
        for ours, want in zip(params, plain.parameters()):
            torch.testing.assert_close(ours, want.detach(), rtol=1e-5, atol=1e-5 * want.detach().abs().max().item())


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_grad_reads_and_norms(two_ranks, stage):
    plain, _ = plain_pair()
    x, y = data(3)[0]
    loss_fn(plain(x), y).backward()
    for result in two_ranks:
        for ours, want in zip(result[("norms", stage)], plain.body.parameters()):
            torch.testing.assert_close(ours, want.grad.norm(), rtol=1e-5, atol=0)
        if stage == 1:
            for ours, want in zip(result[("read", stage)], plain.body.parameters()):
                torch.testing.assert_close(ours, want.grad, rtol=1e-5, atol=1e-7)
        else:
            assert "safe_get_full_grad" in result[("read", stage)] and "2 ranks" in result[("read", stage)]
