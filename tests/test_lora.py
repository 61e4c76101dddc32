"""LoRA (PEFT) on an offloaded base (skipped without peft): a Llama-style model built from a config with a PEFT
LoRA adapter, the frozen base in chunks resting on the host or on the disk tier, against plain PEFT training;
the bytes each tier holds; 2 ranks; the adapter saved alone with ``save_pretrained``; a base built in
``ZeroInitContext`` (onto the disk too) with the adapters added afterwards."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import chunkmem as cm
from chunkmem.core.disk_tier import DEFAULT_BUFFER_SIZE
from chunkmem.distributed.traffic import reset_traffic, traffic
from distributed import run_ranks
from models import resting_tier_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, STEPS, LR = 128, 32, 4, 1e-2


def _config(**overrides):
    return transformers.LlamaConfig(**{**dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                              num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                              max_position_embeddings=SEQ), **overrides})


def _add_lora(base):
    """LoRA on the attention's q and v projections; B drawn too (PEFT starts it at zero, which would leave
    A without a gradient in the first step)."""
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def _lora_llama(**overrides):
    torch.manual_seed(0)
    return _add_lora(transformers.LlamaForCausalLM(_config(**overrides)))


def _batch(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(2))


def _adapter(state) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items() if "lora_" in k}


def _plain_peft(reference, batches):
    """Plain PEFT: torch's AdamW over the parameters that require grad, the mean loss of ``batches``."""
    optim = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        loss = sum(reference(input_ids=b, labels=b)["loss"] for b in batches) / len(batches)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _wrap(module, dtype, where, directory):
    return cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                             offload_param="disk" if where == "disk" else None,
                             nvme_path=str(directory) if where == "disk" else None)


def _train(model, batch):
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=0.0))
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=batch, labels=batch)["loss"]
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return optim, losses


@pytest.mark.parametrize("where", ["host", "disk"])
def test_fp32_trains_like_plain_peft_and_leaves_the_base_alone(where, tmp_path):
    reference = _lora_llama()
    base_before = {k: v.clone() for k, v in reference.state_dict().items() if "lora_" not in k}
    model = _wrap(copy.deepcopy(reference), torch.float32, where, tmp_path)
    _, losses = _train(model, _batch())
    expected = _plain_peft(reference, [_batch()])
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    state = model.state_dict()
    theirs = _adapter(reference.state_dict())
    assert set(_adapter(state)) == set(theirs) and len(theirs) == 8
    for key, value in theirs.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    for key, value in base_before.items():
        assert torch.equal(state[key], value), key


def _relative_distance(ours, theirs, start) -> float:
    """``|ours - theirs| / |theirs - start|`` over all adapter tensors: how far apart two runs ended, as a
    fraction of how far training moved the adapters."""
    apart = sum(((ours[k] - theirs[k]) ** 2).sum() for k in theirs).sqrt()
    moved = sum(((theirs[k] - start[k]) ** 2).sum() for k in theirs).sqrt()
    return (apart / moved).item()


@pytest.mark.parametrize("where", ["host", "disk"])
def test_bf16_base_with_fp32_adapter_masters_is_within_mixed_precision_noise_of_plain_peft(where, tmp_path):
    fp32 = _lora_llama()
    start = _adapter(fp32.state_dict())
    reference = copy.deepcopy(fp32)
    for param in reference.parameters():  # plain PEFT with a bf16 base: its adapters stay fp32
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    model = _wrap(copy.deepcopy(fp32), torch.bfloat16, where, tmp_path)
    _, losses = _train(model, _batch())
    expected = _plain_peft(reference, [_batch()])
    torch.testing.assert_close(losses, expected, rtol=2e-4, atol=0)
    plain_fp32 = copy.deepcopy(fp32)
    _plain_peft(plain_fp32, [_batch()])
    state = model.state_dict()
    ours = {k: state[k] for k in start}
    assert all(v.dtype == torch.float32 for v in ours.values())  # from the fp32 masters
    theirs = _adapter(reference.state_dict())
    # the noise scale: how far a bf16 base moves plain PEFT itself from its fp32 run (4.6% here)
    noise = _relative_distance(theirs, _adapter(plain_fp32.state_dict()), start)
    assert _relative_distance(ours, theirs, start) <= 1.5 * noise  # 3.8% here


