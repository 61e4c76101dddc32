"""The state machines of issue #10: a chunk copy's life (CopyLife), what parameter memory holds
(Contents), a chunk's use count, the scheduler's IterationMode, and transfer handles. Each: every legal
transition, and an illegal one raising the internal ChunkStateError (chunk, state, allowed states, rank)."""
import dataclasses

import pytest
import torch

import chunkmem as cm
from chunkmem.core.chunk import Chunk, ChunkKey, FlatBuffer, ParamBuffer
from chunkmem.core.ledger import TierLedger
from chunkmem.core.memory import TierMemory
from chunkmem.runtime.placement import AutoPlacement, HostPlacement, PlacementState
from chunkmem.runtime.schedule import IterationMode, Scheduler
from chunkmem.core.states import ChunkStateError, Contents, CopyLife, CopyState
from chunkmem.core.tiers import Tier
from chunkmem.core.copy_engine import start_copy
from chunkmem.distributed.collectives import ShardGroup
from chunkmem.core.transfer import PinnedStagingPool, Transfer

S = CopyState


def life_in(state: CopyState) -> CopyLife:
    """A CopyLife brought to ``state`` through legal transitions."""
    life = CopyLife("chunk7.param device copy", rank=0)
    path = {S.FREED: [], S.STALE: ["allocated"], S.FETCHING: ["allocated", "fill_started"],
            S.CURRENT: ["allocated", "written"]}[state]
    for step in path:
        getattr(life, step)()
    assert life.state is state
    return life


LEGAL = [
    (S.FREED, "allocated", S.STALE),
    (S.STALE, "fill_started", S.FETCHING),
    (S.FETCHING, "fill_finished", S.CURRENT),
    (S.STALE, "written", S.CURRENT),
    (S.CURRENT, "written", S.CURRENT),
    (S.CURRENT, "outdated", S.STALE),
    (S.STALE, "freed", S.FREED),
    (S.CURRENT, "freed", S.FREED),
]


@pytest.mark.parametrize("start,transition,end", LEGAL)
def test_copy_life_legal_transitions(start, transition, end):
    life = life_in(start)
    getattr(life, transition)()
    assert life.state is end
    assert life.holds_memory == (end is not S.FREED)
    assert life.current == (end is S.CURRENT)


ILLEGAL = [(start, t) for start in S for t in ("allocated", "fill_started", "fill_finished", "written", "outdated",
                                                "freed")
           if (start, t) not in {(a, b) for a, b, _ in LEGAL}]


@pytest.mark.parametrize("start,transition", ILLEGAL)
def test_copy_life_illegal_transitions_raise_the_internal_error(start, transition):
    life = life_in(start)
    with pytest.raises(ChunkStateError) as info:
        getattr(life, transition)()
    assert life.state is start  # nothing changed
    message = str(info.value)
    assert "chunk7.param device copy" in message and start.name in message and "rank 0" in message
    assert info.value.state is start and info.value.rank == 0 and start not in info.value.allowed
    assert isinstance(info.value, cm.ChunkmemError) and isinstance(info.value, RuntimeError)


def test_illegal_transition_message_names_allowed_states():
    with pytest.raises(ChunkStateError, match=r"internal error on rank 3: c\.grad is FREED; be written needs one "
                                              r"of CURRENT, STALE"):
        CopyLife("c.grad", rank=3).written()


def make_chunk(numel: int = 8) -> Chunk:
    ledger = TierLedger(capacity=10**6)
    chunk = Chunk(0, numel, torch.float32, ChunkKey(True), TierMemory(ledger))
    return chunk


