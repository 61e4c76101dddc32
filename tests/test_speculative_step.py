"""``step_in_backward`` where ``step()`` may decide otherwise than the backward assumed: fp16 (an overflow skips
the step), clipping (``clip_grad_norm`` and ``max_norm``), hyper-parameters changed between the backward and the
step, and parameters on disk. The backward updates each disk chunk as if nothing overflowed and nothing is
clipped, into the disk's other slot; ``step()`` commits that, or undoes it and runs the step again. Every case
is checked bitwise against the plain step (``cpu`` placement, optimizer state in memory, no step in the
backward). Optimizer state in memory (host or device tier) is updated in place after an undo copy
(:mod:`chunkmem.optim.speculation`), checked the same way against the same model without ``step_in_backward``."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from tests.distributed import run_ranks
from tests.models import TinyGPT, batches, lm_loss

CHUNK_BYTES = 16384
PIECE = 8192


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def _pair(reference, directory, dtype, policy="cpu", offload_param=None, max_norm=0.0):
    """The plain model and the one whose disk chunks are stepped in the backward, both with ``max_norm``."""
    def build(**disk):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                                  tensor_placement_policy=policy if disk else "cpu", dtype=dtype,
                                  chunk_size=CHUNK_BYTES, **disk)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                      initial_scale=2**10, max_norm=max_norm, step_in_backward=bool(disk))
        return model, optim

    plain = build()
    disk = build(offload_optimizer="disk", offload_param=offload_param, nvme_path=str(directory), buffer_size=PIECE)
    assert [c for c in disk[0].chunks if c.trainable and disk[1].runtime.optim_tier(c) is cm.Tier.DISK]
    return plain, disk


def _same(plain, disk):
    (a, oa), (b, ob) = plain, disk
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    da, db = oa.state_dict(), ob.state_dict()
    for index, state in da["state"].items():
        for name, value in state.items():
            assert torch.equal(value, db["state"][index][name]), (index, name)
    assert oa.loss_scale == ob.loss_scale


def _run(pair, data, before_step=None, loss_factor=None):
    """One step per batch on each model of ``pair``; ``before_step(step, optim)`` runs between the backward
    and the step (clipping, a changed learning rate), ``loss_factor(step)`` scales the loss (an overflow).
    Returns what each ``step()`` returned and how many disk chunks the backward had started."""
    results = []
    for model, optim in pair:
        stepped, started = [], []
        for step, x in enumerate(data):
            loss = lm_loss(model(x), x)
            optim.backward(loss * loss_factor(step) if loss_factor else loss)
            started.append(optim.backward_updates)
            if before_step is not None:
                before_step(step, optim)
            stepped.append(optim.step())
            optim.zero_grad()
        results.append((stepped, started))
    return results


PLACES = [("cpu", None), ("cpu", "disk"), ("auto", None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy,offload_param", PLACES, ids=["state-on-disk", "params-on-disk-too", "auto"])
def test_clipping_that_triggers_redoes_the_step_and_one_that_does_not_commits_it(tmp_path, dtype, policy,
                                                                                  offload_param):
    plain, disk = _pair(_reference(), tmp_path, dtype, policy, offload_param)
    norms = {}

    def clip(step, optim):  # every other step clips hard, the others not at all
        norms.setdefault(step, []).append(optim.clip_grad_norm(1e-3 if step % 2 else 1e6))

    (plain_steps, _), (disk_steps, started) = _run([plain, disk], batches(4), before_step=clip)
    assert plain_steps == disk_steps == [True] * 4
    assert all(n > 0 for n in started)  # the backward had started its updates every time
    assert all(a == b for a, b in norms.values())
    _same(plain, disk)


@pytest.mark.parametrize("policy,offload_param", PLACES, ids=["state-on-disk", "params-on-disk-too", "auto"])
def test_fp16_overflow_undoes_the_backward_updates_and_skips_the_step(tmp_path, policy, offload_param):
    plain, disk = _pair(_reference(), tmp_path, torch.float16, policy, offload_param, max_norm=0.5)
    overflow = lambda step: float("inf") if step == 1 else 1.0  # noqa: E731
    (plain_steps, _), (disk_steps, started) = _run([plain, disk], batches(4), loss_factor=overflow)
    assert plain_steps == disk_steps == [True, False, True, True]
    assert started[1] > 0
    _same(plain, disk)


@pytest.mark.parametrize("offload_optimizer", [None, "disk"])
def test_auto_margin_decided_after_the_traced_iteration_is_where_the_step_updates(tmp_path, offload_optimizer):
    """Under ``auto`` with ``gpu_margin_mem_ratio`` the margin's optimizer state moves to the device when a traced
    iteration ends: that iteration's backward updates nothing (an update there would run where the state no
    longer is: on a GPU another kernel, other rounding, not bitwise the plain step; with the state on disk the
    step crashed), the iterations that follow the plan update every chunk."""
    def build(step_in_backward):
        disk = dict(offload_optimizer="disk", nvme_path=str(tmp_path),
                    buffer_size=PIECE) if offload_optimizer else {}
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="auto",
                                  dtype=torch.float16, chunk_size=CHUNK_BYTES, **disk)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                      gpu_margin_mem_ratio=0.5, step_in_backward=step_in_backward)
        return model, optim

    reference = _reference()
    plain, ahead = build(False), build(True)
    (plain_steps, _), (ahead_steps, started) = _run([plain, ahead], batches(4))
    assert plain_steps == ahead_steps == [True] * 4
    assert started[0] == 0 and started[-1] > 0
    assert all(ahead[1].runtime.optim_tier(c) is cm.Tier.DEVICE for c in ahead[0].chunks if c.trainable)
    _same(plain, ahead)


def test_a_learning_rate_changed_between_backward_and_step_is_the_one_applied(tmp_path):
    plain, disk = _pair(_reference(), tmp_path, torch.bfloat16)

    def halve(step, optim):
        for group in optim.param_groups:
            group["lr"] *= 0.5

    _run([plain, disk], batches(3), before_step=halve)
    _same(plain, disk)


def _two_ranks(rank, world, directory):
    plain, disk = _pair(_reference(), f"{directory}/{rank}", torch.float16, offload_param="disk", max_norm=0.05)
    data = [x[rank::world] for x in batches(3, batch=4)]
    overflow = lambda step: float("inf") if step == 1 else 1.0  # noqa: E731
    (plain_steps, _), (disk_steps, _) = _run([plain, disk], data, loss_factor=overflow)
    _same(plain, disk)
    return plain_steps, disk_steps


@pytest.mark.slow
def test_two_ranks_fp16_clipped_with_an_overflow_and_parameters_on_disk(tmp_path):
    for rank in range(2):
        (tmp_path / str(rank)).mkdir()
    for plain_steps, disk_steps in run_ranks(_two_ranks, 2, str(tmp_path)):
        assert plain_steps == disk_steps == [True, False, True]


@pytest.mark.parametrize("what", ["fp16 in place", "clipping in place", "fp16 reusing the shard"])
def test_what_could_not_be_undone_is_refused_before_anything_changes(tmp_path, what):
    dtype = torch.bfloat16 if what == "clipping in place" else torch.float16
    model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=CHUNK_BYTES, offload_optimizer="disk", nvme_path=str(tmp_path),
                              reuse_fp16_shard=what == "fp16 reusing the shard",
                              atomic_step=what == "fp16 reusing the shard")
    reason = "reuse_fp16_shard=True" if what == "fp16 reusing the shard" else "atomic_step=False"
    max_norm = 1.0 if what == "clipping in place" else 0.0
    with pytest.raises(cm.InvalidArgumentError, match=f"step_in_backward.*{reason}"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), max_norm=max_norm, step_in_backward=True)
    assert not model.optimizer_attached
    if what == "clipping in place":  # built without max_norm, clip_grad_norm after the backward is refused
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=True)
        x = batches(1)[0]
        optim.backward(lm_loss(model(x), x))
        with pytest.raises(cm.UnsupportedOperationError, match="clip_grad_norm with step_in_backward=True and "
                                                                "atomic_step=False"):
            optim.clip_grad_norm(1.0)
        assert optim.step()  # the refusal changed nothing


# ---- optimizer state in memory (host or device tier): updated in place after an undo copy -----------------


def _pair_in_memory(reference, dtype, policy, max_norm=0.0, optimizer=None, **model_args):
    """The plain model and one whose chunks are updated in the backward, their optimizer state in memory."""
    def build(in_backward):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=dtype, chunk_size=CHUNK_BYTES, **model_args)
        inner = (optimizer or (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.01)))(model.parameters())
        optim = cm.ShardedOptimizerV2(model, inner, initial_scale=2**10, max_norm=max_norm,
                                      gpu_margin_mem_ratio=0.5 if policy == "auto" else 0.0,
                                      step_in_backward=in_backward)
        return model, optim

    if policy != "auto":
        return build(False), build(True)
    cm.set_device_memory_capacity(AUTO_DEVICE_BYTES)  # read when a model is wrapped
    try:
        pair = build(False), build(True)
    finally:
        cm.set_device_memory_capacity(None)
    # auto traces its first two iterations here, and the margin's state moves to the device as each ends: their
    # backwards update nothing (the step does), so the cases below start once the plan is followed.
    (_, (_, started)) = _run(pair, batches(2, seed=5))
    assert started == [0, 0]
    return pair


def _kept(pair, data, before_step=None, loss_factor=None):
    """Like :func:`_run`, also returning how many backward updates each step of the second model kept."""
    model, optim = pair[1]
    kept = []
    original = optim.step

    def step():
        result = original()
        kept.append(optim.kept_backward_updates)
        return result

    optim.step = step
    try:
        return _run(pair, data, before_step, loss_factor), kept
    finally:
        del optim.step


MEMORY_PLACES = ["cpu", "cuda", "auto"]
AUTO_DEVICE_BYTES = 800 * 1024  # under auto, the first chunks' optimizer state on the device, the rest on the host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy", MEMORY_PLACES)
def test_in_memory_clipping_that_triggers_redoes_and_one_that_does_not_keeps(dtype, policy):
    pair = _pair_in_memory(_reference(), dtype, policy)

    def clip(step, optim):
        optim.clip_grad_norm(1e-3 if step % 2 else 1e6)

    ((plain_steps, _), (steps, started)), kept = _kept(pair, batches(4), before_step=clip)
    assert plain_steps == steps == [True] * 4
    trainable = len(pair[1][0].runtime.trainable_chunks())
    assert started == [trainable] * 4  # every chunk updated in the backward
    assert kept == [trainable, 0, trainable, 0]  # kept where clipping did not trigger, redone where it did
    tiers = {pair[1][1].runtime.optim_tier(c) for c in pair[1][0].runtime.trainable_chunks()}
    assert tiers == {"cpu": {cm.Tier.HOST}, "cuda": {cm.Tier.DEVICE}, "auto": {cm.Tier.HOST, cm.Tier.DEVICE}}[policy]
    _same(*pair)


@pytest.mark.parametrize("policy", MEMORY_PLACES)
def test_in_memory_fp16_overflow_undoes_the_backward_updates(policy):
    pair = _pair_in_memory(_reference(), torch.float16, policy, max_norm=0.5)
    overflow = lambda step: float("inf") if step == 1 else 1.0  # noqa: E731
    ((plain_steps, _), (steps, started)), kept = _kept(pair, batches(4), loss_factor=overflow)
    assert plain_steps == steps == [True, False, True, True]
    assert started[1] > 0 and kept[1] == 0
    _same(*pair)


def test_in_memory_learning_rate_changed_between_backward_and_step_is_applied():
    pair = _pair_in_memory(_reference(), torch.bfloat16, "cpu")

    def halve(step, optim):
        if step == 1:
            for group in optim.param_groups:
                group["lr"] *= 0.5

    (_, kept) = _kept(pair, batches(3), before_step=halve)
    trainable = len(pair[1][0].runtime.trainable_chunks())
    assert kept == [trainable, 0, trainable]
    _same(*pair)


def test_in_memory_another_optimizer_with_scalar_state_redone_bitwise():
    nadam = lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.01)  # noqa: E731  (mu_product: scalar state)
    pair = _pair_in_memory(_reference(), torch.float32, "cpu", optimizer=nadam)

    def clip(step, optim):
        optim.clip_grad_norm(1e-3 if step == 1 else 1e6)

    _kept(pair, batches(3), before_step=clip)
    _same(*pair)


def test_undo_copies_are_counted_exactly_between_backward_and_step_and_released():
    from chunkmem.optim.speculation import UNDO, undo_nbytes

    (_, (model, optim)) = _pair_in_memory(_reference(), torch.bfloat16, "cpu")
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    expected = sum(undo_nbytes(c) for c in model.runtime.trainable_chunks())
    # bf16: master, exp_avg, exp_avg_sq, fp32 each, per element of every trainable chunk
    assert expected == sum(3 * 4 * c.shard_numel for c in model.runtime.trainable_chunks())
    assert model.tier_bytes()["host"][UNDO] == expected
    optim.step()
    assert model.tier_bytes()["host"].get(UNDO, 0) == 0


def test_zero_grad_before_step_undoes_the_backward_updates():
    (plain, (model, optim)) = _pair_in_memory(_reference(), torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    assert optim.backward_updates > 0
    with pytest.raises(cm.UnsupportedOperationError, match="not decided yet"):
        optim.state_dict()
    optim.zero_grad()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optim.state_dict()["state"] == {}  # no step happened: no state, as torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_grad_after_a_forward_between_backward_and_step_reads_the_values_put_back(tmp_path, dtype):
    """A forward between the backward and ``step()`` whose output is dropped (an evaluation, or the forward of a
    second backward that ``step_in_backward`` refuses) fetches the parameters of the disk chunks while the
    backward's update has overwritten them in host memory (documented: values part-way through it; here the
    stream is waited for, so all of them), and keeps that copy. ``zero_grad()`` then undoes the update and puts
    the host values back. Before (found by tests/test_deferred_reads_fuzz.py) the fetched copy stayed current: a
    parameter read after ``zero_grad()`` (``p.detach()``, ``print(p)``) showed the undone update's values, where
    ``model.state_dict()`` showed the restored ones."""
    _, (model, optim) = _pair(_reference(), tmp_path, dtype)
    with torch.no_grad():
        before = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    x, y = batches(2)
    optim.backward(lm_loss(model(x), x))
    optim._backward.in_flight.wait_until_computed(0)  # every disk chunk's parameters hold the update now
    model(y)  # (its output dropped: no backward)
    optim.zero_grad()
    with torch.no_grad():
        after = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    state = model.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
        assert torch.equal(state[name], value), name


def test_no_room_on_the_host_for_the_undo_copies_is_refused_before_anything_changes():
    cm.set_host_memory_capacity("600KiB")
    try:
        model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=CHUNK_BYTES)
        with pytest.raises(cm.InvalidArgumentError, match=r"step_in_backward.*undo copies.* bytes"):
            cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=True)
        assert not model.optimizer_attached
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))  # without it: room enough
        x = batches(1)[0]
        optim.backward(lm_loss(model(x), x))
        assert optim.step()
    finally:
        cm.set_host_memory_capacity(None)


def test_reuse_fp16_shard_with_state_in_memory_is_refused():
    model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16, chunk_size=CHUNK_BYTES, reuse_fp16_shard=True)
    with pytest.raises(cm.InvalidArgumentError, match="step_in_backward.*reuse_fp16_shard=True"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=True)
    assert not model.optimizer_attached


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
def test_hyper_parameters_changed_where_the_disk_updates_cannot_be_redone_raise(tmp_path, atomic):
    """reuse_fp16_shard (the update overwrites the gradients) or atomic_step=False (written in place): a
    learning rate changed between the backward and the step cannot be applied; it used to be silently
    ignored (reuse_fp16_shard) or fail an internal assertion (atomic_step=False)."""
    model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16, chunk_size=CHUNK_BYTES, reuse_fp16_shard=atomic,
                              atomic_step=atomic, offload_optimizer="disk", nvme_path=str(tmp_path),
                              buffer_size=PIECE)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), step_in_backward=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    for group in optim.param_groups:
        group["lr"] *= 0.5
    with pytest.raises(cm.UnsupportedOperationError, match="changed between the backward and the step"):
        optim.step()
    if atomic:  # skipped: as before the backward, and training goes on
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        optim.backward(lm_loss(model(x), x))
        assert optim.step()
    else:  # half-stepped: refused until a state is loaded
        with pytest.raises(cm.UnsupportedOperationError, match="load a checkpoint"):
            optim.step()


def _two_ranks_in_memory(rank, world, policy):
    pair = _pair_in_memory(_reference(), torch.float16, policy, max_norm=0.05)
    data = [x[rank::world] for x in batches(3, batch=4)]
    overflow = lambda step: float("inf") if step == 1 else 1.0  # noqa: E731
    (plain_steps, _), (steps, started) = _run(pair, data, loss_factor=overflow)
    _same(*pair)
    return plain_steps, steps, started


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_two_ranks_in_memory_fp16_clipped_with_an_overflow(policy):
    for plain_steps, steps, started in run_ranks(_two_ranks_in_memory, 2, policy):
        assert plain_steps == steps == [True, False, True]
        assert all(n > 0 for n in started)


@pytest.mark.parametrize("on_disk", [False, True], ids=["in-memory", "state-on-disk"])
def test_backwards_inside_accumulating_add_up_and_the_last_one_starts_the_updates(tmp_path, on_disk):
    """Gradient accumulation with step_in_backward: the backwards before the last run inside
    ``optim.accumulating()``; bitwise the plain optimizer's accumulation of the same backwards."""
    reference = _reference()
    disk = dict(offload_optimizer="disk", nvme_path=str(tmp_path), buffer_size=PIECE) if on_disk else {}

    def build(in_backward):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float16, chunk_size=CHUNK_BYTES, **(disk if in_backward else {}))
        return model, cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                            max_norm=0.5, step_in_backward=in_backward)

    pair = build(False), build(True)
    data = batches(6)
    for model, optim in pair:
        for k in range(0, 6, 3):
            with optim.accumulating():
                for x in data[k:k + 2]:
                    optim.backward(lm_loss(model(x), x))
                assert optim.backward_updates == 0
            optim.backward(lm_loss(model(data[k + 2]), data[k + 2]))
            assert optim.step()
            optim.zero_grad()
    _same(*pair)
    model, optim = pair[1]
    x = data[0]
    optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.GradientAccumulationError, match="optim.accumulating"):
        optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.InvalidArgumentError, match="nested"):
        with optim.accumulating(), optim.accumulating():
            pass