@pytest.mark.parametrize("where", ["host", "disk"])
def test_bytes_per_tier_base_two_bytes_a_parameter_no_gradient_or_optimizer_state(where, tmp_path):
    model = _wrap(_lora_llama(), torch.bfloat16, where, tmp_path)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR))
    layout = model.layout
    frozen = sum(n for i, n in enumerate(layout.numels) if not layout.trainable(i))
    trainable = sum(n for i, n in enumerate(layout.numels) if layout.trainable(i))
    base = sum(p.numel() for p in model.module.parameters() if not p.requires_grad)
    adapter = sum(p.numel() for p in model.module.parameters() if p.requires_grad)
    assert base <= frozen < base + 64 and adapter <= trainable < adapter + 64  # a tail rounded to 64 elements
    params = {"param": 2 * (frozen + trainable)}
    host = {"master": 4 * trainable, "exp_avg": 4 * trainable, "exp_avg_sq": 4 * trainable}

    def expected(io_buffers):
        if where == "host":
            return {"device": {}, "host": {**host, **params}}
        return {"device": {}, "host": {**host, "disk_io": io_buffers * DEFAULT_BUFFER_SIZE}, "disk": params}

    # the disk tier's I/O buffers: the one buffer of whole-region writes (the base written at the wrap), then
    # also the fetch thread's buffer
    assert model.tier_bytes() == expected(1)
    batch = _batch()
    optim.backward(model(input_ids=batch, labels=batch)["loss"])
    after_backward = model.tier_bytes()
    assert after_backward["host"].get("grad") == 2 * trainable  # the adapters' gradients only
    optim.step()
    optim.zero_grad()
    assert resting_tier_bytes(model) == expected(2)


def _built_in_context(nvme_path=None):
    """The base built in a ``ZeroInitContext`` (sharded over the ranks; onto the disk with ``nvme_path``),
    the adapters added afterwards: the values of :func:`_lora_llama`."""
    torch.manual_seed(0)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=torch.float32, nvme_path=nvme_path):
        base = transformers.LlamaForCausalLM(_config())
    return _add_lora(base)


def _two_rank_worker(rank, world, where, directory):
    scratch = os.path.join(directory, f"rank{rank}")
    os.makedirs(os.path.join(scratch, "init"))
    # on the host: built as plain PyTorch; on the disk: built onto the disk in a context sharded over the ranks
    module = _lora_llama() if where == "host" else _built_in_context(os.path.join(scratch, "init"))
    model = _wrap(module, torch.float32, where, scratch)
    reset_traffic()
    _, losses = _train(model, _batch(2 * world)[2 * rank:2 * rank + 2])
    gradient_bytes = sum(c.buffer_bytes for (what, _, _), c in traffic().items() if what == "gradients")
    trainable = sum(n for i, n in enumerate(model.layout.numels) if model.layout.trainable(i))
    state = model.state_dict(rank0_only=True, trainable_only=True)
    if rank == 0:
        model.module.save_pretrained(os.path.join(directory, "adapter"), state_dict=state)
    return {"losses": losses, "gradient_bytes": gradient_bytes, "trainable": trainable, "keys": sorted(state),
            "tiers": resting_tier_bytes(model)}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "disk"])
