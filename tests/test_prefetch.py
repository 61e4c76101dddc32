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


def run(prefetch: bool, data, record: bool):
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
        if record and i == len(data) - 1:
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
