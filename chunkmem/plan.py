"""Will it fit? :func:`plan` answers before anything is allocated, per placement policy.

The model is built (or copied) on the ``meta`` device, so its parameters cost no memory. The chunk layout
is the one :class:`~chunkmem.ShardedModelV2` would build (the same chunk-size search and packing, one
process, one optimizer param group). One iteration (forward, ``loss_fn``, backward) runs on the meta
model under the tracer's :class:`~chunkmem.tracer.StorageCounter`, which gives the non-model peak
(activations, temporaries, autograd's gradients) in bytes, and records which module used which chunk in
which order. From these:

* the bytes each tier holds per family between steps come from each policy's own rules
  (``params_on_device_at_rest``, ``optim_on_device``): ``param`` (model dtype), ``master`` (fp32, 16-bit
  models only), ``exp_avg`` and ``exp_avg_sq`` (fp32);
* the bytes moved per step come from :func:`chunkmem.belady.plan_moves` over the recorded periods (as
  the scheduler plans ``auto``; with the device holding only what each period needs for ``cpu`` and for
  the host-resting chunks of ``static``), plus the gradients of chunks whose Adam runs on the host;
* whether it fits: the device-capacity check ``ShardedModelV2`` runs before building, with the capacity
  left after the non-model peak, and the host bytes against ``host_memory``.

``python -m chunkmem.plan --preset gpt2-small --batch-size 8 --seq-len 1024 --device-memory 24GiB``
prints the table (run from the repository root: the presets are ``benchmarks/_gpt.py``'s GPT);
``--builder module:function`` plans any model.
"""
from __future__ import annotations

import argparse
import copy
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .belady import plan_moves
from .chunk import ChunkKey
from .collectives import SINGLE_PROCESS
from .errors import ArgumentTypeError, DeviceCapacityError, InvalidArgumentError, check_choice
from .init_context import check_chunk_size, check_dtype
from .layout import pack, search_chunk_numel
from .model import ShardedModelV2, _LayoutPlan
from .placement import make_policy
from .tiers import parse_size
from .tracer import StorageCounter

__all__ = ["PolicyPlan", "plan", "format_table"]

FAMILIES = ("param", "master", "exp_avg", "exp_avg_sq")
META = torch.device("meta")


@dataclass
class PolicyPlan:
    """The plan of one placement policy. Bytes are bytes; ``chunk_bytes`` is one chunk's parameter bytes."""

    policy: str
    fits: bool
    reason: str
    tier_bytes: dict[str, dict[str, int]]
    non_model_peak: int
    chunk_bytes: int
    num_chunks: int
    moved_to_device_per_step: int
    moved_to_host_per_step: int
    extra: dict[str, Any] = field(default_factory=dict)  # device_step_chunk_bytes: resting chunks + gradients

    def total(self, tier: str) -> int:
        """Bytes on ``tier`` ("device" or "host") over all families."""
        return sum(self.tier_bytes[tier].values())


def plan(model_or_builder: nn.Module | Callable[[], nn.Module], sample_batch: Any, device_memory: int | str,
         host_memory: int | str | None = None, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         dtype: torch.dtype = torch.float16, chunk_size: int | None = None, reuse_fp16_shard: bool = False,
         policies: Sequence[str] = ("cuda", "cpu", "auto")) -> dict[str, PolicyPlan]:
    """Plan one process's training of a model without allocating its state; returns a plan per policy.

    Args:
        model_or_builder: a function that builds the model (called under ``torch.device("meta")``:
            nothing is allocated), or a module (copied to the meta device; its copy costs one model).
        sample_batch: what the model is called with (a tensor, or a tuple of positional arguments); any
            tensor is moved to the meta device, floating ones cast to ``dtype``.
        device_memory: the device tier's capacity in bytes (an int or a size like ``"24GiB"``).
        host_memory: the host tier's capacity in bytes (``None``: unbounded).
        loss_fn: ``loss_fn(output, sample_batch)`` -> scalar (default: the mean of the output).
        dtype: the model dtype, torch.float16, torch.bfloat16 or torch.float32.
        chunk_size: bytes per chunk (``None``: searched as ShardedModelV2 does).
        reuse_fp16_shard: as ShardedModelV2's (no gradient staging buffers).
        policies: among ``"cuda"``, ``"cpu"``, ``"auto"`` (``auto`` with ``gpu_margin_mem_ratio=0``).
    """
    device_capacity = parse_size(device_memory, "device_memory")
    host_capacity = None if host_memory is None else parse_size(host_memory, "host_memory")
    check_dtype("dtype", dtype)
    check_chunk_size(chunk_size, dtype)
    if not isinstance(reuse_fp16_shard, bool):
        raise ArgumentTypeError("reuse_fp16_shard", reuse_fp16_shard, "True or False")
    if reuse_fp16_shard and dtype == torch.float32:
        raise InvalidArgumentError("reuse_fp16_shard", True, "False with dtype torch.float32")
    if isinstance(policies, str) or not policies:
        raise InvalidArgumentError("policies", policies, "a non-empty sequence of 'cuda', 'cpu', 'auto'")
    for name in policies:
        check_choice("policies", name, ("cuda", "cpu", "auto"))
    model = _meta_model(model_or_builder, dtype)

    element_size = torch.empty((), dtype=dtype).element_size()
    named = list(model.named_parameters())
    if not named:
        raise InvalidArgumentError("model_or_builder", type(model).__name__, "a model with at least one parameter")
    keys = [ChunkKey(p.requires_grad, 0) for _, p in named]
    numels = [p.numel() for _, p in named]
    if chunk_size is None:
        chunk_numel = search_chunk_numel(numels, keys, element_size)
    else:
        chunk_numel = chunk_size // element_size
        if chunk_numel < max(numels):
            raise InvalidArgumentError("chunk_size", chunk_size, f">= {max(numels) * element_size} bytes (the "
                                                                 f"largest parameter)")
    first_seen = {k: i for i, k in reversed(list(enumerate(dict.fromkeys(keys))))}
    order = sorted(range(len(named)), key=lambda i: first_seen[keys[i]])
    entries = [(named[i][0], named[i][1], keys[i]) for i in order]
    groups = pack([p.numel() for _, p, _ in entries], [k for _, _, k in entries], chunk_numel)
    layout = _LayoutPlan(entries, groups, chunk_numel * element_size)
    chunk_of = layout.chunk_of_param()

    needed, peak = _trace(model, sample_batch, loss_fn, dtype, chunk_of)
    return {name: _plan_policy(name, model, layout, needed, peak, device_capacity, host_capacity, dtype,
                               reuse_fp16_shard) for name in policies}


