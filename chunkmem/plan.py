"""Will it fit? :func:`plan` answers before anything is allocated, per placement policy.

The planner runs chunkmem itself, with both tiers on PyTorch's ``meta`` device: tensors there have
shapes and dtypes but no memory, while every byte count stays exact. The model is built (or copied)
on the meta device and wrapped in a real :class:`~chunkmem.ShardedModelV2` (the same chunk-size search,
packing, capacity check, hooks, tracer, Belady planner and byte ledger as a real run), which then runs
three forward/backward iterations on the sample batch: the first is traced (the tracer's
:class:`~chunkmem.runtime.tracer.StorageCounter` gives the non-model peak: activations, temporaries,
autograd's gradients), the later ones follow the schedule, and the ledger counts the bytes the last one
moves (attention on meta tensors is counted as the fused kernel real devices run, see
:func:`flash_attention_on_meta`). The optimizer's families (``master`` for 16-bit models, ``exp_avg``, ``exp_avg_sq``, all fp32)
cannot run on meta tensors; their bytes come from the policy's own ``optim_on_device`` rule, and the
device capacity the meta run gets is what is left after the optimizer state resting there.

While :func:`plan` runs, chunkmem's tier functions point at the meta device (process-wide): do not
train in another thread meanwhile. :func:`plan` plans one process (no ZeRO-3 sharding over ranks).

:func:`choose` plans every candidate configuration (placements ``cuda``, ``cpu``, ``auto``, ``static``
with offload fractions; the disk tier for the optimizer state and/or the parameters;
``reuse_fp16_shard``) on the same meta runs, for one rank or several (the meta run then shards over a
stand-in process group), checks each against device, host and disk budgets, predicts its seconds per
step with :mod:`chunkmem.cost_model` from a :class:`~chunkmem.machine_profile.MachineProfile` measured on
this machine, and recommends the fastest that fits (:class:`PlanChoice`); a :class:`Candidate` gives the
:class:`~chunkmem.ShardedModelV2` settings it stands for, which ``chunkmem.initialize(..., plan=)`` takes.

``python -m chunkmem.plan --preset gpt2-small --batch-size 8 --seq-len 1024 --device-memory 24GiB``
prints the per-placement table (the presets are :mod:`chunkmem.gpt`'s GPT, the model the benchmarks
train); ``--candidates`` (with ``--host-memory``, ``--disk-memory``, ``--nvme-path``, ``--ranks``,
``--profile``) the candidates with their predicted seconds per step and the recommendation marked;
``--builder module:function`` plans any model.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from .core import block_pool, tiers
from .errors import ArgumentTypeError, DeviceCapacityError, InvalidArgumentError, UnsupportedOperationError
from .errors import check_choice, check_number
from .core.disk_tier import DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, check_disk_arguments
from .storage.disk_io import aligned_nbytes
from .machine_profile import MachineProfile, dtype_name
from .cost_model import StepTime, step_time, trace_compute
from .gpt import GPT, GPTConfig
from .settings import check_chunk_size, check_dtype
from .model import ShardedModelV2
from .core.chunk import ADAM_STATE
from .optim.disk_step import streamed_count
from .builder import param_chunks_kept_on_host
from .core.param_guard import slot_of
from .distributed.shard_strategy import TensorShardStrategy
from .core.tiers import parse_size
from .distributed.traffic import bytes_sent, traffic
from .cost_model import flash_attention_on_meta

__all__ = ["Candidate", "PlanChoice", "PolicyPlan", "choose", "format_candidates", "format_table", "plan"]

META = torch.device("meta")
ITERATIONS = 3  # traced, planned, followed: the last one is measured


@dataclass
class PolicyPlan:
    """The plan of one placement policy. Bytes are bytes; ``chunk_bytes`` is one chunk's parameter bytes.

    ``tier_bytes``: ``{"device"|"host": {family: bytes}}`` between steps, as ``model.tier_bytes()``
    reports it after a step. ``device_peak_bytes``: the most chunk bytes on the device at once (the meta
    run's ledger peak plus the optimizer state resting there). ``moved_*_per_step``: bytes copied between
    the tiers by one forward/backward that follows the schedule, as the ledger counts them.
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
            nothing is allocated), or a module (copied to the meta device; the copy costs one model).
        sample_batch: what the model is called with (a tensor, or a tuple of positional arguments); its
            tensors are moved to the meta device.
        device_memory: the device tier's capacity in bytes (an int or a size like ``"24GiB"``).
        host_memory: the host tier's capacity in bytes (``None``: unbounded).
        loss_fn: ``loss_fn(output, sample_batch)`` -> scalar (default: the mean of the output). The
            output stays referenced through the backward, as in a loop that keeps ``logits``.
        dtype: the model dtype, torch.float16, torch.bfloat16 or torch.float32.
        chunk_size: bytes per chunk (``None``: searched as ShardedModelV2 does).
        reuse_fp16_shard: as ShardedModelV2's.
        policies: among ``"cuda"``, ``"cpu"``, ``"auto"`` (``auto`` with ``gpu_margin_mem_ratio=0``).
    """
    device_capacity = parse_size(device_memory, "device_memory")
    host_capacity = None if host_memory is None else parse_size(host_memory, "host_memory")
    check_dtype("dtype", dtype)
    check_chunk_size(chunk_size, dtype)
    if not isinstance(reuse_fp16_shard, bool):
        raise ArgumentTypeError("reuse_fp16_shard", reuse_fp16_shard, "True or False")
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
                                       chunk_size, reuse_fp16_shard)
    finally:
        tiers.set_device_memory_capacity(saved_capacity)
    return plans


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


def _optimizer_bytes(policy: Any, model: ShardedModelV2) -> dict[str, dict[str, int]]:
    """The optimizer families' bytes per tier (this rank's shards), by the policy's rule (as
    ShardedOptimizerV2 places them)."""
    out: dict[str, dict[str, int]] = {"device": {}, "host": {}}
    trainable = [c for c in model.chunks if c.trainable]
    families = (("master",) if model.dtype != torch.float32 else ()) + ("exp_avg", "exp_avg_sq")
    for position, chunk in enumerate(trainable):
        tier = "device" if policy.optim_on_device(position, len(trainable)) else "host"
        for family in families:
            out[tier][family] = out[tier].get(family, 0) + chunk.shard_numel * 4
    return out


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
                 reuse_fp16_shard: bool, **placement: Any) -> PolicyPlan:
    """The meta run of one placement (``placement``: ``offload_param_frac`` / ``offload_optim_frac``
    for ``static``). Besides the :class:`PolicyPlan` figures, ``extra`` keeps what the candidates built on
    it need: the meta run's host peak, each chunk's shard bytes and where its parameters and optimizer
    state rest, the collectives of the last iteration."""
    with meta_tiers(), flash_attention_on_meta():
        module = copy.deepcopy(template)
        tiers.set_device_memory_capacity(2**62)  # first the layout, to know the optimizer state's bytes
        probe = ShardedModelV2(module, TensorShardStrategy(), tensor_placement_policy=name, dtype=dtype,
                               chunk_size=chunk_size, reuse_fp16_shard=reuse_fp16_shard, **placement)
        optim = _optimizer_bytes(probe.runtime.policy, probe)
        chunk_bytes, num_chunks = probe.layout.chunk_bytes, len(probe.chunks)
        policy = probe.runtime.policy
        trainable = [c for c in probe.chunks if c.trainable]
        extra: dict[str, Any] = {
            "chunk_numel": probe.layout.chunk_numel, "world": probe.shards.world,
            "param_shard_bytes": [c.shard_numel * c.param.dtype.itemsize for c in probe.chunks],
            "param_on_device": [policy.params_on_device_at_rest(i, num_chunks) for i in range(num_chunks)],
            "trainable_shard_numels": [c.shard_numel for c in trainable],
            "trainable_index": [c.index for c in trainable],
            "optim_on_device": [policy.optim_on_device(k, len(trainable)) for k in range(len(trainable))],
            "has_master": dtype != torch.float32,
        }
        del probe, module, policy, trainable
        optim_device = sum(optim["device"].values())
        tiers.set_device_memory_capacity(max(device_capacity - optim_device, 1))
        result = PolicyPlan(name, True, "fits", {}, 0, chunk_bytes, num_chunks, 0, 0, extra=extra)
        model = None
        try:
            model = ShardedModelV2(copy.deepcopy(template), TensorShardStrategy(), tensor_placement_policy=name,
                                   dtype=dtype, chunk_size=chunk_size, reuse_fp16_shard=reuse_fp16_shard, **placement)
            resting = model.tier_bytes()
            ledger = model.runtime.ledger
            for iteration in range(ITERATIONS):
                if iteration == ITERATIONS - 1:  # the measured iteration: which chunks it fetches
                    model.runtime.executor.events = []
                before = ledger.moved_to_device, ledger.moved_to_host
                sent_before = _bytes_sent()
                out = model(*args)
                loss = loss_fn(out, args[0] if len(args) == 1 else args) if loss_fn else _mean_of(out)
                loss.backward()
                extra["host_peak_meta"] = ledger.peak_host_bytes  # the gradients are still there
                _meta_step(model)
            planner = model.runtime.scheduler
            planner.close_finished_traces()
            result.non_model_peak = max((p.non_model_peak for p in planner.periods or []), default=0)
            result.moved_to_device_per_step = ledger.moved_to_device - before[0]
            fetches = [e[1] for e in model.runtime.executor.events if e[0] == "fetch"]
            extra["fetches"] = [fetches.count(i) for i in range(num_chunks)]
            result.moved_to_host_per_step = ledger.moved_to_host - before[1]
            result.device_peak_bytes = ledger.peak_device_bytes + optim_device
            extra["collective_bytes_sent"] = _bytes_sent() - sent_before
        except DeviceCapacityError as e:
            if model is not None:  # stopped inside an iteration: leave the tracer's counting mode
                planner = model.runtime.scheduler
                if planner.running:
                    planner.interrupt()
                planner.close_finished_traces()
            result.fits, result.reason = False, (f"device: {e} (the meta run had device_memory less the "
                                                 f"{optim_device} bytes of optimizer state resting there)")
            param_total = sum(extra["param_shard_bytes"])
            resting = {"device": {"param": param_total}, "host": {}} if name == "cuda" else \
                {"device": {}, "host": {"param": param_total}}
            extra.setdefault("host_peak_meta", resting["host"].get("param", 0))
            extra["fetches"] = [0] * num_chunks
            extra["collective_bytes_sent"] = 0.0
    result.tier_bytes = {tier: {**resting[tier], **optim[tier]} for tier in ("device", "host")}
    for tier in result.tier_bytes:
        result.tier_bytes[tier] = {f: n for f, n in sorted(result.tier_bytes[tier].items()) if n}
    if result.fits and result.device_peak_bytes + result.non_model_peak > device_capacity:
        result.fits, result.reason = False, (
            f"device: {result.device_peak_bytes} bytes of chunks at the peak and the non-model peak of "
            f"{result.non_model_peak} bytes exceed device_memory={device_capacity}")
    host_total = result.total("host")
    if result.fits and host_capacity is not None and host_total > host_capacity:
        result.fits, result.reason = False, f"host: {host_total} bytes of chunks exceed host_memory={host_capacity}"
    return result


def _meta_step(model: ShardedModelV2) -> None:
    """What a step leaves behind, on the meta run: the gradients released and, with
    ``reuse_fp16_shard``, each chunk's parameter memory written by its update (there are no masters to
    restore it from, as ``zero_grad`` would)."""
    runtime = model.runtime
    if model.reuse_fp16_shard:
        for chunk in runtime.trainable_chunks():
            if chunk.param.holds_grads:
                with runtime.updating(chunk, runtime.compute_tier(chunk)):
                    pass
    runtime.end_step(release_gradients=True)


def _bytes_sent() -> float:
    """Bytes this rank has sent in training collectives so far (ring implementation, see
    :mod:`chunkmem.distributed.traffic`)."""
    return float(sum(bytes_sent(collective, world, count.buffer_bytes)
                     for (_, collective, world), count in traffic().items()))


# ---- candidates: every placement, the disk tier, reuse_fp16_shard; bytes, fit and predicted time ----------

@dataclass
class Candidate(PolicyPlan):
    """One configuration the planner considered: a :class:`PolicyPlan` (bytes per tier, now with
    ``"disk"``; with ``ranks`` > 1 every figure is one rank's, and all ranks hold the same) and more.

    ``name``: a short label (``"static(0.5,0.5)+optim@disk"``). ``settings``: the keyword arguments of
    :class:`~chunkmem.ShardedModelV2` it stands for (``nvme_path`` left out: see :meth:`model_config`).
    ``host_peak_bytes``: the most chunk bytes on the host at once (the gradients before the step, the
    optimizer state and the disk tier's I/O buffers included): what a host capacity must allow.
    ``disk_file_bytes``: what the disk tier's files occupy (preallocated, both slots of an atomic step):
    what the disk budget must allow. ``disk_read_per_step`` / ``disk_written_per_step``: bytes the disk
    tier reads and writes in one step (forward, backward and optimizer step). ``collective_bytes_per_step``:
    bytes this rank sends in the training collectives of one step (ring implementation). ``time``: the
    predicted :class:`~chunkmem.cost_model.StepTime` in seconds (``None`` when the profile lacks a figure
    it needs, e.g. no disk bandwidth). ``recommended``: the one :func:`choose` recommends.
    ``cost_inputs``: what the cost model was given besides the compute (bytes copied, Adam elements, disk
    bytes, collective bytes: :func:`chunkmem.cost_model.step_time`'s arguments).
    """

    name: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    ranks: int = 1
    host_peak_bytes: int = 0
    disk_file_bytes: int = 0
    disk_read_per_step: int = 0
    disk_written_per_step: int = 0
    collective_bytes_per_step: float = 0.0
    time: StepTime | None = None
    recommended: bool = False
    cost_inputs: dict[str, Any] = field(default_factory=dict)

    def predict(self, profile: MachineProfile, compute_seconds: float) -> StepTime | None:
        """The step time again from another ``profile`` and the seconds of the forward and backward's
        operators (``PlanChoice.compute_seconds``, or :meth:`ComputeTrace.seconds
        <chunkmem.cost_model.ComputeTrace.seconds>` under that profile): the same cost model, the same
        counted bytes and elements (``cost_inputs``)."""
        return step_time(profile, compute_seconds, self.settings["dtype"], **self.cost_inputs)

    def total(self, tier: str) -> int:
        """Bytes on ``tier`` ("device", "host" or "disk") over all families."""
        return sum(self.tier_bytes.get(tier, {}).values())

    @property
    def seconds_per_step(self) -> float | None:
        """The predicted seconds of one training step (``None``: not predicted)."""
        return None if self.time is None else self.time.total

    @property
    def uses_disk(self) -> bool:
        return self.settings.get("offload_optimizer") == "disk" or self.settings.get("offload_param") == "disk"

    def model_config(self, nvme_path: str | os.PathLike | None = None) -> dict[str, Any]:
        """The keyword arguments of :class:`~chunkmem.ShardedModelV2` this candidate stands for
        (``shard_strategy`` aside); ``nvme_path``: the disk tier's directory, needed when it uses it."""
        config = dict(self.settings)
        if self.uses_disk:
            if nvme_path is None:
                raise InvalidArgumentError("nvme_path", nvme_path, f"a directory: candidate {self.name} uses the "
                                                                   "disk tier")
            config["nvme_path"] = os.fspath(nvme_path)
        return config

    def config(self, nvme_path: str | os.PathLike | None = None) -> dict[str, Any]:
        """A :func:`chunkmem.initialize` configuration (ColossalAI form) for this candidate:
        ``chunkmem.initialize(model, optimizer, config=candidate.config(nvme_path))``, or
        ``chunkmem.initialize(model, optimizer, plan=candidate)`` without the disk tier. Set the
        capacities it was planned for (``set_device_memory_capacity`` / ``set_host_memory_capacity``)
        before, so that ``auto`` and the disk tier plan against the same budgets."""
        model_config = self.model_config(nvme_path)
        model_config["dtype"] = dtype_name(model_config["dtype"])
        return {"zero": {"model_config": model_config, "optimizer_config": {}}}


@dataclass
class PlanChoice:
    """What :func:`choose` returns: every ``candidates`` (in the order considered), the ``recommended``
    one (the fastest predicted that fits; ``None`` when none fits), the ``profile`` the times come from
    and ``compute_seconds``, the predicted seconds of one forward and backward's operators."""

    candidates: list[Candidate]
    recommended: Candidate | None
    profile: MachineProfile
    compute_seconds: float

    def table(self) -> str:
        """The candidates as a text table (MiB, seconds; the recommendation marked ``<==``)."""
        return format_candidates(self.candidates)


def format_candidates(candidates: Sequence[Candidate]) -> str:
    """Candidates as a text table: bytes per tier in MiB (one rank's), predicted seconds per step, fits."""
    mib = 2**20
    width = max([len(c.name) for c in candidates] + [9])
    lines = [f"{'candidate':<{width}} {'fits':<5} {'s/step':>8} {'device MiB':>11} {'host MiB':>10} "
             f"{'host peak':>10} {'disk MiB':>10} {'disk files':>11} {'non-model':>10}  "]
    for c in candidates:
        seconds = "-" if c.seconds_per_step is None else f"{c.seconds_per_step:.3f}"
        lines.append(f"{c.name:<{width}} {'yes' if c.fits else 'no':<5} {seconds:>8} {c.total('device') / mib:11.1f} "
                     f"{c.total('host') / mib:10.1f} {c.host_peak_bytes / mib:10.1f} {c.total('disk') / mib:10.1f} "
                     f"{c.disk_file_bytes / mib:11.1f} {c.non_model_peak / mib:10.1f}"
                     + ("  <== recommended" if c.recommended else ""))
    for c in candidates:
        if not c.fits:
            lines.append(f"{c.name}: does not fit: {c.reason}")
        elif c.time is None:
            lines.append(f"{c.name}: no predicted time ({c.reason})")
    return "\n".join(lines)


def choose(model_or_builder: nn.Module | Callable[[], nn.Module], sample_batch: Any, device_memory: int | str,
           host_memory: int | str | None = None, disk_memory: int | str | None = None, *, ranks: int = 1,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, dtype: torch.dtype = torch.float16,
           profile: MachineProfile | None = None, nvme_path: str | os.PathLike | None = None,
           chunk_size: int | None = None, static_fractions: Sequence[tuple[float, float]] = ((0.5, 0.5),),
           reuse_fp16_shard: bool | None = None, buffer_count: int = DEFAULT_BUFFER_COUNT,
           buffer_size: int = DEFAULT_BUFFER_SIZE, atomic_step: bool = True,
           measure_operators: bool | None = None,
           policies: Sequence[str] = ("cuda", "cpu", "auto", "static")) -> PlanChoice:
    """Plan every candidate configuration and recommend the fastest predicted one that fits the budgets.

    The candidates: placements ``cuda``, ``cpu``, ``auto`` and ``static`` (one per pair of
    ``(offload_param_frac, offload_optim_frac)`` in ``static_fractions``), each with
    ``reuse_fp16_shard`` off and on (16-bit dtypes), and, when ``disk_memory`` is given, the placements
    off the device with the optimizer state, the parameters, or both on the disk tier. Each is run on the
    meta device as :func:`plan` does (exact bytes per tier and family, now with the disk tier, and per rank
    with ``ranks`` > 1: the meta run then shards the chunks over a stand-in process group of ``ranks``),
    checked against the budgets, and timed by :mod:`chunkmem.cost_model` from ``profile``.

    Args:
        model_or_builder, sample_batch, loss_fn, dtype: as :func:`plan`; ``sample_batch`` is one rank's batch.
        device_memory: the device tier's capacity in bytes per rank (an int or a size like ``"24GiB"``).
        host_memory: the host tier's capacity in bytes per rank (``None``: unbounded).
        disk_memory: bytes the disk tier's files may occupy per rank (``None``: no disk candidates).
        ranks: data-parallel processes (ZeRO-3 over all of them), >= 1.
        profile: the machine's throughputs (:class:`~chunkmem.machine_profile.MachineProfile`); ``None``:
            measured here (a few seconds; the disk on ``nvme_path`` when given, gloo when ``ranks`` > 1).
        nvme_path: the disk tier's directory (for the measurement; :meth:`Candidate.config` takes it too).
        chunk_size: bytes per chunk (``None``: searched per candidate as ShardedModelV2 does).
        static_fractions: ``(offload_param_frac, offload_optim_frac)`` pairs in [0, 1] for ``static``
            (empty: no ``static`` candidate).
        reuse_fp16_shard: ``None``: both (16-bit) or off (fp32); a bool: only that.
        buffer_count, buffer_size, atomic_step: the disk tier's, as ShardedModelV2's.
        measure_operators: time the traced iteration's operators one by one on this machine (the compute
            part of the cost model; a few seconds, kept in ``profile.op_seconds``); ``None``: when the
            profile is measured here. Without it, FLOPs and bytes at the profile's rates estimate them.
        policies: the placements considered, among ``"cuda"``, ``"cpu"``, ``"auto"``, ``"static"``.
    """
    device_capacity = parse_size(device_memory, "device_memory")
    host_capacity = None if host_memory is None else parse_size(host_memory, "host_memory")
    disk_capacity = None if disk_memory is None else parse_size(disk_memory, "disk_memory")
    check_dtype("dtype", dtype)
    check_chunk_size(chunk_size, dtype)
    check_number("ranks", ranks, low=1, integer=True)
    if profile is not None and not isinstance(profile, MachineProfile):
        raise ArgumentTypeError("profile", type(profile).__name__, "a chunkmem.machine_profile.MachineProfile or None")
    pairs_allowed = "a sequence of (offload_param_frac, offload_optim_frac) pairs, each in [0, 1]"
    if isinstance(static_fractions, (str, bytes)) or not isinstance(static_fractions, (list, tuple)):
        raise InvalidArgumentError("static_fractions", static_fractions, pairs_allowed)
    for pair in static_fractions:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidArgumentError("static_fractions", static_fractions, pairs_allowed)
        for value in pair:
            check_number("static_fractions", value, low=0.0, high=1.0)
    if reuse_fp16_shard is not None and not isinstance(reuse_fp16_shard, bool):
        raise ArgumentTypeError("reuse_fp16_shard", reuse_fp16_shard, "None, True or False")
    if reuse_fp16_shard and dtype == torch.float32:
        raise InvalidArgumentError("reuse_fp16_shard", reuse_fp16_shard, "None or False with dtype=torch.float32")
    check_disk_arguments(None, None, None, buffer_count, buffer_size, atomic_step, "cpu", False)
    if nvme_path is not None and (not isinstance(nvme_path, (str, os.PathLike)) or not os.path.isdir(nvme_path)):
        raise InvalidArgumentError("nvme_path", nvme_path, "None or an existing directory (str or os.PathLike)")
    if isinstance(policies, str) or not policies:
        raise InvalidArgumentError("policies", policies, "a non-empty sequence of 'cuda', 'cpu', 'auto', 'static'")
    for name in policies:
        check_choice("policies", name, ("cuda", "cpu", "auto", "static"))
    if measure_operators is not None and not isinstance(measure_operators, bool):
        raise ArgumentTypeError("measure_operators", measure_operators, "None, True or False")
    if dist.is_available() and dist.is_initialized() and (ranks > 1 or dist.get_world_size() > 1):
        raise UnsupportedOperationError("chunkmem.choose plans from one process (ranks= says how many it plans "
                                        "for); call it before init_process_group (or in a process without one)")
    args = _meta_inputs(model_or_builder, sample_batch, loss_fn)
    template = _meta_model(model_or_builder)
    if profile is None:
        profile = MachineProfile.measure(dtypes=(dtype,), nvme_path=nvme_path if disk_capacity is not None else None,
                                         ranks=ranks)
        measure_operators = True if measure_operators is None else measure_operators
    compute = trace_compute(template, args, loss_fn, dtype)
    if measure_operators:
        profile.measure_operators(compute.replays())
    compute_seconds = compute.seconds(profile)

    reuse_options = (reuse_fp16_shard,) if reuse_fp16_shard is not None else \
        ((False,) if dtype == torch.float32 else (False, True))
    bases: list[tuple[str, dict[str, float]]] = [(name, {}) for name in ("cuda", "cpu", "auto") if name in policies]
    if "static" in policies:
        bases += [("static", {"offload_param_frac": float(p), "offload_optim_frac": float(o)})
                  for p, o in static_fractions]
    disk = _DiskSettings(buffer_count, buffer_size, atomic_step)
    saved_capacity = tiers.device_memory_capacity_setting()
    candidates: list[Candidate] = []
    try:
        with _stand_in_group(ranks):
            for reuse in reuse_options:
                for policy, fractions in bases:
                    base = _plan_policy(policy, template, args, loss_fn, device_capacity, None, dtype, chunk_size,
                                        reuse, **fractions)
                    for optim_disk, param_disk in _disk_variants(policy, base, reuse, disk_capacity is not None):
                        candidates.append(_candidate(base, policy, fractions, reuse, optim_disk, param_disk, disk,
                                                     dtype, chunk_size, ranks, host_capacity, disk_capacity, profile,
                                                     compute_seconds))
    finally:
        tiers.set_device_memory_capacity(saved_capacity)
    timed = [c for c in candidates if c.fits and c.time is not None]
    recommended = min(timed, key=lambda c: c.time.total) if timed else None
    if recommended is not None:
        recommended.recommended = True
    return PlanChoice(candidates, recommended, profile, compute_seconds)


@dataclass(frozen=True)
class _DiskSettings:
    buffer_count: int
    buffer_size: int
    atomic_step: bool


@contextmanager
def _stand_in_group(ranks: int) -> Iterator[None]:
    """With ``ranks`` > 1, a stand-in process group of that size for the meta runs (PyTorch's ``fake``
    backend: collectives return at once; chunkmem shards, counts and agrees as on real ranks)."""
    if ranks == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _disk_variants(policy: str, base: PolicyPlan, reuse: bool, with_disk: bool) -> list[tuple[bool, bool]]:
    """``(optimizer on disk, parameters on disk)`` pairs that make sense for the base placement."""
    variants = [(False, False)]
    if not with_disk or policy == "cuda":
        return variants
    optim_off = not all(base.extra["optim_on_device"])
    params_off = not all(base.extra["param_on_device"])
    if optim_off:
        variants.append((True, False))
    if params_off and not reuse:
        variants.append((False, True))
        if optim_off:
            variants.append((True, True))
    return variants


def _candidate(base: PolicyPlan, policy: str, fractions: dict[str, float], reuse: bool, optim_disk: bool,
               param_disk: bool, disk: _DiskSettings, dtype: torch.dtype, chunk_size: int | None, ranks: int,
               host_capacity: int | None, disk_capacity: int | None, profile: MachineProfile,
               compute_seconds: float) -> Candidate:
    ex = base.extra
    has_master = ex["has_master"]
    families = (("master",) if has_master else ()) + ("exp_avg", "exp_avg_sq")
    settings: dict[str, Any] = {"tensor_placement_policy": policy, "dtype": dtype,
                                "chunk_size": base.chunk_bytes if chunk_size is None else chunk_size,
                                "reuse_fp16_shard": reuse, **fractions}
    name = policy + (f"({fractions['offload_param_frac']:g},{fractions['offload_optim_frac']:g})" if fractions else "")
    if optim_disk:
        settings["offload_optimizer"] = "disk"
        name += "+optim@disk"
    if param_disk:
        settings["offload_param"] = "disk"
        name += "+param@disk"
    if optim_disk or param_disk:
        settings.update(buffer_count=disk.buffer_count, buffer_size=disk.buffer_size, atomic_step=disk.atomic_step)
    if reuse:
        name += "+reuse"
    tier_bytes = {"device": dict(base.tier_bytes["device"]), "host": dict(base.tier_bytes["host"]), "disk": {}}
    param_host = tier_bytes["host"].get("param", 0)
    shard_bytes = ex["param_shard_bytes"]
    param_kept: frozenset[int] = frozenset()  # auto with a host capacity: parameters resting on the host
    if param_disk and policy == "auto" and host_capacity is not None:
        trainable_flags = [i in set(ex["trainable_index"]) for i in range(base.num_chunks)]
        param_kept = param_chunks_kept_on_host(shard_bytes, trainable_flags, dtype.itemsize, host_capacity,
                                               disk.buffer_count, disk.buffer_size)
    kept_param_bytes = sum(shard_bytes[i] for i in param_kept)
    params_to_disk = param_disk and len(param_kept) < base.num_chunks
    if param_disk:
        tier_bytes["host"]["param"] = kept_param_bytes
        tier_bytes["disk"]["param"] = param_host - kept_param_bytes
    # the optimizer state off the device: on the host, or on disk (under auto with a host capacity the
    # first chunks that fit stay on the host, as ShardedOptimizerV2 decides)
    numels, on_device = ex["trainable_shard_numels"], ex["optim_on_device"]
    off = [k for k, on in enumerate(on_device) if not on]
    streamed = streamed_count(len(ADAM_STATE), has_master, param_disk, disk.atomic_step)
    io = aligned_nbytes(disk.buffer_size)
    kept = len(off)
    if optim_disk:
        kept = 0
        if policy == "auto" and host_capacity is not None and numels:
            state_bytes = len(families) * numels[0] * 4
            grads = 0 if reuse else len(numels) * numels[0] * dtype.itemsize
            host_now = param_host if not param_disk else kept_param_bytes + (io if params_to_disk else 0)
            free = host_capacity - host_now - grads - disk.buffer_count * streamed * disk.buffer_size
            kept = min(max(free, 0) // state_bytes, len(numels))
    for family in families:
        tier_bytes["host"].pop(family, None)
    on_disk_numel, optim_on_disk = 0, set()
    for position, k in enumerate(off):
        tier = "host" if position < kept else "disk"
        on_disk_numel += numels[k] if tier == "disk" else 0
        if tier == "disk":
            optim_on_disk.add(k)
        for family in families:
            tier_bytes[tier][family] = tier_bytes[tier].get(family, 0) + numels[k] * 4
    disk_io = 0
    if on_disk_numel or params_to_disk:  # (the optimizer "on disk" with every chunk's state on the host: none)
        disk_io = io  # the in-line buffer (the initial values written to the files, whole-region reads)
        # the streamed step's pool: buffers for the parameters too if a chunk it streams has them on disk
        params_streamed = any(ex["trainable_index"][k] not in param_kept for k in optim_on_disk) and param_disk
        pool = disk.buffer_count * io * streamed_count(len(ADAM_STATE), has_master, params_streamed,
                                                        disk.atomic_step)
        disk_io += pool if on_disk_numel else 0
        disk_io += io if params_to_disk else 0  # the fetch thread's buffer
        tier_bytes["host"]["disk_io"] = disk_io
    for tier in tier_bytes:
        tier_bytes[tier] = {f: n for f, n in sorted(tier_bytes[tier].items()) if n}
    if not (optim_disk or param_disk):
        del tier_bytes["disk"]

    # the disk tier's files and traffic
    world = ex["world"]
    slots = 2 if disk.atomic_step else 1
    shard = ex["chunk_numel"] // world
    files = 0
    if param_disk:  # regions for the chunks whose parameters rest on disk only
        files += aligned_nbytes(base.chunk_bytes // world) * slots * (base.num_chunks - len(param_kept))
    if optim_disk:  # regions for the chunks whose state rests on disk only
        files += len(families) * aligned_nbytes(shard * 4) * slots * len(optim_on_disk)
        if not has_master and disk.atomic_step:
            files += aligned_nbytes(shard * 4) * len(optim_on_disk)
    element = dtype.itemsize
    read = written = read_compute = 0
    moved_to_device, moved_to_host = base.moved_to_device_per_step, base.moved_to_host_per_step
    if param_disk:  # the forward's and backward's fetches of chunks resting on disk come from the files
        fetched = [0 if ex["param_on_device"][i] else n * shard_bytes[i] for i, n in enumerate(ex["fetches"])]
        read_compute = sum(b for i, b in enumerate(fetched) if i not in param_kept)
        moved_to_device = sum(b for i, b in enumerate(fetched) if i in param_kept)
    if optim_disk:
        read += len(families) * on_disk_numel * 4
        written += len(families) * on_disk_numel * 4
    # parameter chunks on disk: the step writes each back; it reads it too, except where the streamed
    # step (the chunk's optimizer state on disk) writes 16-bit parameters as its output; one updated
    # outside the streamed step is read into host memory first
    param_chunks = [(k, i) for k, i in enumerate(ex["trainable_index"])
                    if param_disk and not ex["param_on_device"][i] and i not in param_kept]
    written += sum(ex["param_shard_bytes"][i] for _, i in param_chunks)
    read += sum(ex["param_shard_bytes"][i] for k, i in param_chunks if not (has_master and k in optim_on_disk))
    loaded = [ex["param_shard_bytes"][i] for k, i in param_chunks if k not in optim_on_disk]
    host_peak = ex["host_peak_meta"] - (param_host - kept_param_bytes if param_disk else 0) + sum(
        n for f, n in tier_bytes["host"].items() if f in families) + disk_io
    host_peak += max(loaded, default=0)
    # a chunk whose parameters rest on the device and whose Adam runs on the host ('static') is updated in
    # a host copy of its parameters: one at a time, or all of them in the streamed disk step
    copies = [ex["param_shard_bytes"][i] for k, i in enumerate(ex["trainable_index"])
              if ex["param_on_device"][i] and not on_device[k]]
    host_peak += sum(copies) if optim_disk else max(copies, default=0)

    cost_inputs = dict(moved_bytes=moved_to_device + moved_to_host, adam_elements=sum(numels),
                       disk_adam_elements=on_disk_numel, disk_read_step=read, disk_written_step=written,
                       disk_read_compute=read_compute, collective_bytes_sent=ex["collective_bytes_sent"])
    time = step_time(profile, compute_seconds, dtype, **cost_inputs)
    fits, reason = base.fits, base.reason
    if fits and host_capacity is not None and host_peak > host_capacity:
        fits, reason = False, f"host: a peak of {host_peak} bytes of chunks exceeds host_memory={host_capacity}"
    if fits and disk_capacity is not None and files > disk_capacity:
        fits, reason = False, f"disk: the files need {files} bytes, more than disk_memory={disk_capacity}"
    if fits and time is None:
        reason = "the profile has no disk bandwidth" if (read or written or read_compute) else \
            "the profile has no collective bandwidth"
    return Candidate(policy, fits, reason, tier_bytes, base.non_model_peak, base.chunk_bytes, base.num_chunks,
                     moved_to_device, moved_to_host, base.device_peak_bytes, dict(ex), name=name, settings=settings,
                     ranks=ranks, host_peak_bytes=host_peak, disk_file_bytes=files,
                     disk_read_per_step=read + read_compute, disk_written_per_step=written, collective_bytes_per_step=ex["collective_bytes_sent"], time=time,
                     cost_inputs=cost_inputs)


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


PRESETS = {  # (vocab, d_model, layers, heads)
    "tiny": (512, 256, 4, 4), "gpt2-small": (50257, 768, 12, 12), "gpt2-medium": (50257, 1024, 24, 16),
    "gpt2-large": (50257, 1280, 36, 20), "gpt2-xl": (50257, 1600, 48, 25),
}


def _main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chunkmem.plan", description="Will it fit? Plan one training "
                                "step per placement policy without allocating the model.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="a GPT of chunkmem.gpt (the benchmarks' model) in this shape")
    p.add_argument("--builder", default=None, help="MODULE:FUNCTION building the model instead of --preset "
                                                   "(called with no argument; the batch is token ids)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="token id range of the batch (default: the preset's)")
    p.add_argument("--device-memory", required=True, help="device tier capacity, e.g. 24GiB")
    p.add_argument("--host-memory", default=None, help="host tier capacity, e.g. 64GiB (default: unbounded)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--chunk-size", type=int, default=None, help="bytes per chunk (default: searched)")
    p.add_argument("--candidates", action="store_true",
                   help="plan every candidate (placements, static fractions, the disk tier, reuse_fp16_shard) with "
                        "a predicted time per step, and mark the fastest that fits")
    p.add_argument("--disk-memory", default=None, help="with --candidates: bytes the disk tier's files may use, "
                                                       "e.g. 200GiB (default: no disk candidates)")
    p.add_argument("--nvme-path", default=None, help="with --candidates: the disk tier's directory (its bandwidth "
                                                     "is measured there)")
    p.add_argument("--ranks", type=int, default=1, help="with --candidates: data-parallel processes (bytes per rank)")
    p.add_argument("--static-fractions", default="0.5:0.5",
                   help="with --candidates: offload_param_frac:offload_optim_frac pairs for 'static', comma-separated "
                        "('' for none)")
    p.add_argument("--profile", default=None, help="with --candidates: a MachineProfile JSON file to use instead "
                                                   "of measuring this machine")
    p.add_argument("--save-profile", default=None, help="with --candidates: write the profile used (with the "
                                                        "operators measured) to this JSON file")
    args = p.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.builder:
        module_name, _, function = args.builder.partition(":")
        builder = getattr(importlib.import_module(module_name), function)
        vocab = args.vocab or 2
    else:
        vocab_size, d_model, layers, heads = PRESETS[args.preset]
        def builder() -> nn.Module:
            return GPT(GPTConfig(vocab_size, d_model, layers, heads, args.seq_len))
        vocab = args.vocab or vocab_size
    batch = torch.randint(0, vocab, (args.batch_size, args.seq_len))
    if not args.candidates:
        print(format_table(plan(builder, batch, args.device_memory, args.host_memory, dtype=dtype,
                                chunk_size=args.chunk_size)))
        return
    profile = None
    if args.profile:
        with open(args.profile) as f:
            profile = MachineProfile.from_dict(json.load(f))
    fractions = tuple(tuple(float(x) for x in pair.split(":")) for pair in args.static_fractions.split(",") if pair)
    choice = choose(builder, batch, args.device_memory, args.host_memory, args.disk_memory, ranks=args.ranks,
                    dtype=dtype, profile=profile, nvme_path=args.nvme_path, chunk_size=args.chunk_size,
                    static_fractions=fractions)
    if args.save_profile:
        with open(args.save_profile, "w") as f:
            json.dump(choice.profile.to_dict(), f)
    print(choice.table())
    if choice.recommended is None:
        print("nothing fits these budgets")


if __name__ == "__main__":
    _main()
