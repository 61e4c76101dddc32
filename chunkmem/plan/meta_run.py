"""The meta run behind :func:`plan`: chunkmem itself on PyTorch's ``meta`` device, per placement policy.

Both tiers point at the meta device while it runs (:func:`meta_tiers`): tensors there have shapes and dtypes but
no memory, while every byte count stays exact. The model is built (or copied) on the meta device and wrapped in a
real :class:`~chunkmem.ShardedModelV2` (the same chunk-size search, packing, capacity check, hooks, tracer,
Belady planner and byte ledger as a real run), which then runs :data:`ITERATIONS` training iterations on the
sample batch, each ``gradient_accumulation_steps`` forward/backward passes and a step: the first pass is traced
(the tracer's :class:`~chunkmem.runtime.tracer.StorageCounter` gives the non-model peak: activations,
temporaries, autograd's gradients), the later ones follow the schedule, and the ledger counts the bytes the last
iteration moves (attention on meta tensors is counted as the fused kernel real devices run, see
:func:`~chunkmem.plan.cost_model.flash_attention_on_meta`). With several passes before a step the gradients of the
later backwards add to the earlier ones as in a real run: 16-bit sums widened to fp32 (unless
``grad_accum_dtype`` is the model's dtype) are on the ledger, so the peaks include them. The optimizer's
families (``master`` for 16-bit models, ``exp_avg``, ``exp_avg_sq``, all fp32; or an 8-bit Adam's, laid out by
:meth:`~chunkmem.optim.low_bit_rule.LowBitAdamRule.state_buffers` for each rank's shard: :data:`OPTIMIZER_STATES`)
cannot run on meta tensors; their bytes come from the policy's own ``optim_on_device`` rule, and the device
capacity the meta run gets is what is left after the optimizer state resting there.
"""
from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from ..core import block_pool, tiers
from ..errors import ArgumentTypeError, DeviceCapacityError, InvalidArgumentError, UnsupportedOperationError
from ..errors import check_choice, check_number
from ..settings import check_chunk_size, check_dtype, check_grad_accum_dtype
from ..model.sharded_model import ShardedModelV2
from ..optim.low_bit_rule import LowBitAdamRule
from ..core.chunk import ADAM_STATE, MASTER
from ..core.layout import part_in_shard
from ..core.param_guard import slot_of
from ..distributed.shard_strategy import TensorShardStrategy
from ..core.tiers import parse_size
from ..distributed.traffic import bytes_sent, traffic
from .cost_model import flash_attention_on_meta


META = torch.device("meta")
ITERATIONS = 3  # traced, planned, followed: the last one is measured (each: the passes of one step)
OPTIMIZER_STATES = ("fp32", "8bit", "8bit-bf16")
"""The optimizer states the planner counts: Adam's fp32 moments; 8-bit ones (:mod:`chunkmem.optim.low_bit_rule`'s
families) beside fp32 masters (of a 16-bit model); 8-bit ones over bf16 parameters that are their own masters
(``HybridAdam(state_dtype="8bit", bf16_stochastic_round=True)`` or torchao's
``AdamW8bit(bf16_stochastic_round=True)`` on a bf16 model: no master family, the small parameters' moments in
bf16)."""


