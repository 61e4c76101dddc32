"""Reference document 003's low-level GPT-2 loop, as written there, with only the import names changed
(and the CPU as the target device when there is no GPU): ZeroInitContext(shard_param=True), a GPT-2 with
gradient checkpointing, `cpu` placement, `reuse_fp16_shard=True`, HybridAdam, `initial_scale=2**5`, and
a loop without zero_grad. Tiny sizes, and one random batch seen at every step; its loss falls."""
import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from chunkmem import HybridAdam, ShardedModelV2, ShardedOptimizerV2, TensorShardStrategy, ZeroInitContext  # noqa: E402


def current_device():
    return torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")


class GPTLMModel(nn.Module):
    def __init__(self, hidden_size=768, num_layers=12, num_attention_heads=12, max_seq_len=1024, vocab_size=50257,
                 checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        self.model = GPT2LMHeadModel(GPT2Config(n_embd=hidden_size, n_layer=num_layers,
                                                n_head=num_attention_heads, n_positions=max_seq_len, n_ctx=max_seq_len,
                                                vocab_size=vocab_size))
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        # Only return lm_logits
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint)[0]


def gpt2_tiny(checkpoint=False):
    return GPTLMModel(hidden_size=64, num_layers=2, num_attention_heads=4, max_seq_len=32, vocab_size=128,
                      checkpoint=checkpoint)


class GPTLMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        # Flatten the tokens
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_data(batch_size, seq_len, vocab_size):
    # the tutorial draws new random tokens at every step, which no model can learn: here the same random
    # batch comes back every step, so a falling loss shows that the loop trains
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(current_device())
    attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


def test_the_tutorial_loop_runs_as_written_and_its_loss_falls():
    torch.manual_seed(0)
    SEQ_LEN, VOCAB_SIZE, BATCH_SIZE, NUM_STEPS = 32, 128, 4, 30
    # build GPT model
    shard_strategy = TensorShardStrategy()
    with ZeroInitContext(target_device=current_device(), shard_strategy=shard_strategy, shard_param=True):
        model = gpt2_tiny(checkpoint=True)
    # Set tensor_placement_policy='cpu', which will offload params, grads and os
    model = ShardedModelV2(model, shard_strategy, tensor_placement_policy='cpu', reuse_fp16_shard=True)

    # build criterion
    criterion = GPTLMLoss()

    # optimizer
    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    optimizer = ShardedOptimizerV2(model, optimizer, initial_scale=2**5)

    losses = []
    for n in range(NUM_STEPS):
        # we just use randomly generated data here
        input_ids, attn_mask = get_data(BATCH_SIZE, SEQ_LEN, VOCAB_SIZE)
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
