"""Quantized parameter gathers (``quantized_weights``, ZeRO++'s qwZ), 2 gloo ranks: modules compute with
the dequantized values (within half a block's scale of the exact ones), everything else stays exact
(shards, masters, ``state_dict``, ``GatheredParameters`` reads and writes), and training stays within the
documented distance of the exact run."""
from __future__ import annotations

import pytest
import torch

import chunkmem as cm
from chunkmem.distributed import quantization as q
from distributed import run_ranks
from models import TinyGPT, batches, train

STEPS = 30


def _build(quantized, dtype=torch.float32, reuse=False, freeze=False):
    torch.manual_seed(0)
    net = TinyGPT()
    if freeze:
        for p in net.blocks.parameters():
            p.requires_grad_(False)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              quantized_weights=quantized, reuse_fp16_shard=reuse)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                                  initial_scale=2**10)
    return model, optim


def _run(rank: int, world: int) -> dict:
    data = [x[2 * rank:2 * rank + 2] for x in batches(STEPS, batch=4, seed=2)]
    out = {}
    for quantized in (False, True):
        model, optim = _build(quantized)
        out[quantized] = {"losses": train(model, optim, data)}
        x = data[0]
        with torch.no_grad():
            out[quantized]["logits"] = model(x)
        model.runtime.executor.fetch(model.chunks)  # compute fetches: dequantized copies stay resident
        out[quantized]["approximate"] = [c.param.approximate for c in model.chunks]
        exact_params = model.state_dict()
        names = [n for n, _ in model.module.named_parameters()]
        params = list(model.module.parameters())
        with cm.GatheredParameters(params):
            read = {n: p.detach().clone() for n, p in zip(names, params)}
        with cm.GatheredParameters(params[:1], modifier_rank=0), torch.no_grad():
            if rank == 0:
                params[0].add_(1.0)
        out[quantized].update(state=exact_params, read=read, after_write=model.state_dict())
    # the forward's values: each within half a block's scale of the exact shard values
    model, _ = _build(True)
    chunk = model.chunks[0]
    model.runtime.executor.fetch([chunk])  # a compute fetch: dequantized
    approximate = chunk.param.device.clone()
    exact = chunk.gather(chunk.param.local())
    bound = q.quantize(exact.view(2, -1))[1].div(2).repeat_interleave(q.BLOCK, dim=1)[:, :exact.numel() // 2]
    out["within_bound"] = bool(torch.all((approximate - exact).abs().view(2, -1) <= bound * (1 + 1e-6)))
    out["differs"] = not torch.equal(approximate, exact)
    # frozen chunks only, and 16-bit with gradients in the parameters' memory
    frozen, frozen_optim = _build("nontrainable", freeze=True)
    out["nontrainable"] = [c.param.gather.quantized for c in frozen.chunks], [c.trainable for c in frozen.chunks]
    out["frozen_losses"] = train(frozen, frozen_optim, data[:3])
    half, half_optim = _build(True, dtype=torch.bfloat16, reuse=True)
    out["reuse_losses"] = train(half, half_optim, data[:3])
    out["reuse_state"] = half.state_dict()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_run, 2)


def test_compute_values_are_dequantized_within_the_bound(ranks):
    for r in ranks:
        assert r["within_bound"] and r["differs"]
        assert not torch.equal(r[True]["logits"], r[False]["logits"])


def test_state_dict_and_gathered_parameters_stay_exact(ranks):
    for r in ranks:
        result = r[True]
        assert all(result["approximate"]) and not any(r[False]["approximate"])
        for name, value in result["read"].items():  # read where dequantized copies were resident
            assert torch.equal(value, result["state"][name].to(value.dtype)), name
        first = next(iter(result["read"]))
        for name, value in result["after_write"].items():
            tied = torch.equal(result["state"][name], result["state"][first])  # the tied lm head too
            if not tied:
                assert torch.equal(value, result["state"][name]), name  # untouched values kept every bit
        assert torch.equal(result["after_write"][first], result["state"][first] + 1.0)
    assert all(torch.equal(ranks[0][True]["after_write"][k], v) for k, v in ranks[1][True]["after_write"].items())


def test_quantized_training_stays_near_the_exact_run(ranks):
    exact = torch.tensor([r[False]["losses"] for r in ranks]).mean(0)
    quantized = torch.tensor([r[True]["losses"] for r in ranks]).mean(0)
    assert quantized[-1] < exact[0] - 0.5
    assert (quantized - exact).abs().max() < 0.02 * exact.max()  # the documented distance (docs/guides/several-processes.md)


def test_nontrainable_and_reuse_fp16_shard(ranks):
    quantized, trainable = ranks[0]["nontrainable"]
    assert quantized == [not t for t in trainable] and any(quantized) and not all(quantized)
    for r in ranks:
        assert all(torch.isfinite(torch.tensor(r["frozen_losses"] + r["reuse_losses"])))
    for key, value in ranks[0]["reuse_state"].items():
        assert torch.equal(value, ranks[1]["reuse_state"][key]), key


def test_quantized_weights_argument_is_checked():
    for value, error in (("yes", cm.InvalidArgumentError), (1, cm.InvalidArgumentError)):
        with pytest.raises(error, match="quantized_weights"):
            cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), quantized_weights=value)
    with pytest.raises(cm.InvalidArgumentError, match="quantized_weights=True.*BucketTensorShardStrategy"):
        cm.ShardedModelV2(TinyGPT(), cm.BucketTensorShardStrategy(), quantized_weights=True)