def test_param_buffer_states_through_a_fetch_an_update_and_a_free():
    chunk = make_chunk()
    buf = chunk.param
    assert (buf.device_state, buf.shard_state) == (S.FREED, S.FREED)
    host = buf.first_copy(Tier.HOST)
    host.copy_(torch.arange(8.0))
    assert (buf.device_state, buf.shard_state) == (S.FREED, S.CURRENT)
    handle = buf.start_fetch()
    assert buf.device_state is S.FETCHING and buf.fetching and not buf.device_valid
    assert not handle.on_side_stream  # the CPU copy is done when issued; the state waits for wait()
    handle.wait()
    assert buf.device_state is S.CURRENT and buf.device_valid and torch.equal(buf.device, torch.arange(8.0))
    assert chunk.memory.ledger.tier_bytes(Tier.DEVICE) == 8 * 4
    buf.device.add_(1)
    buf.mark_device_written()  # the device copy changed: the shard is out of date
    assert (buf.device_state, buf.shard_state) == (S.CURRENT, S.STALE)
    buf.free_device()  # writes back first
    assert (buf.device_state, buf.shard_state) == (S.FREED, S.CURRENT)
    assert torch.equal(buf.shard.tensor, torch.arange(8.0) + 1)
    assert chunk.memory.ledger.tier_bytes(Tier.DEVICE) == 0
    with pytest.raises(ChunkStateError, match="chunk0.param device copy is FREED; be written back"):
        buf.write_back_shard()
    buf.start_fetch()
    with pytest.raises(ChunkStateError, match="FETCHING; be fetched needs one of FREED, STALE"):
        buf.start_fetch()
    buf.free_device()  # a copy in flight is waited on, then freed
    assert buf.device_state is S.FREED


def test_replicated_resident_param_buffer_is_whole_current_and_never_freed():
    """ZeRO-1/2's working chunk: whole on the device given, zero, counted once, this rank's shard a view."""
    memory = TierMemory(TierLedger(capacity=10**6))
    buf = ParamBuffer.replicated_resident(8, torch.float16, memory, "flat chunk 3", ShardGroup(None, 1, 2),
                                          torch.device("cpu"))
    assert (buf.device_state, buf.shard_state) == (S.CURRENT, S.FREED) and buf.gather is None
    assert buf.device.device == torch.device("cpu") and torch.equal(buf.device, torch.zeros(8, dtype=torch.float16))
    assert memory.breakdown() == {"device": {"param": 8 * 2}, "host": {}}
    own = buf.local()
    assert own.data_ptr() == buf.device.data_ptr() + 4 * 2 and own.numel() == 4  # rank 1's half, a view
    with pytest.raises(ChunkStateError, match="flat chunk 3.param device copy is CURRENT; be freed "
                                              r"\(replicated-resident"):
        buf.free_device()
    assert buf.device_state is S.CURRENT and memory.ledger.tier_bytes(Tier.DEVICE) == 8 * 2


def test_a_flat_buffer_fixed_to_a_device_is_counted_on_its_tier_and_never_moved():
    """ZeRO-1/2's masters and state: allocated on the device given, counted on the tier named."""
    memory = TierMemory(TierLedger(capacity=10**6))
    buf = FlatBuffer("exp_avg", 4, torch.float32, memory, "flat chunk 0", device=torch.device("cpu"))
    assert torch.equal(buf.allocate(Tier.HOST, zero=True), torch.zeros(4)) and buf.state is S.CURRENT
    assert memory.breakdown() == {"device": {}, "host": {"exp_avg": 16}}
    with pytest.raises(ValueError, match="flat chunk 0.exp_avg is kept on cpu, not moved between tiers"):
        buf.move_to(Tier.DEVICE)
    buf.free()
    assert memory.breakdown() == {"device": {}, "host": {}}


def test_contents_values_to_grads_and_back():
    chunk = make_chunk()
    buf = chunk.param
    buf.first_copy(Tier.HOST).zero_()
    buf.fetch_to_device()
    assert buf.contents is Contents.VALUES and not buf.holds_grads
    buf.grads_in_device_copy()
    assert buf.contents is Contents.GRADS and buf.holds_grads and buf.shard_state is S.STALE
    with pytest.raises(ChunkStateError, match=r"chunk0.param memory is GRADS; take gradients needs one of VALUES"):
        buf.grads_in_device_copy()
    buf.updated_on(Tier.HOST, keep_device_copy=False)
    assert buf.contents is Contents.VALUES
    assert (buf.device_state, buf.shard_state) == (S.FREED, S.CURRENT)