@dataclass
class PolicyPlan:
    """The plan of one placement policy. Bytes are bytes; ``chunk_bytes`` is one chunk's parameter bytes.

    ``tier_bytes``: ``{"device"|"host": {family: bytes}}`` at rest between steps: as ``model.tier_bytes()``
    reports it after a step, less the chunks the step started fetching for the next forward's first period
    (their device copies, which that period uses or frees). ``device_peak_bytes``: the most chunk bytes on the
    device at once (the meta run's ledger peak, which restarts at each period: the largest it reads at the end
    of each pass of the measured iteration and after its step, plus the optimizer state resting there).
    ``host_peak_bytes``: the most chunk bytes on the host at once (the meta run's ledger peak: the parameters
    and the gradients resting there before the step, plus the optimizer state resting there): what a host
    capacity must allow. Both peaks include, with ``gradient_accumulation_steps`` > 1, the 16-bit gradient
    sums widened to fp32 (2 bytes more per gradient element where they rest, and for a moment the 16-bit
    copy of the chunk being widened beside its fp32 one). ``moved_*_per_step``: bytes copied between the
    tiers by one training step that follows the schedule (its ``gradient_accumulation_steps``
    forward/backward passes), as the ledger counts them.

    Sharded over several ranks (:func:`~chunkmem.plan.choose`'s ``ranks``) ``tier_bytes`` is rank 0's and
    ``tier_bytes_per_rank`` every rank's (rank ``r`` at index ``r``; one entry with one rank). They differ only
    with 8-bit optimizer state, whose block scales and small parameters' moments depend on where the shard
    boundaries fall (a few bytes per boundary); the peaks are the largest rank's.
    """

    policy: str
    fits: bool
    reason: str
    tier_bytes: dict[str, dict[str, int]]
    non_model_peak: int
    chunk_bytes: int
    num_chunks: int
    moved_to_device_per_step: int
    moved_to_host_per_step: int
    device_peak_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    host_peak_bytes: int = 0
    gradient_accumulation_steps: int = 1
    tier_bytes_per_rank: list[dict[str, dict[str, int]]] = field(default_factory=list)

    def total(self, tier: str) -> int:
        """Bytes on ``tier`` ("device" or "host") over all families."""
        return sum(self.tier_bytes[tier].values())


