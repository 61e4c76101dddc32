"""The copy engine (chunkmem.core.copy_engine) and the pinned host memory (chunkmem.core.pinned), checked
without a GPU.

The deferred engine completes every copy between the tiers only when its handle is waited on: the destination
is NaN until then, and the source is read then. Each case trains the same model under the plain engine and
under the deferred one and compares every parameter, optimizer state and loss bitwise: a reader that forgets
to wait for a gradient or a parameter copy, or a source reused before its copy ran, makes them differ. The
host's waits are counted by site, and none may happen inside the backward (autograd's hooks) where the step
runs after it. The last test shows that a missing wait does fail these comparisons.
"""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.core import copy_engine, pinned
from chunkmem.runtime.gradients import StagedGradients
from tests.distributed import run_ranks
from tests.models import TinyGPT, batches, lm_loss

CHUNK_BYTES = 16384
AUTO_DEVICE_BYTES = 800 * 1024
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def _build(engine: str, reference, placement="cpu", dtype=torch.float32, max_norm=0.0, step_in_backward=False,
           **model_args):
    copy_engine.set_copy_engine(engine)
    if placement == "auto":
        cm.set_device_memory_capacity(AUTO_DEVICE_BYTES)
    try:
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                                  tensor_placement_policy=placement, dtype=dtype, chunk_size=CHUNK_BYTES,
                                  **model_args)
    finally:
        copy_engine.set_copy_engine(None)
        cm.set_device_memory_capacity(None)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10, max_norm=max_norm, step_in_backward=step_in_backward,
                                  gpu_margin_mem_ratio=0.5 if placement == "auto" else 0.0)
    return model, optim


def _train(model, optim, data, micro_batches=1, overflow_at=None, clip=None):
    """A step per batch (``micro_batches`` backwards before each); ``overflow_at``: the step whose loss is
    multiplied by inf; ``clip``: ``clip_grad_norm`` before each step. Returns losses, steps taken, norms."""
    losses, stepped, norms = [], [], []
    for i, x in enumerate(data):
        for m in range(micro_batches):
            loss = lm_loss(model(x.roll(m, 1)), x.roll(m, 1))
            optim.backward(loss * float("inf") if i == overflow_at else loss)
            losses.append(loss.item())
        if clip is not None:
            norms.append(optim.clip_grad_norm(clip))
        stepped.append(optim.step())
        optim.zero_grad()
    return losses, stepped, norms


def _state(model, optim):
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {(i, k): v.clone() if torch.is_tensor(v) else v
             for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    return params, state


def _assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys() and sa.keys() == sb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for k in sa:
        assert (torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k]), k


