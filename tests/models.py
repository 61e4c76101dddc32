"""Small models shared by the tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.use_checkpoint = use_checkpoint

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_checkpoint and torch.is_grad_enabled():
            return x + checkpoint(self._inner, x, use_reentrant=False)
        return x + self._inner(x)


class TinyGPT(nn.Module):
    """Tied embedding and lm head, LayerNorm, biases, and ``proj`` used functionally by ``Mixer``."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, seq: int = 16,
                 use_checkpoint: bool = False, unused_param: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, use_checkpoint) for _ in range(layers))
        self.side = nn.Linear(d, d, bias=False)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.unused = nn.Linear(d, d) if unused_param else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        # a parameter of another module used functionally
        x = x + 0.5 * F.linear(x, self.side.weight)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


def batches(n: int, batch: int = 2, seq: int = 16, vocab: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def build_sharded(reference: nn.Module, policy: str, dtype: torch.dtype, *, chunk_size: int | None = 16384,
                  reuse: bool = False, lr: float = 1e-2, weight_decay: float = 0.01, initial_scale: float = 2**10,
                  **optim_kwargs):
    """A ShardedModelV2 + ShardedOptimizerV2 over a deep copy of ``reference`` (built outside the context)."""
    import copy

    import chunkmem as cm

    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              reuse_fp16_shard=reuse, dtype=dtype, chunk_size=chunk_size)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=lr, weight_decay=weight_decay),
                                  initial_scale=initial_scale, **optim_kwargs)
    return model, optim


def train(model, optim, data, loss_fn=None) -> list[float]:
    loss_fn = loss_fn or lm_loss
    losses = []
    for x in data:
        loss = loss_fn(model(x), x)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def upcast_by_autograd(model: nn.Module) -> nn.Module:
    """``model`` (the reference GPT built with ``upcast=True``) with its ``UpcastLinear`` layers computing the
    same fp32 linear through autograd's own nodes (``F.linear`` on upcast copies, cast back)."""
    from chunkmem.gpt import UpcastLinear
    for module in model.modules():
        if isinstance(module, UpcastLinear):
            module.forward = (lambda m: lambda x: F.linear(
                x.float(), m.weight.float(), None if m.bias is None else m.bias.float()).to(x.dtype))(module)
    return model


def resting_tier_bytes(model) -> dict:
    """``model.tier_bytes()`` at rest between steps: without the device copies the last step started for the next
    forward's first period (``ChunkExecutor.prefetch_next_forward``), which are freed here as that period would free
    them unused; what the planner's ``tier_bytes`` and the by-hand byte counts describe."""
    model.runtime.executor.flush_stale()
    return model.tier_bytes()