def plan(model_or_builder: nn.Module | Callable[[], nn.Module], sample_batch: Any, device_memory: int | str,
         host_memory: int | str | None = None, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         dtype: torch.dtype = torch.float16, chunk_size: int | None = None, reuse_fp16_shard: bool = False,
         policies: Sequence[str] = ("cuda", "cpu", "auto"), gradient_accumulation_steps: int = 1,
         grad_accum_dtype: torch.dtype | None = None, optimizer_state: str = "fp32") -> dict[str, PolicyPlan]:
    """Plan one process's training of a model without allocating its state; returns a plan per policy.

    Args:
        model_or_builder: a function that builds the model (called under ``torch.device("meta")``:
            nothing is allocated), or a module (copied to the meta device; the copy costs one model).
        sample_batch: what the model is called with (a tensor, or a tuple of positional arguments); its
            tensors are moved to the meta device.
        device_memory: the device tier's capacity in bytes (an int or a size like ``"24GiB"``): the device
            peak (chunks and the non-model peak) must fit in it.
        host_memory: the host tier's capacity in bytes (``None``: unbounded): the host peak
            (``host_peak_bytes``: chunks resting there and the gradients resting there before the step) must
            fit in it.
        loss_fn: ``loss_fn(output, sample_batch)`` -> scalar (default: the mean of the output). The
            output stays referenced through the backward, as in a loop that keeps ``logits``.
        dtype: the model dtype, torch.float16, torch.bfloat16 or torch.float32.
        chunk_size: bytes per chunk (``None``: searched as ShardedModelV2 does).
        reuse_fp16_shard: as ShardedModelV2's.
        policies: among ``"cuda"``, ``"cpu"``, ``"auto"`` (``auto`` with ``gpu_margin_mem_ratio=0``).
        gradient_accumulation_steps: forward/backward passes per optimizer step (an int >= 1): each meta
            iteration runs that many before its step, so the gradients of the later backwards add to the
            earlier ones as in training with gradient accumulation, and the peaks and the bytes moved per
            step count them (with a 16-bit ``dtype`` and ``grad_accum_dtype`` ``None``/fp32, the sums
            rest in fp32 from the second backward on: 2 bytes more per gradient element where they rest).
            More than 1 needs ``reuse_fp16_shard=False`` (the gradients in the parameters' memory cannot
            accumulate).
        grad_accum_dtype: what 16-bit gradients of several backwards are summed in, as
            ``ShardedModelV2(grad_accum_dtype=)``: ``None`` or ``torch.float32`` (fp32, the default), or
            ``dtype`` (kept in 16 bits: no widening). Matters only with ``gradient_accumulation_steps`` > 1.
        optimizer_state: ``"fp32"`` (Adam's fp32 moments: ``HybridAdam``, torch's Adam), ``"8bit"``
            (``HybridAdam(state_dtype="8bit")``, torchao's ``AdamW8bit`` / ``Adam8bit``: 8-bit codes, block scales
            and the small parameters' fp32 moments, laid out as :mod:`chunkmem.optim.low_bit_rule` lays them out;
            fp32 masters for a 16-bit model) or ``"8bit-bf16"`` (the same optimizers with
            ``bf16_stochastic_round=True``: the same codes and scales, the small parameters' moments in bf16, and
            no fp32 master, the bf16 parameters being their own: 4 bytes a parameter fewer; needs
            ``dtype=torch.bfloat16`` and ``reuse_fp16_shard=False``).
    """
    device_capacity = parse_size(device_memory, "device_memory")
    host_capacity = None if host_memory is None else parse_size(host_memory, "host_memory")
    check_dtype("dtype", dtype)
    check_chunk_size(chunk_size, dtype)
    if not isinstance(reuse_fp16_shard, bool):
        raise ArgumentTypeError("reuse_fp16_shard", reuse_fp16_shard, "True or False")
    check_accumulation(gradient_accumulation_steps, grad_accum_dtype, dtype, reuse_fp16_shard)
    check_optimizer_state("optimizer_state", optimizer_state, dtype, reuse_fp16_shard)
    if isinstance(policies, str) or not policies:
        raise InvalidArgumentError("policies", policies, "a non-empty sequence of 'cuda', 'cpu', 'auto'")
    for name in policies:
        check_choice("policies", name, ("cuda", "cpu", "auto"))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise UnsupportedOperationError("chunkmem.plan plans one process; call it before init_process_group "
                                        "(or in a process without one)")
    args = _meta_inputs(model_or_builder, sample_batch, loss_fn)
    saved_capacity = tiers.device_memory_capacity_setting()  # the user's setting, restored after the meta runs
    template = _meta_model(model_or_builder)  # built once; each wrapped model below gets a (free) meta copy
    plans = {}
    try:
        for name in policies:
            plans[name] = _plan_policy(name, template, args, loss_fn, device_capacity, host_capacity, dtype,
                                       chunk_size, reuse_fp16_shard, gradient_accumulation_steps, grad_accum_dtype,
                                       optimizer_state=optimizer_state)
    finally:
        tiers.set_device_memory_capacity(saved_capacity)
    return plans


def check_accumulation(gradient_accumulation_steps: Any, grad_accum_dtype: Any, dtype: torch.dtype,
                       reuse_fp16_shard: bool | None) -> None:
    """Check :func:`plan`'s and :func:`~chunkmem.plan.choose`'s ``gradient_accumulation_steps`` (an int >= 1;
    more than 1 refused with ``reuse_fp16_shard=True``) and ``grad_accum_dtype`` (as ``ShardedModelV2``
    checks it against ``dtype``)."""
    check_number("gradient_accumulation_steps", gradient_accumulation_steps, low=1, integer=True,
                 allowed="an integer >= 1 (forward/backward passes per optimizer step)")
    check_grad_accum_dtype(grad_accum_dtype, dtype)
    if reuse_fp16_shard and gradient_accumulation_steps > 1:
        raise InvalidArgumentError("gradient_accumulation_steps", gradient_accumulation_steps,
                                   "1 with reuse_fp16_shard=True (the gradients live in the parameters' memory "
                                   "and cannot add up over backwards); or reuse_fp16_shard=False")


