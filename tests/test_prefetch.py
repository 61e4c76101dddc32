"""Prefetch (issue #10): on an iteration that follows its recorded schedule, the next chunks the schedule
needs (those of the first later period needing a chunk period k does not) are fetched (the transfer issued)
before period k computes, and results are bitwise those without prefetch.
The model is the 49M-parameter GPT of benchmarks/wrapper_overhead.py (--size 50m), batch 1 x 32 tokens."""
import gc
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import chunkmem as cm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _gpt  # noqa: E402

CFG = _gpt.GPTConfig(vocab=8192, d_model=768, layers=6, heads=12, seq=128)


def run(prefetch: bool, data, record: bool, record_at: int = -1):
    torch.manual_seed(0)
    net = _gpt.GPT(CFG)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01))
    runtime = model.runtime
    executor = runtime.executor
    executor.prefetch = prefetch
    names = {module: name or "root" for name, module in net.named_modules()}

    def computes(module, args):
        if executor.events is not None:
            executor.events.append(("compute", names[module]))

    for module in net.modules():
        module.register_forward_pre_hook(computes)  # after the wrapper's hooks: runs once chunks are fetched
    losses, events, moved = [], None, []
    for i, tokens in enumerate(data):
        if record and i == record_at % len(data):
            executor.events = []
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, CFG.vocab), y.reshape(-1))
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        moved.append(model.memory_stats()["totals"]["moved_to_device_bytes"])
    events, executor.events = executor.events, None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    periods = [(p.name, p.phase, list(p.needed)) for p in runtime.scheduler.periods]
    prefetched = executor.prefetched
    del model, optim, net, runtime, executor
    gc.collect()
    return losses, state, events, periods, prefetched, moved


def test_next_period_is_fetched_before_this_one_computes_and_results_are_unchanged():
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, CFG.vocab, (1, 33), generator=g) for _ in range(2)]
    losses, state, events, periods, prefetched, moved = run(True, data, record=True)
    ref_losses, ref_state, _, _, ref_prefetched, ref_moved = run(False, data, record=False)
    assert ref_prefetched == 0 and prefetched > 0
    assert losses == ref_losses
    for name, value in ref_state.items():
        assert torch.equal(value, state[name]), name
    assert moved == ref_moved  # the same bytes moved: every chunk fetched ahead was used

    # The order of events in the second (following) iteration.
    starts = [i for i, e in enumerate(events) if e[0] == "period"]
    assert len(starts) == len(periods)
    checked = 0
    for k in range(len(periods) - 1):
        name, phase, _ = periods[k]
        begin, end = starts[k], starts[k + 1]
        window = events[begin:end]
        ahead = [e[1] for e in window if e[0] == "fetch" and e[2] == "prefetch"]
        # nothing period k+1 needs is fetched on demand once period k+1 has begun
        next_end = starts[k + 2] if k + 2 < len(starts) else len(events)
        late = [e for e in events[end:next_end] if e[0] == "fetch" and e[2] == "demand" and e[1] in periods[k + 1][2]]
        assert late == [], (k, periods[k + 1], late)
        if phase == "forward" and ahead:
            computes = [i for i, e in enumerate(window) if e == ("compute", name)]
            first_prefetch = next(i for i, e in enumerate(window) if e[0] == "fetch" and e[2] == "prefetch")
            assert computes and first_prefetch < computes[0], (k, window)
            # the chunks of the first later period that needs a chunk period k does not (the next chunk's copy
            # overlaps the compute of every period until then)
            first_new = next(p[2] for p in periods[k + 1:] if set(p[2]) - set(periods[k][2]))
            assert set(ahead) <= set(first_new)
            checked += 1
    assert checked >= 6  # every block's forward, at least, overlapped the next one's fetch