def _compare(placement="cpu", dtype="fp32", steps=3, **case):
    """Train under the plain and the deferred engine; same bits. Returns the host waits of the deferred model's
    last step (by site; ``auto`` plans at the end of its traced backwards, and moves gradients then), the model and
    its optimizer (the runtime holds the optimizer weakly: a caller that reads it must hold it)."""
    reference = _reference()
    train_args = {k: case.pop(k) for k in ("micro_batches", "overflow_at", "clip") if k in case}
    data = batches(steps)
    runs = []
    for engine in ("plain", "deferred"):
        model, optim = _build(engine, reference, placement, DTYPES[dtype], **case)
        engine = model.runtime.memory.copies
        result = _train(model, optim, data[:-1], **train_args)
        before = dict(engine.host_waits)
        last = _train(model, optim, data[-1:], **train_args)
        result = tuple(a + b for a, b in zip(result, last))
        waits = {k: v - before.get(k, 0) for k, v in engine.host_waits.items() if v != before.get(k, 0)}
        runs.append((result, _state(model, optim), waits, model, optim))
    (plain_result, plain_state, _, _, _), (deferred_result, deferred_state, waits, model, optim) = runs
    assert plain_result == deferred_result
    _assert_same(plain_state, deferred_state)
    assert model.runtime.memory.copies.name == "deferred"
    return waits, model, optim


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("placement", ["cpu", "auto", "cuda"])
def test_deferred_copies_train_bitwise_as_plain_copies(placement, dtype):
    waits, model, _ = _compare(placement, dtype)
    assert not [site for site in waits if site.endswith("in backward")], waits
    if placement == "cpu":  # every trainable chunk's gradient landed on the host, and was waited for once
        assert waits == {"grad landing": sum(c.trainable for c in model.chunks)}


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_the_step_waits_for_gradients_in_the_order_they_landed(monkeypatch, max_norm):
    """The step updates the chunks in the order the backward finished their gradients (the last layers first),
    so on a GPU the host Adam of the first chunks to land runs while the backward still computes the others.
    Before 2026-11-27 it went in packing order: its first wait, for the first layers' gradients, lasted until
    the whole backward was over (the H200's 336M GPT: backward 135 ms, then 63 ms of host Adam after it).
    With clipping (0.05 clips every step here) the norm reads them in that order too, each as it gets to
    it, and adds their squares in packing order: the bits are the plain engine's."""
    finished, waited = [], []
    store_finish, store_landed = StagedGradients.finish, StagedGradients._landed

    def finish(self, chunk, deferred, overlap=False):
        finished.append(chunk.index)
        return store_finish(self, chunk, deferred, overlap)

    def landed(self, chunk):
        if chunk in self._landing:
            waited.append(chunk.index)
        store_landed(self, chunk)

    monkeypatch.setattr(StagedGradients, "finish", finish)
    monkeypatch.setattr(StagedGradients, "_landed", landed)
    waits, model, optim = _compare("cpu", "fp32", steps=2, max_norm=max_norm)  # (bitwise as the plain engine)
    trainable = [c.index for c in model.chunks if c.trainable]
    last_backward = finished[-len(trainable):]
    assert sorted(last_backward) == trainable and last_backward != trainable  # autograd's order is not packing
    assert waited[-len(trainable):] == last_backward
    assert waits == {"grad landing": len(trainable)}
    assert (optim.mixed.last_norm is not None) == (max_norm > 0)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_deferred_copies_with_clipping_that_triggers_overflow_and_accumulation(dtype):
    """Bitwise the plain engine. Where copies complete late the norm's sums of squares are taken as the gradients
    land (chunkmem/optim/squares_ahead.py), also for the second backward of an accumulation and, from the second
    step, for an explicit ``clip_grad_norm``; the plain engine computes them in the step."""
    _, _, optim = _compare("cpu", dtype, steps=4, max_norm=0.05, overflow_at=1 if dtype == "fp16" else None,
                           micro_batches=2)
    assert optim._squares.used > 0
    _, _, optim = _compare("auto", dtype, steps=4, clip=0.05)
    assert optim._squares.used > 0


@pytest.mark.parametrize("writes", ["clamp", "zero_grad", "grad_none", "accumulate"])
def test_gradients_written_after_their_squares_were_taken_are_summed_anew(writes):
    """A sum of squares taken as a gradient landed stands for that gradient only until something writes it:
    ``clip_grad_value_`` (a clamp in the chunks), ``zero_grad(set_to_none=False)``, ``p.grad = None`` (which zeroes
    the parameter's part of its chunk's gradient), a second backward. The norm (here with clipping that triggers)
    then sums the written gradients, bitwise as the plain engine, which takes every term in the step."""
    def between(model, optim, x):
        if writes == "clamp":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        elif writes == "zero_grad":
            optim.zero_grad(set_to_none=False)
        elif writes == "grad_none":
            next(model.parameters()).grad = None
        else:  # a second backward without accumulating(): every chunk's term is taken again
            optim.backward(lm_loss(model(x.roll(1, 1)), x.roll(1, 1)))

    reference, data = _reference(), batches(3)
    runs = []
    for engine in ("plain", "deferred"):
        model, optim = _build(engine, reference, "cpu", torch.float32, max_norm=0.05)
        norms = []
        for x in data:
            optim.backward(lm_loss(model(x), x))
            between(model, optim, x)
            optim.step()
            norms.append(optim.global_grad_norm)
        runs.append((norms, _state(model, optim), optim._squares.used))
    (plain_norms, plain_state, plain_used), (norms, state, used) = runs
    assert norms == plain_norms and plain_used == 0
    _assert_same(plain_state, state)
    if writes == "accumulate":
        assert used > 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_deferred_copies_with_step_in_backward(dtype):
    """The backward's host updates run off autograd's thread (chunkmem/optim/host_updates.py): the hook never
    waits for a gradient's copy (before 2026-11-27 each chunk's update waited in the hook: 'grad landing in
    backward'), and the result is bitwise the plain engine's, clipping redone included."""
    waits, model, optim = _compare("cpu", dtype, steps=4, step_in_backward=True, max_norm=0.05)
    assert not [site for site in waits if site.endswith("in backward")], waits
    assert waits.get("grad landing", 0) > 0  # the update thread waited for them instead
    assert optim._backward.host_updates.pending == 0
    _compare("cuda", dtype, steps=3, step_in_backward=True)


