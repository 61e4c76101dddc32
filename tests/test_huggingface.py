"""Hugging Face models on chunkmem (skipped without transformers): gradient checkpointing with torch's
early stop leaves no chunk held, save_pretrained exports the real weights, generate() works."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm

transformers = pytest.importorskip("transformers")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))  # no dropout: the plain run must draw no random numbers the wrapped one does not


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32))


@pytest.mark.parametrize("policy", ["cpu", "auto"])
@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_checkpointed_training_save_pretrained_and_generate(make, policy, tmp_path):
    torch.manual_seed(0)
    reference = make()
    reference.gradient_checkpointing_enable()  # non-reentrant, torch's early stop
    if policy == "auto":
        cm.set_device_memory_capacity(4 * 2**20)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              dtype=torch.float32, chunk_size=64 * 1024)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    plain_optim = cm.HybridAdam(reference.parameters(), lr=1e-3)
    model.train()
    reference.train()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optim.backward(model(x, labels=x)["loss"])
        assert not [c.index for c in model.chunks if c.users or c.held_for_backward]
        optim.step()
        optim.zero_grad()
        reference(x, labels=x)["loss"].backward()
        plain_optim.step()
        plain_optim.zero_grad()
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())
    model.module.save_pretrained(tmp_path)
    loaded = type(reference).from_pretrained(tmp_path)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    model.eval()
    loaded.eval()
    prompt = x[:, :4]
    with torch.no_grad():
        ours = model.module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                     do_sample=False, pad_token_id=0)
        theirs = loaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                                 pad_token_id=0)
    assert torch.equal(ours, theirs)
