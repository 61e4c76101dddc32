"""A reference GPT: the model ``python -m chunkmem.plan --preset`` describes and the benchmarks train.

Token + position embedding, pre-LayerNorm blocks (causal ``scaled_dot_product_attention``, GELU MLP of
width 4d), ``nn.Linear`` layers with biases, a final LayerNorm, and an lm head tied to the token
embedding; ``self.apply`` initialises every Linear / Embedding weight from N(0, 0.02) and every Linear
bias to zero. Built inside :class:`~chunkmem.ZeroInitContext` its parameters go into chunks module by
module; built under ``torch.device("meta")`` it costs no memory and gives the exact parameter list.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .core.layout import pack, padding_elements, search_chunk_numel, staged_buffers


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int  # positions of the position embedding (the longest sequence the model takes)

    def describe(self) -> str:
        return (f"GPT vocab {self.vocab}, d_model {self.d_model}, {self.layers} layers, {self.heads} heads, "
                f"{self.seq} positions")


def count_params(cfg: GPTConfig) -> int:
    """Parameters of :class:`GPT` (the tied lm head counted once): embeddings, 12 d^2 + 13 d per block
    (qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, two LayerNorms 4d), final LayerNorm 2d."""
    d = cfg.d_model
    return cfg.vocab * d + cfg.seq * d + cfg.layers * (12 * d * d + 13 * d) + 2 * d


def params_per_layer(d_model: int) -> int:
    return 12 * d_model * d_model + 13 * d_model


class _Fp32Scratch(threading.local):
    """The host fp32 buffers :class:`UpcastLinear` reuses for its weight-sized transient tensors (the upcast
    weight, the fp32 weight gradient), one per role and thread, grown to the largest weight seen. A fresh
    buffer each time costs a page fault every 4 KiB: on a 10B GPT that is most of the step's system time.
    CUDA tensors are left to the caching allocator, and a backward that autograd records (``create_graph``)
    gets new tensors."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def reused(self, like: torch.Tensor) -> bool:
        """Whether a tensor like ``like`` goes into a reused buffer here (on the host, autograd not recording)."""
        return like.device.type == "cpu" and not torch.is_grad_enabled()

    def take(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host fp32 tensor of ``like``'s shape for ``role``, valid until the next ``take`` of
        that role on this thread."""
        buffer = self.buffers.get(role)
        if buffer is None or buffer.numel() < like.numel():
            self.buffers.pop(role, None)  # (freed before the larger one is allocated)
            buffer = self.buffers[role] = torch.empty(like.numel(), dtype=torch.float32)
        return buffer[:like.numel()].view(like.shape)

    def upcast(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in fp32: in the buffer of ``role`` where :meth:`reused`, else a new tensor."""
        return self.take(role, tensor).copy_(tensor) if self.reused(tensor) else tensor.float()


_scratch = _Fp32Scratch()


class _UpcastLinearFn(torch.autograd.Function):
    """``F.linear`` on 16-bit tensors computed in fp32: it saves the 16-bit input and weight (not fp32
    copies, which would hold 4 bytes a parameter until the backward) and upcasts them again there, into
    reused buffers (:class:`_Fp32Scratch`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), _scratch.upcast("weight", weight), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ _scratch.upcast("weight", weight)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x32 = x.float().reshape(-1, x.shape[-1])
            out = _scratch.take("weight grad", weight) if _scratch.reused(weight) else None
            grad_w = (g.t() @ x32 if out is None else torch.mm(g.t(), x32, out=out)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


class UpcastLinear(nn.Linear):
    """``nn.Linear`` whose matmuls run in fp32 on 16-bit parameters and inputs (the result cast back to
    the input's dtype; the gradients reach the parameters in their own dtype). On a CPU without native
    16-bit matmuls (AVX2: no AVX512-BF16/FP16) torch's bf16/fp16 backward matmuls are 50-100x slower than
    fp32 ones. The fp32 copies of the weight are made again in the backward; on the host they go into buffers
    each thread reuses across layers (two of the largest weight seen, in fp32, kept for the thread's life)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return super().forward(x)
        return _UpcastLinearFn.apply(x, self.weight, self.bias)


def _linear(upcast: bool):
    return UpcastLinear if upcast else nn.Linear


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, upcast: bool = False) -> None:
        super().__init__()
        assert d_model % heads == 0, "d_model must be divisible by heads"
        self.heads = heads
        self.qkv = _linear(upcast)(d_model, 3 * d_model)
        self.proj = _linear(upcast)(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int, upcast: bool = False) -> None:
        super().__init__()
        self.fc = _linear(upcast)(d_model, 4 * d_model)
        self.proj = _linear(upcast)(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, upcast: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, upcast)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, upcast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The reference GPT (see the module docstring); ``upcast=True``: its linear layers run their
    matmuls in fp32 on 16-bit parameters (:class:`UpcastLinear`; same parameters, same count)."""

    def __init__(self, cfg: GPTConfig, upcast: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, upcast) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = _linear(upcast)(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def param_numels(cfg: GPTConfig) -> list[int]:
    """Element counts of the GPT's parameters in ``named_parameters()`` order (the packing order),
    from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return [p.numel() for _, p in model.named_parameters()]


def chunk_layout(cfg: GPTConfig, element_size: int, chunk_size: int | None = None,
                 placement: str = "cuda") -> tuple[int, int, int]:
    """``(chunk_numel, n_chunks, padding_elements)`` that ``ShardedModelV2`` on one rank will choose for
    this GPT (one param group, every parameter trainable; ``chunk_size``: the bytes per chunk it is
    given, else searched for ``placement``), computed from the element counts alone."""
    numels = param_numels(cfg)
    keys = [0] * len(numels)
    staged = staged_buffers(placement, sharded=False)
    chunk_numel = (chunk_size // element_size if chunk_size
                   else search_chunk_numel(numels, keys, element_size, staged_buffers=staged))
    n_chunks = len(pack(numels, keys, chunk_numel))
    return chunk_numel, n_chunks, padding_elements(numels, keys, chunk_numel)