def test_a_backward_that_fails_while_updates_run_off_autograd_s_thread_leaves_nothing():
    """A backward that raises after it handed chunks' updates to the update thread: they end before anything is
    undone, the state is the one before the backward, nothing is left for the step, and training goes on
    bitwise as without the failed iteration."""
    data = batches(3, seed=4)
    expected_model, expected_optim = _build("plain", _reference(), step_in_backward=True)
    expected = _train(expected_model, expected_optim, data)
    model, optim = _build("deferred", _reference(), step_in_backward=True)
    first = _train(model, optim, data[:1])
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def boom(grad):  # the first block's gradient comes after the later chunks' updates were handed over
        assert optim._backward.host_updates.pending > 0
        raise ValueError("boom")

    handle = model.module.blocks[0].fc1.weight.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        optim.backward(lm_loss(model(data[1]), data[1]))
    handle.remove()
    assert optim._backward.host_updates.pending == 0 and not optim._backward.pending
    assert optim.step() is False
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    rest = _train(model, optim, data[1:])
    assert tuple(a + b for a, b in zip(first, rest)) == expected
    _assert_same(_state(expected_model, expected_optim), _state(model, optim))


def test_deferred_copies_with_the_disk_tier(tmp_path):
    _compare("cpu", "fp16", steps=3, offload_optimizer="disk", nvme_path=str(tmp_path), buffer_size=8192)
    _compare("cpu", "fp32", steps=3, offload_optimizer="disk", nvme_path=str(tmp_path), buffer_size=8192,
             step_in_backward=True)


def _two_ranks(rank, world, engine):
    reference = _reference()
    model, optim = _build(engine, reference, "cpu", torch.float16)
    data = [x[rank::world] for x in batches(3, batch=4)]
    result = _train(model, optim, data)
    params, state = _state(model, optim)
    return result, params, {k: v for k, v in state.items() if torch.is_tensor(v)}, optim._squares.used


def test_deferred_copies_on_two_ranks():
    """fp16 (the overflow check takes the norm every step) with the gradients sharded over two ranks: bitwise the
    plain engine, the deferred one taking each rank's terms as its reduced shards land."""
    plain = run_ranks(_two_ranks, 2, "plain")
    deferred = run_ranks(_two_ranks, 2, "deferred")
    for (ra, pa, sa, used_plain), (rb, pb, sb, used) in zip(plain, deferred):
        assert ra == rb
        _assert_same((pa, sa), (pb, sb))
        assert used_plain == 0 and used > 0


def test_a_missing_wait_fails_under_the_deferred_engine(monkeypatch):
    """The control: a gradient store that reads its gradients without waiting for their copies trains
    differently (on NaN) under the deferred engine, so the comparisons above can fail."""
    monkeypatch.setattr(StagedGradients, "_landed", lambda self, chunk: self._landing.pop(chunk, None))
    with pytest.raises(AssertionError):
        _compare("cpu", "fp32", steps=2)


def test_copy_engine_choice_is_checked():
    with pytest.raises(cm.InvalidArgumentError, match="name"):
        copy_engine.set_copy_engine("fast")
    if not torch.cuda.is_available():
        with pytest.raises(cm.InvalidArgumentError, match="CUDA is not available"):
            copy_engine.set_copy_engine("cuda")
    assert copy_engine.copy_engine_name() == ("cuda" if torch.cuda.is_available() else "plain")


def test_memory_stats_report_the_copy_engine():
    model, optim = _build("deferred", _reference())
    _train(model, optim, batches(1))
    stats = model.memory_stats()["copy_engine"]
    assert stats["engine"] == "deferred" and stats["host_waits"]["grad landing"] >= 1
    assert stats["pinned_bytes"] == 0  # nothing is pinned without CUDA