def check_optimizer_state(name: str, optimizer_state: Any, dtype: torch.dtype, reuse_fp16_shard: bool | None) -> None:
    """Check an optimizer state of :data:`OPTIMIZER_STATES` (argument ``name``); ``"8bit-bf16"`` (bf16 parameters as
    their own masters) only with a bf16 ``dtype`` and without ``reuse_fp16_shard``, as ShardedOptimizerV2 takes it."""
    check_choice(name, optimizer_state, OPTIMIZER_STATES)
    if optimizer_state != "8bit-bf16":
        return
    if dtype != torch.bfloat16:
        raise InvalidArgumentError(name, optimizer_state, f"'fp32' or '8bit' with dtype={dtype}; '8bit-bf16' (bf16 "
                                   "parameters as their own masters) needs dtype=torch.bfloat16")
    if reuse_fp16_shard:
        raise InvalidArgumentError(name, optimizer_state, "'fp32' or '8bit' with reuse_fp16_shard=True; '8bit-bf16' "
                                   "needs reuse_fp16_shard=False (the bf16 parameters are the only copy: their memory "
                                   "cannot hold the gradients)")


def optimizer_families(chunk: Any, optimizer_state: str) -> dict[str, tuple[int, torch.dtype]]:
    """The elements and dtype of each optimizer family of this rank's shard of the trainable ``chunk`` under
    ``optimizer_state`` (:data:`OPTIMIZER_STATES`), as ShardedOptimizerV2 allocates them: the fp32 ``master`` of a
    16-bit chunk (none with ``"8bit-bf16"``), then the state families."""
    families: dict[str, tuple[int, torch.dtype]] = {}
    if chunk.dtype != torch.float32 and optimizer_state != "8bit-bf16":
        families[MASTER] = (chunk.shard_numel, torch.float32)
    if optimizer_state == "fp32":
        families.update({family: (chunk.shard_numel, torch.float32) for family in ADAM_STATE})
    else:
        families.update(LowBitAdamRule.state_buffers(chunk, stochastic_round=optimizer_state == "8bit-bf16"))
    return families


class _RankView:
    """``chunk`` as rank ``rank`` of its shard group holds it, for :func:`optimizer_families` (which reads the
    shard's extent and its parameters' parts): the meta run holds rank 0's shard only."""

    def __init__(self, chunk: Any, rank: int) -> None:
        self.dtype, self.slots, self.shards = chunk.dtype, chunk.slots, chunk.shards
        self.shard_numel = chunk.shard_numel
        self.shard_offset = rank * chunk.shard_numel

    def own_range(self, slot: Any) -> tuple[int, int] | None:
        return part_in_shard(slot.offset, slot.numel, self.shard_offset, self.shard_numel)


def _rank_view(chunk: Any, rank: int, own_rank: int) -> Any:
    """``chunk`` as rank ``rank`` of its shard group holds it: the chunk itself where that is this process's rank
    (``own_rank``)."""
    return chunk if rank == own_rank else _RankView(chunk, rank)


def _meta_model(model_or_builder: Any) -> nn.Module:
    if isinstance(model_or_builder, nn.Module):
        if any(slot_of(p) is not None for p in model_or_builder.parameters()):
            raise InvalidArgumentError("model_or_builder", type(model_or_builder).__name__,
                                       "a plain module or a builder, not a module whose parameters are in chunks "
                                       "(built inside ZeroInitContext or wrapped)")
        return copy.deepcopy(model_or_builder).to(META)
    with META:
        model = model_or_builder()
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError("model_or_builder", type(model).__name__, "a builder returning a torch.nn.Module")
    return model


@contextmanager
def meta_tiers() -> Iterator[None]:
    """Point chunkmem's tier functions at the meta device (both tiers), and take chunk memory from torch
    instead of the block pool, in every chunkmem module that imported them, for the duration."""
    replacements = {  # by identity: the original function -> its meta stand-in
        id(tiers.device_of_tier): lambda tier: META,
        id(tiers.empty_on_tier): lambda tier, numel, dtype: torch.empty(numel, dtype=dtype, device=META),
        id(block_pool.pool_for_this_machine): lambda: None,
    }
    originals = (tiers.device_of_tier, tiers.empty_on_tier, block_pool.pool_for_this_machine)
    patched = []
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "chunkmem" and m]:
        for attribute, value in list(vars(module).items()):
            if any(value is original for original in originals):
                patched.append((module, attribute, value))
                setattr(module, attribute, replacements[id(value)])
    try:
        yield
    finally:
        for module, attribute, value in patched:
            setattr(module, attribute, value)