def test_engine_accumulation_with_step_in_backward_is_bitwise_the_plain_engine():
    def run(in_backward):
        torch.manual_seed(0)
        module = TinyGPT()
        config = {"zero": {"model_config": {"tensor_placement_policy": "cpu", "dtype": "bf16"},
                           "optimizer_config": {"step_in_backward": in_backward}}}
        engine, *_ = cm.initialize_engine(module, cm.HybridAdam(module.parameters(), lr=1e-2), config=config)
        for n, x in enumerate(batches(4)):
            engine.set_gradient_accumulation_boundary(n % 2 == 1)
            engine.backward(lm_loss(engine(x), x))
            engine.step()
        return engine.sharded_model, engine.optimizer

    _same(run(False), run(True))


@pytest.mark.parametrize("policy, offload_param", PLACES)
def test_writes_between_the_backward_and_the_step_are_refused_and_change_nothing(tmp_path, policy, offload_param):
    """The setters of chunkmem.utils, ``model.load_state_dict``, ``GatheredParameters(modifier_rank=0)`` and an
    in-place write on an fp32 parameter, between a backward that started the step's updates and ``step()``, are
    refused: ``step()`` keeps the updates (computed from the values before the write) or puts back the values
    from before the backward, so the write would be lost or overwritten. Before 2026-11-28 they were accepted
    and the step then silently trained differently from the same loop without ``step_in_backward``. After
    ``step()`` they work; the training is bitwise the plain step's."""
    from chunkmem import utils
    data = batches(3)
    pair = _pair(_reference(), tmp_path, torch.float32, policy, offload_param, max_norm=0.05)
    if offload_param is None:  # the state in memory: the step in the backward without the disk tier
        model = cm.ShardedModelV2(copy.deepcopy(_reference()), cm.TensorShardStrategy(),
                                  tensor_placement_policy=policy, dtype=torch.float32, chunk_size=CHUNK_BYTES)
        pair = (pair[0], (model, cm.ShardedOptimizerV2(
            model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01), max_norm=0.05,
            step_in_backward=True)))
    (model, optim), earlier = pair[1], pair[1][0].state_dict()
    params = list(model.module.parameters())
    writes = [lambda: utils.safe_set_full_fp32_param(params[0], torch.zeros(params[0].shape)),
              lambda: utils.safe_set_full_optimizer_state(params[0], torch.zeros(params[0].shape), "exp_avg"),
              lambda: model.load_state_dict(earlier),
              lambda: cm.GatheredParameters(params[:1], modifier_rank=0).__enter__(),
              lambda: params[1].data.mul_(2.0)]
    for step, x in enumerate(data):
        for m, o in pair:
            o.backward(lm_loss(m(x), x))
        assert optim.backward_updates > 0
        for write in writes if step > 0 else writes[2:]:  # no optimizer state before the first step
            with pytest.raises(cm.UnsupportedOperationError, match="call optim.step"):
                write()
        for m, o in pair:
            o.step()
            o.zero_grad()
    _same(*pair)
    utils.safe_set_full_fp32_param(params[0], torch.zeros(params[0].shape))  # after the step: allowed
    assert torch.equal(utils.safe_get_full_fp32_param(params[0]), torch.zeros(params[0].shape))