def test_the_traced_iteration_fetches_the_next_chunk_in_packing_order_ahead():
    """The first iteration has no schedule yet: it guesses that the chunks are used in the order they were
    packed (the modules' order), forward and then backward in reverse, and fetches the next one ahead. In
    this GPT every guess is right: every chunk but the first of each phase arrives by prefetch, no byte more
    is moved than without prefetch, and the results are bitwise the same."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, CFG.vocab, (1, 33), generator=g)]
    losses, state, events, periods, prefetched, moved = run(True, data, record=True, record_at=0)
    ref_losses, ref_state, _, _, ref_prefetched, ref_moved = run(False, data, record=False)
    assert ref_prefetched == 0 and losses == ref_losses and moved == ref_moved
    for name, value in ref_state.items():
        assert torch.equal(value, state[name]), name
    phases, phase = {"forward": [], "backward": []}, None
    for event in events:
        if event[0] == "period":
            phase = event[3]
        elif event[0] == "fetch" and event[2] != "after step":  # (after the step: for the next iteration)
            phases[phase].append(event[1:])
    chunks = 1 + max(c for _, _, needed in periods for c in needed)
    assert chunks >= 4
    for phase, fetches in phases.items():
        first_use = {}
        for chunk, how in fetches:
            first_use.setdefault(chunk, how)
        # the tied head fetches the embedding's chunk again, on demand: it was used, so never guessed
        assert list(first_use.values()) == ["demand"] + ["prefetch"] * (len(first_use) - 1), (phase, fetches)
    assert len(phases["forward"]) == chunks + 1 and len(phases["backward"]) == chunks - 1


class _Interleaved(torch.nn.Module):
    """Six layers, one chunk each, used out of their packing order: the traced iteration guesses wrong."""

    ORDER = (0, 2, 4, 1, 3, 5)

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for i in self.ORDER:
            x = torch.tanh(self.layers[i](x))
        return x


def _interleaved_iteration(prefetch: bool, disk: dict):
    from chunkmem.core.tiers import Tier
    torch.manual_seed(0)
    model = cm.ShardedModelV2(_Interleaved(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=32 * 33 * 4, **disk)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
    model.runtime.executor.prefetch = prefetch
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    optim.backward(model(x).square().mean())
    device = (model.runtime.memory.ledger.tier_bytes(Tier.DEVICE), model.memory_stats()["totals"]["peak_device_bytes"])
    optim.step()
    return model.state_dict(), device, model.runtime.executor.prefetched, model.runtime.chunks


@pytest.mark.parametrize("rests", ["host", "disk"])
def test_a_wrong_guess_of_the_traced_iteration_costs_a_fetch_and_nothing_else(rests, tmp_path):
    def disk(name):
        (tmp_path / name).mkdir()
        return {} if rests == "host" else dict(offload_optimizer="disk", offload_param="disk",
                                               nvme_path=str(tmp_path / name), buffer_size=8192)
    state, device, prefetched, chunks = _interleaved_iteration(True, disk("a"))
    ref_state, ref_device, _, _ = _interleaved_iteration(False, disk("b"))
    assert len(chunks) == 6 and prefetched >= 3  # 1 after 0, 3 after 2, 5 after 4 ... in the forward
    # every guessed copy was freed at the next period boundary: at most one more chunk at a time
    assert device[0] == ref_device[0] and device[1] <= ref_device[1] + chunks[0].param.nbytes, (device, ref_device)
    for name, value in ref_state.items():
        assert torch.equal(value, state[name]), name


def _prefetches_per_period(prefetch_numel):
    from models import TinyGPT, batches, lm_loss
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=16384, prefetch_numel=prefetch_numel)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    executor = model.runtime.executor
    for i, x in enumerate(batches(3, seed=2)):
        executor.events = [] if i == 2 else None
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
    per_period, count = [], 0
    for event in executor.events:
        if event[0] == "period":
            per_period.append(count)
            count = 0
        elif event[0] == "fetch" and event[2] == "prefetch":
            count += 1
    return per_period + [count], model.state_dict(), model.layout.chunk_numel


def test_prefetch_numel_bounds_the_chunks_fetched_ahead_and_changes_no_result():
    free, state, chunk_numel = _prefetches_per_period(None)
    one, state_one, _ = _prefetches_per_period(chunk_numel + chunk_numel // 2)  # rounded down: one chunk
    none, state_none, _ = _prefetches_per_period(0)
    assert max(free) >= 2 and max(one) == 1 and sum(one) > 0 and sum(none) == 0
    for name, value in state.items():
        assert torch.equal(value, state_one[name]) and torch.equal(value, state_none[name]), name
    with pytest.raises(cm.InvalidArgumentError, match="^prefetch_numel=-1"):
        cm.ShardedModelV2(torch.nn.Linear(2, 2), cm.TensorShardStrategy(), prefetch_numel=-1)