def _optimizer_bytes(policy: Any, model: ShardedModelV2, optimizer_state: str = "fp32"
                     ) -> list[dict[str, dict[str, int]]]:
    """The optimizer families' bytes per tier, by the policy's rule (as ShardedOptimizerV2 places them), for each
    rank of the model's shard group (rank ``r`` at index ``r``); ``optimizer_state``: as :func:`plan`'s."""
    trainable = [c for c in model.chunks if c.trainable]
    per_rank = []
    for rank in range(model.shards.world):
        out: dict[str, dict[str, int]] = {"device": {}, "host": {}}
        for position, chunk in enumerate(trainable):
            tier = "device" if policy.optim_on_device(position, len(trainable)) else "host"
            view = _rank_view(chunk, rank, model.shards.rank)
            for family, (numel, dtype) in optimizer_families(view, optimizer_state).items():
                out[tier][family] = out[tier].get(family, 0) + numel * dtype.itemsize
        per_rank.append(out)
    return per_rank


def _meta_inputs(model_or_builder: Any, sample_batch: Any, loss_fn: Any) -> tuple:
    """Check the model and loss arguments of :func:`plan` and :func:`choose`; the sample batch's tensors
    on the meta device, as the model's positional arguments."""
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentTypeError("loss_fn", loss_fn, "a function (output, sample_batch) -> scalar, or None")
    if not isinstance(model_or_builder, nn.Module) and not callable(model_or_builder):
        raise ArgumentTypeError("model_or_builder", type(model_or_builder).__name__,
                                "a torch.nn.Module or a function that builds one")
    return tree_map(lambda x: x.to(META) if isinstance(x, torch.Tensor) else x,
                    sample_batch if isinstance(sample_batch, tuple) else (sample_batch,))


