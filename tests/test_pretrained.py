"""Hugging Face from_pretrained into chunks and save_pretrained from chunks (skipped without transformers),
against transformers' own loading and plain PyTorch training."""
from __future__ import annotations

import json
import os
import weakref

import pytest
import torch

import chunkmem as cm

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from chunkmem.io import pretrained  # noqa: E402  (needs transformers)
from distributed import run_ranks  # noqa: E402


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MAKERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}


def _saved(make, directory, **kwargs):
    torch.manual_seed(0)
    plain = make()
    plain.save_pretrained(directory, **kwargs)
    return type(plain)


def _load(cls, directory, dtype=torch.float32, shard_param=False):
    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), shard_param=shard_param,
                            dtype=dtype, chunk_size=16384):
        return cls.from_pretrained(directory)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_load_equals_transformers_own_load(name, tmp_path):
    cls = _saved(MAKERS[name], tmp_path)
    reference = cls.from_pretrained(tmp_path)
    model = _load(cls, tmp_path)
    assert all(cm.ChunkParameter in type(p).__mro__ for p in model.parameters())
    assert not model.training  # eval mode, as transformers returns it
    wrapped = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    state = wrapped.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    # a 16-bit context keeps each value's rounding
    half = cm.ShardedModelV2(_load(cls, tmp_path, torch.float16), cm.TensorShardStrategy(),
                             tensor_placement_policy="cuda").state_dict()
    for key, value in reference.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(half[key], value.half().float()), key


def test_auto_class_and_sharded_index_load(tmp_path):
    _saved(_gpt2, tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / pretrained.INDEX_NAME)
    assert len(pretrained.checkpoint_files(str(tmp_path))) > 3, "the test needs several shard files"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = _load(transformers.AutoModelForCausalLM, tmp_path)
    assert type(model) is type(reference)
    state = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu").state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    # the patch is gone after the context
    assert transformers.AutoModelForCausalLM.from_pretrained.__func__.__module__.startswith("transformers")