def test_two_ranks_train_like_plain_peft_on_the_double_batch_and_save_the_adapter_alone(where, tmp_path):
    ranks = run_ranks(_two_rank_worker, 2, where, str(tmp_path))
    reference = _lora_llama()
    batch = _batch(4)
    expected = _plain_peft(reference, [batch[:2], batch[2:]])
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    torch.testing.assert_close(mean, expected, rtol=1e-5, atol=0)
    # only the adapters' chunk is reduced: 4 steps of its fp32 gradients, nothing of the frozen base
    assert ranks[0]["gradient_bytes"] == STEPS * 4 * ranks[0]["trainable"]
    assert ranks[0]["keys"] == sorted(k for k, p in reference.named_parameters() if p.requires_grad)
    assert ranks[1]["keys"] == []
    assert ranks[0]["tiers"] == ranks[1]["tiers"]  # each rank holds half of every chunk
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(_config()), str(tmp_path / "adapter"))
    ours, theirs = _adapter(loaded.state_dict()), _adapter(reference.state_dict())
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("context_disk", [False, True], ids=["context-host", "context-disk"])
def test_a_base_built_in_zero_init_context_takes_adapters_added_afterwards(context_disk, tmp_path):
    for scratch in ("init", "model"):
        os.makedirs(tmp_path / scratch)
    module = _built_in_context(str(tmp_path / "init") if context_disk else None)
    model = _wrap(module, torch.float32, "disk" if context_disk else "host", tmp_path / "model")
    assert [c.trainable for c in model.chunks] == [False, True]  # re-packed: the base frozen, the adapters apart
    _, losses = _train(model, _batch())
    reference = _lora_llama()  # the same values: the context initialises each module as plain PyTorch does
    expected = _plain_peft(reference, [_batch()])
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    state = model.state_dict(trainable_only=True)
    assert set(state) == set(_adapter(reference.state_dict()))
    for key, value in _adapter(reference.state_dict()).items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_trainable_only_is_checked():
    model = _wrap(_lora_llama(), torch.float32, "host", None)
    with pytest.raises(cm.ArgumentTypeError, match="trainable_only"):
        model.state_dict(trainable_only="yes")


@pytest.mark.parametrize("variant", ["plain", "checkpointed", "tied"])
def test_a_frozen_base_three_times_the_device_tier_trains_like_plain_peft(variant):
    """Frozen chunks leave the device as soon as every autograd node of their modules' forward ran (no
    gradient tells it): the base rests on the host and passes through a device tier a third of its size,
    with torch's gradient checkpointing (recomputed forwards) and with a tied (frozen) embedding and head."""
    overrides = {"num_hidden_layers": 6, "tie_word_embeddings": variant == "tied"}
    reference = _lora_llama(**overrides)
    if variant == "checkpointed":
        reference.gradient_checkpointing_enable()
    base_bytes = 4 * sum(p.numel() for p in reference.parameters() if not p.requires_grad)
    cm.set_device_memory_capacity(base_bytes // 3)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=64 * 1024)
    assert sum(not c.trainable for c in model.chunks) >= 6
    _, losses = _train(model, _batch())
    expected = _plain_peft(reference, [_batch()])
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    state = model.state_dict(trainable_only=True)
    for key, value in _adapter(reference.state_dict()).items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    assert not [c.index for c in model.chunks if c.users or c.held_for_backward]


def test_the_example_fine_tunes_a_base_larger_than_the_device_tier(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "finetune_lora.py")
    spec = importlib.util.spec_from_file_location("finetune_lora", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tiny = ["--layers", "4", "--hidden", "64", "--intermediate", "128", "--vocab", "256", "--seq-len", "16", "--lora-rank", "2",
            "--data-vocab", "16", "--steps", "12", "--chunk-size", str(32 * 1024), "--quiet"]
    result = example.main(tiny + ["--base-on", "disk", "--save", str(tmp_path / "adapter")])
    assert result["base_bytes"] > 2 * result["device_capacity"]
    assert sum(result["losses"][-3:]) < sum(result["losses"][:3]) - 0.1
    assert set(result["tier_bytes"]["disk"]) == {"param"}  # the base (and the adapters' 16-bit copies) on disk
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(_config(
        num_hidden_layers=4, intermediate_size=128, vocab_size=256, max_position_embeddings=16)), str(tmp_path / "adapter"))
    ours = result["model"].state_dict(trainable_only=True)
    theirs = _adapter(loaded.state_dict())
    assert set(theirs) == set(ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