@pytest.mark.parametrize("policy, offload_param", [("cpu", None), ("cpu", "disk")])
def test_model_state_dict_between_the_backward_and_the_step_is_refused(tmp_path, policy, offload_param):
    """Between a backward that started the step's updates and ``step()``, the parameters hold those speculative
    updates; with clipping that triggers (here) ``step()`` puts them back and updates again, so a
    ``model.state_dict()`` taken then would hold values the model never has. It is refused, nothing changed, as
    ``optim.state_dict()`` is (before 2026-11-28 it returned them); after ``step()`` it is the plain step's."""
    data = batches(2)
    if offload_param is None:
        pair = _pair_in_memory(_reference(), torch.float32, policy, max_norm=0.05)
    else:
        pair = _pair(_reference(), tmp_path, torch.float32, policy, offload_param, max_norm=0.05)
    (model, optim) = pair[1]
    for x in data:
        for m, o in pair:
            o.backward(lm_loss(m(x), x))
        assert optim.backward_updates > 0
        for read in (model.state_dict, lambda: model.state_dict(trainable_only=True), optim.state_dict):
            with pytest.raises(cm.UnsupportedOperationError, match=r"state_dict\(\) between a backward"):
                read()
        for m, o in pair:
            o.step()
            o.zero_grad()
        assert optim.kept_backward_updates == 0  # the clipping triggered: every update was redone
    _same(*pair)