class _FakeRegistration:
    """cudaHostRegister / cudaHostUnregister stand-ins: which pointers are registered now."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def register(self, ptr, nbytes):
        self.registered[ptr] = nbytes
        return True

    def unregister(self, ptr):
        del self.registered[ptr]


def test_pinned_blocks_are_exact_reused_and_bounded(monkeypatch):
    fake = _FakeRegistration()
    monkeypatch.setattr(pinned, "_register", fake.register)
    monkeypatch.setattr(pinned, "_unregister", fake.unregister)
    pinned.set_pinned_memory_budget(3 * 4000 + 100)
    try:
        memory = pinned.PinnedHostMemory()
        a = memory.empty(1000, torch.float32)
        b = memory.empty(1000, torch.float32)
        assert memory.pinned_bytes == 8000 and sorted(fake.registered.values()) == [4000, 4000]  # exact sizes
        memory.give_back(a)
        c = memory.empty(1000, torch.float32)  # the cached block, not a new registration
        assert len(fake.registered) == 2 and memory.in_use_bytes == 8000
        d = memory.empty(500, torch.float16)
        assert memory.pinned_bytes == 9000
        with pytest.warns(RuntimeWarning, match="pinned-memory budget"):
            e = memory.empty(1000, torch.float32)  # past the budget: pageable
        assert memory.fallback_bytes == 4000 and e.data_ptr() not in fake.registered
        assert memory.stats()["pinned_budget_bytes"] == 12100
        memory.give_back(d, keep=False)  # unregistered at once
        assert memory.pinned_bytes == 8000 and len(fake.registered) == 2
        for t in (b, c, e):
            memory.give_back(t)
        assert memory.in_use_bytes == 0 and memory.fallback_bytes == 0
        memory.release_cached()
        assert fake.registered == {} and memory.pinned_bytes == 0 and pinned.process_pinned_bytes() == 0
    finally:
        pinned.set_pinned_memory_budget(None)


def test_pinned_memory_budget_is_checked():
    with pytest.raises(cm.InvalidArgumentError, match="nbytes"):
        pinned.set_pinned_memory_budget("lots")


def test_unpinned_blocks_are_kept_by_size_for_reuse():
    memory = pinned.PinnedHostMemory(pin=False)
    a = memory.empty(1000, torch.float32)
    first = a.data_ptr()
    memory.give_back(a)
    b = memory.empty(1000, torch.float32)
    assert b.data_ptr() == first and memory.pinned_bytes == 0 and memory.in_use_bytes == 4000
    memory.give_back(b)
    memory.release_cached()
    assert memory.in_use_bytes == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_optimizer_keeps_the_host_copy_its_update_writes(dtype):
    """``static`` placement with ``offload_optim_frac=1.0`` (parameters rest on the device, Adam runs on the host):
    the host copy of the parameters that the update writes stays, current, between steps. Until 2026-11-27 it was
    given back after each step's upload and taken again the next step, with an fp32 chunk's parameters copied back
    from the device first (on a GPU: 1.3 GB pinned, unpinned and copied down a step for a 336M GPT, 4.45x plain
    fp32 on the H200). Now a step moves only the gradients to the host, and trains bitwise as the plain engine,
    also with ``step_in_backward`` (the host updates off autograd's thread, clipping that triggers redone), with the
    updated parameters' copies to the device left in flight after the step."""
    waits, model, _ = _compare("static", dtype, offload_optim_frac=1.0)
    trainable = [c for c in model.chunks if c.trainable]
    assert trainable and all(c.param.shard.allocated and c.param.shard_valid for c in trainable)
    grad_bytes = sum(c.param.nbytes for c in trainable)  # the gradients have the parameters' dtype
    assert model.memory_stats()["totals"]["moved_to_host_bytes"] == grad_bytes
    assert waits == {"grad landing": len(trainable)}
    # the updated parameters' copies back to the device are left in flight by the step (its Adam of the next chunk
    # runs meanwhile; until 2026-11-28 each was waited for before the next chunk's update); their readers wait
    assert all(c.param.fetching for c in trainable)
    assert model.runtime.scheduler.steady_iterations > 0  # waited for when the next iteration begins: still steady
    waits, model, optim = _compare("static", dtype, offload_optim_frac=1.0, step_in_backward=True, max_norm=0.05)
    assert not [site for site in waits if site.endswith("in backward")], waits
    assert optim._backward.host_updates.pending == 0
    assert all(c.param.fetching for c in model.chunks if c.trainable)