def _plan_policy(name: str, template: nn.Module, args: tuple, loss_fn: Any, device_capacity: int,
                 host_capacity: int | None, dtype: torch.dtype, chunk_size: int | None,
                 reuse_fp16_shard: bool, gradient_accumulation_steps: int = 1,
                 grad_accum_dtype: torch.dtype | None = None, optimizer_state: str = "fp32",
                 **placement: Any) -> PolicyPlan:
    """The meta run of one placement (``placement``: ``offload_param_frac`` / ``offload_optim_frac``
    for ``static``), ``gradient_accumulation_steps`` forward/backward passes per step, the model built with
    ``grad_accum_dtype``. Besides the :class:`PolicyPlan` figures, ``extra`` keeps what the candidates built
    on it need: the meta run's host peak (bytes, the optimizer state aside), each chunk's shard bytes and
    where its parameters and optimizer state rest, the collectives of the last iteration."""
    with meta_tiers(), flash_attention_on_meta():
        optim_ranks, chunk_bytes, num_chunks, extra = _probe_layout(name, template, dtype, chunk_size,
                                                                    reuse_fp16_shard, grad_accum_dtype, placement,
                                                                    optimizer_state)
        optim_device = max(sum(o["device"].values()) for o in optim_ranks)  # (the tightest rank's)
        tiers.set_device_memory_capacity(max(device_capacity - optim_device, 1))
        result = PolicyPlan(name, True, "fits", {}, 0, chunk_bytes, num_chunks, 0, 0, extra=extra,
                            gradient_accumulation_steps=gradient_accumulation_steps)
        model = None
        try:
            model = ShardedModelV2(copy.deepcopy(template), TensorShardStrategy(), tensor_placement_policy=name,
                                   dtype=dtype, chunk_size=chunk_size, reuse_fp16_shard=reuse_fp16_shard,
                                   grad_accum_dtype=grad_accum_dtype, **placement)
            resting = model.tier_bytes()
            ledger = model.runtime.ledger
            device_peak = 0  # the ledger's device peak at the end of each pass of the measured iteration
            for iteration in range(ITERATIONS):
                if iteration == ITERATIONS - 1:  # the measured iteration: which chunks it fetches
                    model.runtime.executor.events = []
                before = ledger.moved_to_device, ledger.moved_to_host
                sent_before = _bytes_sent()
                for _ in range(gradient_accumulation_steps):  # later backwards add to the gradients
                    out = model(*args)
                    loss = loss_fn(out, args[0] if len(args) == 1 else args) if loss_fn else _mean_of(out)
                    loss.backward()
                    if iteration == ITERATIONS - 1:  # (the ledger's device peak restarts at each period: an
                        # earlier pass's last period, e.g. the widening of the first sums, is kept this way)
                        device_peak = max(device_peak, ledger.peak_device_bytes)
                extra["host_peak_meta"] = ledger.peak_host_bytes  # the gradients are still there
                _meta_step(model)
            planner = model.runtime.scheduler
            planner.close_finished_traces()
            result.non_model_peak = max((p.non_model_peak for p in planner.periods or []), default=0)
            result.moved_to_device_per_step = ledger.moved_to_device - before[0]
            fetches = [e[1] for e in model.runtime.executor.events if e[0] == "fetch"]
            extra["fetches"] = [fetches.count(i) for i in range(num_chunks)]
            result.moved_to_host_per_step = ledger.moved_to_host - before[1]
            result.device_peak_bytes = max(device_peak, ledger.peak_device_bytes) + optim_device
            extra["collective_bytes_sent"] = _bytes_sent() - sent_before
        except DeviceCapacityError as e:
            resting = _did_not_fit(result, model, e, optim_device)
    result.tier_bytes_per_rank = [{tier: {f: n for f, n in sorted({**resting[tier], **o[tier]}.items()) if n}
                                   for tier in ("device", "host")} for o in optim_ranks]
    result.tier_bytes = result.tier_bytes_per_rank[0]
    if result.fits and result.device_peak_bytes + result.non_model_peak > device_capacity:
        result.fits, result.reason = False, (
            f"device: {result.device_peak_bytes} bytes of chunks at the peak and the non-model peak of "
            f"{result.non_model_peak} bytes exceed device_memory={device_capacity}")
    result.host_peak_bytes = extra["host_peak_meta"] + max(sum(o["host"].values()) for o in optim_ranks)
    if result.fits and host_capacity is not None and result.host_peak_bytes > host_capacity:
        result.fits, result.reason = False, (
            f"host: a peak of {result.host_peak_bytes} bytes of chunks (the gradients before the step included) "
            f"exceeds host_memory={host_capacity}")
    return result


