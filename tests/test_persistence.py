"""Persistent parameters (ShardedModelV2's persistence_threshold, DeepSpeed's
stage3_param_persistence_threshold): small parameters stay whole on every rank in chunks of their own,
never gathered, their gradients all-reduced. Against the same two ranks without persistence (the same
values) and one process with the double batch, with clipping (the global norm counts a replicated chunk
once), under cpu and cuda placement and fp16; collectives counted; checkpoints both formats."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss

THRESHOLD = 200  # elements: the layer norms and biases (32 and 128 elements) persist, the matrices do not
CHUNK = 16384  # bytes (fp32): the largest parameter, 4096 elements


def _build(reference, threshold, policy, dtype, **extra):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              dtype=dtype, chunk_size=CHUNK * dtype.itemsize // 4, persistence_threshold=threshold,
                              **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**8, max_norm=0.05)
    return model, optim


def _worker(rank: int, world: int, policy: str, dtype: torch.dtype, path: str) -> dict:
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, batch=4, seed=3)
    out = {}
    for threshold in (0, THRESHOLD):
        model, optim = _build(reference, threshold, policy, dtype)
        executor, reduction = model.runtime.executor, model.runtime.reduction
        for x in data:
            gathers, reduced = executor.gathers, reduction.collectives
            part = x[2 * rank:2 * rank + 2]
            optim.backward(lm_loss(model(part), part))
            optim.step()
        replicated = [c for c in model.chunks if c.replicas is not None]
        out[threshold] = {
            "state": model.state_dict(), "optim": optim.state_dict(),
            "collectives": executor.gathers - gathers + reduction.collectives - reduced,
            "replicated": [sorted(s.name for s in c.slots) for c in replicated],
            "bytes": model.tier_bytes(),
        }
        if threshold:
            cm.save_checkpoint(f"{path}/sharded", model, optim, sharded=True)
            cm.save_checkpoint(f"{path}/full.pt", model, optim)
            again, again_optim = _build(reference, threshold, policy, dtype)
            cm.load_checkpoint(f"{path}/sharded", again, again_optim)
            out["resumed"] = again.state_dict()
    return out


@pytest.mark.parametrize("policy,dtype", [("cpu", torch.float32), ("cuda", torch.float16)], ids=str)
def test_persistent_parameters_train_as_sharded_ones_with_fewer_collectives(tmp_path, policy, dtype):
    ranks = run_ranks(_worker, 2, policy, dtype, str(tmp_path))
    for out in ranks:
        assert out[0]["replicated"] == []
        persisted = sorted(name for names in out[THRESHOLD]["replicated"] for name in names)
        assert persisted == sorted(n for n, p in TinyGPT().named_parameters() if p.numel() < THRESHOLD)
        # the same values with and without persistence, but for the clipping's norm, summed in another order
        # (one fp16 ulp where the masters' rounding flips)
        rtol, atol = (1e-6, 1e-7) if dtype == torch.float32 else (1e-3, 1e-5)
        for name, value in out[0]["state"].items():
            torch.testing.assert_close(out[THRESHOLD]["state"][name], value, rtol=rtol, atol=atol, msg=name)
        for index, entry in out[0]["optim"]["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(out[THRESHOLD]["optim"]["state"][index][key], value, rtol=100 * rtol,
                                           atol=atol, msg=f"{index} {key}")
        assert out[THRESHOLD]["collectives"] < out[0]["collectives"]
        for name, value in out["resumed"].items():
            assert torch.equal(value, out[THRESHOLD]["state"][name]), name
    for name, value in ranks[0][THRESHOLD]["state"].items():  # the ranks hold the same model
        assert torch.equal(value, ranks[1][THRESHOLD]["state"][name]), name
    consolidated = cm.consolidate_checkpoint(tmp_path / "sharded")
    for name, value in consolidated["model"].items():
        assert torch.equal(value, ranks[0][THRESHOLD]["state"][name].float()), name
    if dtype == torch.float32:  # one process with the double batch: plain clipping over the whole gradient
        torch.manual_seed(0)
        reference = TinyGPT()
        plain = copy.deepcopy(reference)
        optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
        for x in batches(4, batch=4, seed=3):
            lm_loss(plain(x), x).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            optim.step()
            optim.zero_grad()
        for name, p in plain.named_parameters():
            torch.testing.assert_close(ranks[0][THRESHOLD]["state"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_bad_persistence_arguments_are_refused(tmp_path):
    with pytest.raises(cm.InvalidArgumentError, match="^persistence_threshold=-1"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), persistence_threshold=-1)
    with pytest.raises(cm.InvalidArgumentError, match="^persistence_threshold=10 .*disk tier"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", persistence_threshold=10,
                          offload_optimizer="disk", nvme_path=str(tmp_path))
    one = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), dtype=torch.float32, persistence_threshold=10**6)
    assert not one.layout.replicated  # one process: every chunk is whole already


def _context_worker(rank: int, world: int) -> list[dict]:
    """The same model built plainly and in a sharded ZeroInitContext (its chunks re-packed into persistent
    and sharded ones), trained alike."""
    states = []
    for in_context in (False, True):
        torch.manual_seed(0)
        if in_context:
            with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), shard_param=True,
                                    dtype=torch.float32):
                module = TinyGPT()
        else:
            module = TinyGPT()
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32 if not in_context else None, chunk_size=CHUNK,
                                  persistence_threshold=THRESHOLD)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
        for x in batches(2, batch=4, seed=4):
            part = x[2 * rank:2 * rank + 2]
            optim.backward(lm_loss(model(part), part))
            optim.step()
        states.append({"state": model.state_dict(), "replicated": sum(c.replicas is not None for c in model.chunks)})
    return states


def test_a_model_built_in_a_sharded_context_is_repacked_with_its_persistent_chunks():
    for plain, from_context in run_ranks(_context_worker, 2):
        assert plain["replicated"] == from_context["replicated"] == 1
        for name, value in plain["state"].items():
            assert torch.equal(value, from_context["state"][name]), name


def _modify_on_rank0(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              persistence_threshold=100)
    bias, weight = model.module.ln_f.bias, model.module.side.weight  # a persistent parameter and a sharded one
    with cm.GatheredParameters([bias, weight], modifier_rank=0), torch.no_grad():
        if rank == 0:
            bias.add_(1.0)
            weight.add_(1.0)
    return model.state_dict()


def test_gathered_parameters_modifier_rank_reaches_persistent_chunks_on_every_rank():
    """Regression: a replicated (persistent) chunk's new values stayed on the modifier rank only."""
    ranks = run_ranks(_modify_on_rank0, 2)
    for key in ("ln_f.bias", "side.weight"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert torch.equal(ranks[1]["ln_f.bias"], torch.ones(32))  # LayerNorm's zero bias, plus one