def _meta_model(model_or_builder: Any, dtype: torch.dtype) -> nn.Module:
    if isinstance(model_or_builder, nn.Module):
        model = copy.deepcopy(model_or_builder).to(META)
    elif callable(model_or_builder):
        with META:
            model = model_or_builder()
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError("model_or_builder", type(model).__name__, "a builder returning a torch.nn.Module")
    else:
        raise ArgumentTypeError("model_or_builder", type(model_or_builder).__name__,
                                "a torch.nn.Module or a function that builds one")
    return model.to(dtype)


def _trace(model: nn.Module, batch: Any, loss_fn: Any, dtype: torch.dtype,
           chunk_of: dict[int, int]) -> tuple[list[list[int]], int]:
    """One meta iteration: the chunks each parameter-owning module needs, in forward then backward order
    (the reverse), and the non-model peak in bytes."""
    forward: list[list[int]] = []

    def record(module: nn.Module, _args: Any) -> None:
        chunks = sorted({chunk_of[id(p)] for p in module.parameters(recurse=False)})
        if chunks:
            forward.append(chunks)

    handles = [m.register_forward_pre_hook(record) for m in model.modules()]

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(META, dtype=dtype if x.is_floating_point() else x.dtype)
        return x

    args = tree_map(to_meta, batch if isinstance(batch, tuple) else (batch,))
    counter = StorageCounter(META)
    try:
        with counter:
            out = model(*args)
            loss = loss_fn(out, args[0] if len(args) == 1 else args) if loss_fn else _mean_of(out)
            loss.backward()
            counter.collect_freed()
    finally:
        for h in handles:
            h.remove()
    return forward + forward[::-1], counter.peak


def _mean_of(out: Any) -> torch.Tensor:
    tensor = out if isinstance(out, torch.Tensor) else next(t for t in torch.utils._pytree.tree_leaves(out)
                                                            if isinstance(t, torch.Tensor))
    return tensor.float().mean()


class _CheckTarget:
    """What ShardedModelV2's pre-build capacity check reads, for a model that is not built."""

    def __init__(self, module: nn.Module, policy: Any, reuse_fp16_shard: bool) -> None:
        self.module = module
        self.policy = policy
        self.reuse_fp16_shard = reuse_fp16_shard
        self.shards = SINGLE_PROCESS