def _probe_layout(name: str, template: nn.Module, dtype: torch.dtype, chunk_size: int | None, reuse_fp16_shard: bool,
                  grad_accum_dtype: torch.dtype | None, placement: dict[str, Any], optimizer_state: str = "fp32"
                  ) -> tuple[list[dict[str, dict[str, int]]], int, int, dict[str, Any]]:
    """The layout of the placement on the meta device, under an unbounded capacity: the optimizer state's
    bytes per tier of each rank, the chunk bytes, the chunk count, and the candidates' ``extra`` facts of the
    layout (``optim_families``: each trainable chunk's optimizer families, ``{family: (elements, bytes per
    element)}`` of rank 0's shard, the master included; ``in_memory_families``: those that stay in host memory when
    the chunk's state rests on disk; ``whole_chunks``: whether the disk step streams each chunk whole;
    ``rewritten_per_rank``: for each rank of the shard group (rank ``r`` at index ``r``), each trainable chunk's
    bytes the disk step writes again: an 8-bit Adam's pages of codes around the blocks the shard boundaries cut,
    which depend on where the rank's shard begins and ends)."""
    tiers.set_device_memory_capacity(2**62)
    probe = ShardedModelV2(copy.deepcopy(template), TensorShardStrategy(), tensor_placement_policy=name, dtype=dtype,
                           chunk_size=chunk_size, reuse_fp16_shard=reuse_fp16_shard,
                           grad_accum_dtype=grad_accum_dtype, **placement)
    optim = _optimizer_bytes(probe.runtime.policy, probe, optimizer_state)
    num_chunks = len(probe.chunks)
    policy = probe.runtime.policy
    trainable = [c for c in probe.chunks if c.trainable]
    extra: dict[str, Any] = {
        "chunk_numel": probe.layout.chunk_numel, "world": probe.shards.world,
        "param_shard_bytes": [c.shard_numel * c.param.dtype.itemsize for c in probe.chunks],
        "param_on_device": [policy.params_on_device_at_rest(i, num_chunks) for i in range(num_chunks)],
        "trainable_shard_numels": [c.shard_numel for c in trainable],
        "trainable_index": [c.index for c in trainable],
        "optim_on_device": [policy.optim_on_device(k, len(trainable)) for k in range(len(trainable))],
        "has_master": dtype != torch.float32 and optimizer_state != "8bit-bf16",
        "optim_families": [{family: (numel, family_dtype.itemsize)
                            for family, (numel, family_dtype) in optimizer_families(c, optimizer_state).items()}
                           for c in trainable],
        "in_memory_families": () if optimizer_state == "fp32" else LowBitAdamRule.in_memory_families,
        "whole_chunks": optimizer_state != "fp32" and LowBitAdamRule.streams_whole_chunks,
        "rewritten_per_rank": [[0 if optimizer_state == "fp32" else
                                LowBitAdamRule.rewritten_nbytes(_rank_view(c, rank, probe.shards.rank))
                                for c in trainable] for rank in range(probe.shards.world)],
    }
    return optim, probe.layout.chunk_bytes, num_chunks, extra


def _did_not_fit(result: PolicyPlan, model: ShardedModelV2 | None, error: DeviceCapacityError,
                 optim_device: int) -> dict[str, dict[str, int]]:
    """The meta run stopped on ``error``: ``result`` says so, ``extra`` gets the figures the run did not reach;
    returns where the parameters rest (the tier bytes without the optimizer state)."""
    if model is not None:  # stopped inside an iteration: leave the tracer's counting mode
        planner = model.runtime.scheduler
        if planner.running:
            planner.interrupt()
        planner.close_finished_traces()
    result.fits, result.reason = False, (f"device: {error} (the meta run had device_memory less the "
                                         f"{optim_device} bytes of optimizer state resting there)")
    extra = result.extra
    param_total = sum(extra["param_shard_bytes"])
    resting = {"device": {"param": param_total}, "host": {}} if result.policy == "cuda" else \
        {"device": {}, "host": {"param": param_total}}
    extra.setdefault("host_peak_meta", resting["host"].get("param", 0))
    extra["fetches"] = [0] * result.num_chunks
    extra["collective_bytes_sent"] = 0.0
    return resting


def _meta_step(model: ShardedModelV2) -> None:
    """What a step leaves behind, on the meta run: each trainable chunk's parameters written by its update where
    it runs (a host update drops the device copy, which a chunk resting on the device fetches again; with
    ``reuse_fp16_shard`` the parameter memory that held the gradients is written), the gradients released, and
    the next forward's first chunks fetched."""
    runtime = model.runtime
    for chunk in runtime.trainable_chunks():
        with runtime.updating(chunk, runtime.compute_tier(chunk)):
            pass
    runtime.end_step(release_gradients=True)


def _bytes_sent() -> float:
    """Bytes this rank has sent in training collectives so far (ring implementation, see
    :mod:`chunkmem.distributed.traffic`)."""
    return float(sum(bytes_sent(collective, world, count.buffer_bytes)
                     for (_, collective, world), count in traffic().items()))




def _mean_of(out: Any) -> torch.Tensor:
    tensor = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    return tensor.float().mean()




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