def test_chunk_use_count_cannot_go_below_zero():
    chunk = make_chunk()
    chunk.add_user()
    chunk.hold()
    assert chunk.users == 1 and chunk.held_for_backward and chunk.in_use
    chunk.remove_user()
    chunk.unhold()
    assert not chunk.in_use
    with pytest.raises(ChunkStateError, match="chunk0 use count is UNUSED; lose a user"):
        chunk.remove_user()


def scheduler(policy=None) -> Scheduler:
    return Scheduler(TierLedger(capacity=10**6), policy or HostPlacement(), PlacementState(), torch.device("cpu"))


def test_iteration_mode_transitions():
    s = scheduler()
    assert s.mode is IterationMode.IDLE and s.mode == "idle"
    s.begin_iteration(("shape",), training=False)
    assert s.mode is IterationMode.UNTRACED
    s.begin_iteration(("shape",), training=True)
    assert s.mode is IterationMode.TRACING
    s.begin_period("m", "forward", [0], list)
    s.need(0)
    assert s.end_iteration() is True and s.mode is IterationMode.IDLE
    s.close_finished_traces()
    s.begin_iteration(("shape",), training=True)
    assert s.mode is IterationMode.FOLLOWING
    s.begin_period("m", "forward", [0], list)
    assert s.end_iteration() is False and s.mode is IterationMode.IDLE
    s.begin_iteration(("shape",), training=True)
    s.begin_iteration(("shape",), training=True)  # a forward without backward: its schedule stays valid
    assert s.mode is IterationMode.FOLLOWING and s.traces == 1
    s.begin_period("m", "forward", [0], list)
    s.end_iteration()
    s.begin_iteration(("shape",), training=True)
    s.begin_period("other", "forward", [0], list)  # not in the schedule
    assert s.mode is IterationMode.DIVERGED
    s.end_iteration()
    assert s.mode is IterationMode.IDLE
    s.begin_iteration(("shape",), training=True)  # retraced after the divergence
    assert s.mode is IterationMode.TRACING
    s.begin_iteration(("shape",), training=True)  # the last one never ended: interrupted, traced again
    assert s.mode is IterationMode.TRACING and s.traces == 3
    s.interrupt()
    assert s.mode is IterationMode.INTERRUPTED
    s.close_finished_traces()


def test_iteration_mode_illegal_transition_raises():
    s = scheduler()
    with pytest.raises(ChunkStateError, match="the iteration scheduler is IDLE; enter DIVERGED needs one of FOLLOWING"):
        s.diverge()
    with pytest.raises(ChunkStateError, match="is IDLE; enter INTERRUPTED"):
        s.interrupt()
    assert s.mode is IterationMode.IDLE


def test_auto_policy_is_a_frozen_value_that_reads_the_plan_state_it_is_given():
    policy = AutoPlacement()
    s = scheduler(policy)
    assert not hasattr(policy, "plan") and s.state.moves is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.params_on_disk = True  # a policy never changes once chosen
    chunk = make_chunk()
    state = PlacementState(num_chunks=1, trainable=(0,))
    assert policy.param_rest_tier(chunk, state) is Tier.HOST  # no plan yet: evicted after use, as under cpu
    state.following = True
    assert policy.param_rest_tier(chunk, state) is None  # following a plan: the plan decides
    state.adopt_moves(None, {0}, 1)
    assert policy.param_rest_tier(chunk, state) is Tier.DEVICE and policy.compute_tier(chunk, state) is Tier.DEVICE


def test_transfer_handle_runs_its_completion_once():
    done = []
    dst, src = torch.zeros(4), torch.arange(4.0)
    handle = start_copy(dst, src, lambda: done.append(1))
    assert torch.equal(dst, src) and not handle.waited and done == []
    handle.wait()
    handle.wait()
    assert handle.waited and done == [1]
    assert Transfer(lambda: None).event is None


def test_pinned_pool_rejects_a_zero_bound():
    with pytest.raises(ValueError, match="max_buffers=0"):
        PinnedStagingPool(0)