def _plan_policy(name: str, model: nn.Module, layout: _LayoutPlan, needed: list[list[int]], peak: int,
                 device_capacity: int, host_capacity: int | None, dtype: torch.dtype,
                 reuse_fp16_shard: bool) -> PolicyPlan:
    policy = make_policy(name)
    count = len(layout.groups)
    trainable = [i for i in range(count) if layout.key_of(i).trainable]
    chunk_bytes = layout.chunk_bytes
    fp32_bytes = chunk_bytes // torch.empty((), dtype=dtype).element_size() * 4
    tiers: dict[str, dict[str, int]] = {"device": {}, "host": {}}

    def add(tier: str, family: str, nbytes: int) -> None:
        if nbytes:
            tiers[tier][family] = tiers[tier].get(family, 0) + nbytes

    resting = {i for i in range(count) if policy.params_on_device_at_rest(i, count)}
    for i in range(count):
        add("device" if i in resting else "host", "param", chunk_bytes)
    host_optim = set()
    for position, i in enumerate(trainable):
        tier = "device" if policy.optim_on_device(position, len(trainable)) else "host"
        if tier == "host":
            host_optim.add(i)
        for family in (("master",) if dtype != torch.float32 else ()) + ("exp_avg", "exp_avg_sq"):
            add(tier, family, fp32_bytes)

    visiting = [[c for c in period if c not in resting] for period in needed]
    if name == "auto":
        slots = [max(device_capacity - peak, 0) // chunk_bytes] * len(visiting)
    else:
        slots = [len(v) for v in visiting]
    moves = plan_moves(visiting, [[] for _ in visiting], slots, [str(i) for i in range(len(visiting))])
    to_device = moves.fetched_chunks * chunk_bytes
    to_host = len(host_optim) * chunk_bytes  # the gradients of chunks whose Adam runs on the host

    fits, reason = True, "fits"
    try:
        ShardedModelV2._check_capacity(_CheckTarget(model, policy, reuse_fp16_shard), layout,  # type: ignore[arg-type]
                                       max(device_capacity - peak, 0))
    except DeviceCapacityError as e:
        fits, reason = False, f"device: {e} (after the non-model peak of {peak} bytes)"
    # during the step the device holds its resting chunks and the gradients of the chunks whose Adam runs there
    device_grads = 0 if reuse_fp16_shard else sum(chunk_bytes for i in trainable if i not in host_optim)
    step_peak = sum(tiers["device"].values()) + device_grads
    if fits and step_peak + peak > device_capacity:
        fits, reason = False, (f"device: the {step_peak} bytes of chunks resting there with their gradients and the "
                               f"non-model peak of {peak} bytes exceed device_memory={device_capacity}")
    host_total = sum(tiers["host"].values())
    if fits and host_capacity is not None and host_total > host_capacity:
        fits, reason = False, f"host: {host_total} bytes of chunks exceed host_memory={host_capacity}"
    return PolicyPlan(name, fits, reason, tiers, peak, chunk_bytes, count, to_device, to_host,
                      {"device_step_chunk_bytes": step_peak})


def format_table(plans: dict[str, PolicyPlan]) -> str:
    """The plans as a text table (MiB)."""
    mib = 2**20
    lines = [f"{'policy':<7} {'fits':<5} {'device MiB':>11} {'host MiB':>10} {'non-model MiB':>14} "
             f"{'chunk MiB':>10} {'chunks':>7} {'to device MiB/step':>19} {'to host MiB/step':>17}"]
    for p in plans.values():
        lines.append(f"{p.policy:<7} {'yes' if p.fits else 'no':<5} {p.total('device') / mib:11.1f} "
                     f"{p.total('host') / mib:10.1f} {p.non_model_peak / mib:14.1f} {p.chunk_bytes / mib:10.2f} "
                     f"{p.num_chunks:7d} {p.moved_to_device_per_step / mib:19.1f} "
                     f"{p.moved_to_host_per_step / mib:17.1f}")
    for p in plans.values():
        families = "; ".join(f"{tier}: " + ", ".join(f"{f} {n / mib:.1f}" for f, n in fam.items())
                             for tier, fam in p.tier_bytes.items() if fam)
        lines.append(f"{p.policy}: {families}" + ("" if p.fits else f"  -- does not fit: {p.reason}"))
    return "\n".join(lines)


PRESETS = {  # (vocab, d_model, layers, heads)
    "tiny": (512, 256, 4, 4), "gpt2-small": (50257, 768, 12, 12), "gpt2-medium": (50257, 1024, 24, 16),
    "gpt2-large": (50257, 1280, 36, 20), "gpt2-xl": (50257, 1600, 48, 25),
}


def _main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chunkmem.plan", description="Will it fit? Plan one training "
                                "step per placement policy without allocating the model.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="a GPT of examples/train_gpt.py's shape")
    p.add_argument("--builder", default=None, help="MODULE:FUNCTION building the model instead of --preset "
                                                   "(called with no argument; the batch is token ids)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="token id range of the batch (default: the preset's)")
    p.add_argument("--device-memory", required=True, help="device tier capacity, e.g. 24GiB")
    p.add_argument("--host-memory", default=None, help="host tier capacity, e.g. 64GiB (default: unbounded)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--chunk-size", type=int, default=None, help="bytes per chunk (default: searched)")
    args = p.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.builder:
        module_name, _, function = args.builder.partition(":")
        builder = getattr(importlib.import_module(module_name), function)
        vocab = args.vocab or 2
    else:
        vocab_size, d_model, layers, heads = PRESETS[args.preset]
        try:  # the benchmarks' GPT: run from the repository root
            gpt = importlib.import_module("benchmarks._gpt")
        except ImportError as e:
            raise SystemExit(f"--preset needs benchmarks/_gpt.py (run from the repository root), or use --builder: {e}")

        def builder() -> nn.Module:
            return gpt.GPT(gpt.GPTConfig(vocab_size, d_model, layers, heads, args.seq_len))
        vocab = args.vocab or vocab_size
    print(format_table(plan(builder, torch.randint(0, vocab, (args.batch_size, args.seq_len)), args.device_memory,
                            args.host_memory, dtype=dtype, chunk_size=args.chunk_size)))


if __name__ == "__main__":
    _main()