def test_loader_holds_one_file_and_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Count what the loader reads: safetensors handles open at once, and bytes of checkpoint tensors alive
    at once (a finalizer per tensor). A loader that read a whole file, or the whole model, before writing
    into the chunks would exceed both bounds."""
    _saved(_llama, tmp_path, max_shard_size="30KB")
    files = pretrained.checkpoint_files(str(tmp_path))
    assert len(files) > 2
    live = {"handles": 0, "max_handles": 0, "bytes": 0, "max_bytes": 0, "largest": 0, "total": 0}
    real_open = pretrained.safe_open

    class Counted:
        def __init__(self, path):
            self.inner = real_open(path)

        def __enter__(self):
            live["handles"] += 1
            live["max_handles"] = max(live["max_handles"], live["handles"])
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            live["handles"] -= 1
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            tensor = self.handle.get_tensor(key)
            nbytes = tensor.numel() * tensor.element_size()
            live["bytes"] += nbytes
            live["max_bytes"] = max(live["max_bytes"], live["bytes"])
            live["largest"] = max(live["largest"], nbytes)
            live["total"] += nbytes
            weakref.finalize(tensor, lambda: live.__setitem__("bytes", live["bytes"] - nbytes))
            return tensor

    monkeypatch.setattr(pretrained, "safe_open", Counted)
    model = _load(transformers.LlamaForCausalLM, tmp_path)
    assert live["max_handles"] == 1
    assert live["bytes"] == 0
    assert live["max_bytes"] == live["largest"] < live["total"] / 4
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    state = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu").state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_training_generate_and_save_pretrained_round_trip(name, tmp_path):
    cls = _saved(MAKERS[name], tmp_path / "in")
    reference = cls.from_pretrained(tmp_path / "in")
    model = _load(cls, tmp_path / "in")
    for m in (reference, model):
        m.gradient_checkpointing_enable()
        m.train()
    wrapped = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    optim = cm.ShardedOptimizerV2(wrapped, cm.HybridAdam(wrapped.parameters(), lr=1e-3))
    plain_optim = cm.HybridAdam(reference.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = wrapped(x, labels=x)["loss"]
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        plain_loss = reference(x, labels=x)["loss"]
        plain_loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
        assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = wrapped.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())
    wrapped.eval()
    reference.eval()
    prompt = x[:, :4]
    with torch.no_grad():
        ours = wrapped.module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                       do_sample=False, pad_token_id=0)
        theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                    do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    # export: the files plain transformers writes, the tied weight once, loadable by a plain from_pretrained
    out = tmp_path / "out"
    written = pretrained.save_pretrained(wrapped, out)
    reference.save_pretrained(tmp_path / "plain")
    assert [os.path.basename(f) for f in written] == [pretrained.WEIGHTS_NAME]
    from safetensors import safe_open

    with safe_open(str(out / pretrained.WEIGHTS_NAME), "pt") as ours_file, \
            safe_open(str(tmp_path / "plain" / pretrained.WEIGHTS_NAME), "pt") as plain_file:
        assert set(ours_file.keys()) == set(plain_file.keys())
        assert ours_file.metadata() == {"format": "pt"}
    loaded = cls.from_pretrained(out)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight


def test_sharded_save_streams_files_and_reloads(tmp_path):
    cls = _saved(_bert, tmp_path / "in")
    wrapped = cm.ShardedModelV2(_load(cls, tmp_path / "in"), cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model-00001-of-00009.safetensors").write_bytes(b"stale")  # an earlier save's file
    written = pretrained.save_pretrained(wrapped, tmp_path / "out", max_shard_size=30000)
    assert len(written) > 2
    index = json.loads((tmp_path / "out" / pretrained.INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(os.path.basename(f) for f in written)
    assert sorted(p for p in os.listdir(tmp_path / "out") if p.endswith(".safetensors")) == \
        sorted(os.path.basename(f) for f in written)
    loaded = cls.from_pretrained(tmp_path / "out")
    state = wrapped.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_missing_keys_use_the_models_init_and_loaded_ones_stay(tmp_path):
    """A BertModel checkpoint (no pooler) into BertForSequenceClassification: the pooler and classifier are
    not in the checkpoint and get the model's own initialisation (normal(0, 0.02) weight, zero bias), the
    encoder is loaded (under the base-model prefix "bert.")."""
    torch.manual_seed(0)
    base = _bert().bert
    base.save_pretrained(tmp_path)
    cls = transformers.BertForSequenceClassification
    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float32):
        with pytest.warns(UserWarning, match="4 parameters are not in the checkpoint"):
            model = cls.from_pretrained(tmp_path, num_labels=3)
    state = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu").state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(state["bert." + key], value), key
    assert state["classifier.weight"].shape == (3, 32)
    assert torch.equal(state["classifier.bias"], torch.zeros(3))
    assert torch.equal(state["bert.pooler.dense.bias"], torch.zeros(32))
    assert 0.01 < state["classifier.weight"].std().item() < 0.04


def test_bad_arguments_are_refused(tmp_path):
    cls = _saved(_gpt2, tmp_path / "ok")
    (tmp_path / "empty").mkdir()
    context = cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float32)
    with context:
        with pytest.raises(cm.InvalidArgumentError, match="pretrained_model_name_or_path.*local directory"):
            cls.from_pretrained(tmp_path / "missing")
        with pytest.raises(cm.InvalidArgumentError, match="model.safetensors"):
            cls.from_pretrained(tmp_path / "empty")
        with pytest.raises(cm.InvalidArgumentError, match="dtype.*float32"):
            cls.from_pretrained(tmp_path / "ok", dtype=torch.float16)
        with pytest.raises(cm.InvalidArgumentError, match="no_such_option"):
            cls.from_pretrained(tmp_path / "ok", no_such_option=1)
        with pytest.raises(cm.ArgumentTypeError, match="pretrained_model_name_or_path"):
            cls.from_pretrained(3)
    wrapped = cm.ShardedModelV2(torch.nn.Linear(2, 2), cm.TensorShardStrategy(), dtype=torch.float32)
    with pytest.raises(cm.ArgumentTypeError, match="model.module"):
        pretrained.save_pretrained(wrapped, tmp_path / "x")
    with pytest.raises(cm.ArgumentTypeError, match="model"):
        pretrained.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "x")


def _two_ranks(rank, world, directory, out):
    cls = transformers.GPT2LMHeadModel
    reference = cls.from_pretrained(directory)
    model = _load(cls, directory, shard_param=True)
    wrapped = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    kept = [c.param.shard.numel for c in wrapped.chunks]
    full = [c.numel for c in wrapped.chunks]
    state = wrapped.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    written = pretrained.save_pretrained(wrapped, out, max_shard_size=20000)
    return kept, full, len(written)


def test_two_ranks_shard_param_load_and_save(tmp_path):
    _saved(_gpt2, tmp_path / "in", max_shard_size="20KB")
    results = run_ranks(_two_ranks, 2, str(tmp_path / "in"), str(tmp_path / "out"))
    for kept, full, _ in results:
        assert all(k * 2 == f for k, f in zip(kept, full))  # each rank keeps half of every chunk
    assert results[0][2] > 1 and results[1][2] == 0  # rank 0 writes
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "in")
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
