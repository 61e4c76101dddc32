""":func:`choose`: every candidate configuration planned on the meta runs of :mod:`chunkmem.plan.meta_run`.

Placements ``cuda``, ``cpu``, ``auto``, ``static`` with offload fractions; the disk tier for the optimizer state
and/or the parameters; ``reuse_fp16_shard``; for one rank or several (the meta run then shards over a stand-in
process group); with gradient accumulation (several forward/backward passes per step, their 16-bit gradient
sums in fp32 unless ``grad_accum_dtype`` says otherwise). Each is checked against device, host and disk budgets,
its seconds per step predicted with :mod:`chunkmem.plan.cost_model` from a
:class:`~chunkmem.plan.machine_profile.MachineProfile` measured on this machine, and the fastest that fits
recommended (:class:`PlanChoice`); a :class:`Candidate` gives the :class:`~chunkmem.ShardedModelV2` settings
it stands for, which ``chunkmem.initialize(..., plan=)`` takes.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import tiers
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedOperationError
from ..errors import check_choice, check_number
from ..core.disk_tier import DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, check_disk_arguments
from ..storage.disk_io import aligned_nbytes
from .machine_profile import MachineProfile, dtype_name
from .cost_model import StepTime, step_time, trace_compute
from ..settings import check_chunk_size, check_dtype
from ..core.chunk import ADAM_STATE
from ..optim.low_bit_rule import LOW_BIT_FAMILIES
from ..optim.disk_step import streamed_count
from ..model.builder import param_chunks_kept_on_host
from ..core.tiers import parse_size
from .meta_run import OPTIMIZER_STATES, PolicyPlan, _meta_inputs, _meta_model, _plan_policy, check_accumulation


@dataclass
class Candidate(PolicyPlan):
    """One configuration the planner considered: a :class:`PolicyPlan` (bytes per tier, now with
    ``"disk"``; with ``ranks`` > 1 every figure is one rank's, and all ranks hold the same) and more.

    ``name``: a short label (``"static(0.5,0.5)+optim@disk"``). ``settings``: the keyword arguments of
    :class:`~chunkmem.ShardedModelV2` it stands for (``nvme_path`` left out: see :meth:`model_config`;
    ``grad_accum_dtype`` there when :func:`choose` was given one).
    ``host_peak_bytes``: the most chunk bytes on the host at once (the gradients before the step, widened
    to fp32 when they accumulate over several backwards, the optimizer state and the disk tier's I/O buffers
    included): what a host capacity must allow.
    ``disk_file_bytes``: what the disk tier's files occupy (preallocated, both slots of an atomic step):
    what the disk budget must allow. ``disk_read_per_step`` / ``disk_written_per_step``: bytes the disk
    tier reads and writes in one step (forward, backward and optimizer step). ``collective_bytes_per_step``:
    bytes this rank sends in the training collectives of one step (ring implementation). ``time``: the
    predicted :class:`~chunkmem.plan.cost_model.StepTime` in seconds (``None`` when the profile lacks a figure
    it needs, e.g. no disk bandwidth). ``recommended``: the one :func:`choose` recommends.
    ``cost_inputs``: what the cost model was given besides the compute (bytes copied, Adam elements, disk
    bytes, collective bytes: :func:`chunkmem.plan.cost_model.step_time`'s arguments), all per step, i.e. over its
    ``gradient_accumulation_steps`` forward/backward passes. ``optimizer_state``: the Adam moments it was planned
    with, ``"fp32"`` or ``"8bit"`` (train it with ``HybridAdam(..., state_dtype="8bit")`` or torchao's
    ``AdamW8bit`` / ``Adam8bit``: ``chunkmem.initialize(..., plan=)`` refuses another optimizer).
    """

    name: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    ranks: int = 1
    disk_file_bytes: int = 0
    disk_read_per_step: int = 0
    disk_written_per_step: int = 0
    collective_bytes_per_step: float = 0.0
    time: StepTime | None = None
    recommended: bool = False
    cost_inputs: dict[str, Any] = field(default_factory=dict)
    optimizer_state: str = "fp32"

    def predict(self, profile: MachineProfile, compute_seconds: float) -> StepTime | None:
        """The step time again from another ``profile`` and the seconds of one forward and backward's
        operators (``PlanChoice.compute_seconds``, or :meth:`ComputeTrace.seconds
        <chunkmem.plan.cost_model.ComputeTrace.seconds>` under that profile; a step runs
        ``gradient_accumulation_steps`` of them): the same cost model, the same counted bytes and elements
        (``cost_inputs``)."""
        return step_time(profile, compute_seconds * self.gradient_accumulation_steps, self.settings["dtype"],
                         **self.cost_inputs)

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
        if model_config.get("grad_accum_dtype") is not None:
            model_config["grad_accum_dtype"] = dtype_name(model_config["grad_accum_dtype"])
        return {"zero": {"model_config": model_config, "optimizer_config": {}}}


@dataclass
class PlanChoice:
    """What :func:`choose` returns: every ``candidates`` (in the order considered), the ``recommended``
    one (the fastest predicted that fits; ``None`` when none fits), the ``profile`` the times come from
    and ``compute_seconds``, the predicted seconds of one forward and backward's operators (a step runs
    ``gradient_accumulation_steps`` of them)."""

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
           policies: Sequence[str] = ("cuda", "cpu", "auto", "static"), gradient_accumulation_steps: int = 1,
           grad_accum_dtype: torch.dtype | None = None, optimizer_states: Sequence[str] = ("fp32",)) -> PlanChoice:
    """Plan every candidate configuration and recommend the fastest predicted one that fits the budgets.

    The candidates: placements ``cuda``, ``cpu``, ``auto`` and ``static`` (one per pair of
    ``(offload_param_frac, offload_optim_frac)`` in ``static_fractions``), each with
    ``reuse_fp16_shard`` off and on (16-bit dtypes), and, when ``disk_memory`` is given, the placements
    off the device with the optimizer state, the parameters, or both on the disk tier. Each is run on the
    meta device as :func:`plan` does (exact bytes per tier and family, now with the disk tier, and per rank
    with ``ranks`` > 1: the meta run then shards the chunks over a stand-in process group of ``ranks``),
    checked against the budgets, and timed by :mod:`chunkmem.plan.cost_model` from ``profile``. A candidate fits
    when its device peak (``device_peak_bytes`` and the non-model peak) is within ``device_memory``, its host
    peak (``host_peak_bytes``) within ``host_memory`` and its files within ``disk_memory``; with
    ``gradient_accumulation_steps`` > 1 both peaks include the gradient sums widened to fp32.

    Args:
        model_or_builder, sample_batch, loss_fn, dtype: as :func:`plan`; ``sample_batch`` is one rank's batch.
        device_memory: the device tier's capacity in bytes per rank (an int or a size like ``"24GiB"``).
        host_memory: the host tier's capacity in bytes per rank (``None``: unbounded).
        disk_memory: bytes the disk tier's files may occupy per rank (``None``: no disk candidates).
        ranks: data-parallel processes (ZeRO-3 over all of them), >= 1.
        profile: the machine's throughputs (:class:`~chunkmem.plan.machine_profile.MachineProfile`); ``None``:
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
        gradient_accumulation_steps, grad_accum_dtype: as :func:`plan` (forward/backward passes per step,
            an int >= 1; what 16-bit gradients of several backwards are summed in): every meta run takes
            that many passes per step, so the peaks, the fits and the bytes moved per step count the
            accumulated (by default fp32) gradients, and the predicted step time that many passes' compute.
            With more than 1 the ``reuse_fp16_shard`` candidates are left out (``reuse_fp16_shard=True`` is
            refused): their gradients cannot accumulate.
        optimizer_states: the Adam moments considered, among ``"fp32"`` (the default: ``HybridAdam``, torch's
            Adam) and ``"8bit"`` (``HybridAdam(state_dtype="8bit")``, torchao's ``AdamW8bit``: a different
            optimizer, so only when asked for). Every placement is planned with each; an 8-bit candidate's
            optimizer bytes are :func:`plan`'s with ``optimizer_state="8bit"`` (its name ends in ``+8bit``); it is
            for one rank (``ranks`` > 1 refused, as ShardedOptimizerV2 refuses it), without disk variants (not
            counted yet), its update predicted at the profile's Adam rate.
    """
    device_capacity = parse_size(device_memory, "device_memory")
    host_capacity = None if host_memory is None else parse_size(host_memory, "host_memory")
    disk_capacity = None if disk_memory is None else parse_size(disk_memory, "disk_memory")
    _check_choose_arguments(dtype, chunk_size, ranks, profile, static_fractions, reuse_fp16_shard,
                            gradient_accumulation_steps, grad_accum_dtype, buffer_count, buffer_size, atomic_step,
                            nvme_path, policies, measure_operators, optimizer_states)
    args = _meta_inputs(model_or_builder, sample_batch, loss_fn)
    template = _meta_model(model_or_builder)
    profile, compute_seconds = _profile_and_compute(template, args, loss_fn, dtype, profile, measure_operators,
                                                    nvme_path if disk_capacity is not None else None, ranks)
    reuse_options = (reuse_fp16_shard,) if reuse_fp16_shard is not None else \
        ((False,) if dtype == torch.float32 or gradient_accumulation_steps > 1 else (False, True))
    shared = _Shared(_DiskSettings(buffer_count, buffer_size, atomic_step), dtype, chunk_size, ranks, host_capacity,
                     disk_capacity, profile, compute_seconds, grad_accum_dtype)
    bases = _placements(policies, static_fractions)
    candidates = _plan_candidates(template, args, loss_fn, device_capacity, gradient_accumulation_steps,
                                  reuse_options, bases, tuple(optimizer_states), shared)
    timed = [c for c in candidates if c.fits and c.time is not None]
    recommended = min(timed, key=lambda c: c.time.total) if timed else None
    if recommended is not None:
        recommended.recommended = True
    return PlanChoice(candidates, recommended, profile, compute_seconds)


def _profile_and_compute(template: nn.Module, args: Any, loss_fn: Any, dtype: torch.dtype,
                         profile: MachineProfile | None, measure_operators: bool | None, nvme_path: Any,
                         ranks: int) -> tuple[MachineProfile, float]:
    """The machine's profile (``None``: measured here, the disk on ``nvme_path`` when given; then the traced
    operators are timed too unless ``measure_operators`` is ``False``) and one forward and backward's compute
    seconds on it."""
    if profile is None:
        profile = MachineProfile.measure(dtypes=(dtype,), nvme_path=nvme_path, ranks=ranks)
        measure_operators = True if measure_operators is None else measure_operators
    compute = trace_compute(template, args, loss_fn, dtype)
    if measure_operators:
        profile.measure_operators(compute.replays())
    return profile, compute.seconds(profile)


def _plan_candidates(template: nn.Module, args: Any, loss_fn: Any, device_capacity: int,
                     gradient_accumulation_steps: int, reuse_options: Sequence[bool],
                     bases: list[tuple[str, dict[str, float]]], optimizer_states: tuple[str, ...],
                     shared: "_Shared") -> list[Candidate]:
    """Every candidate: one meta run per optimizer state, ``reuse_fp16_shard`` option and placement (on a stand-in
    process group with several ranks), then each of its disk variants (none with 8-bit state). The device capacity
    setting is restored after."""
    saved_capacity = tiers.device_memory_capacity_setting()
    candidates: list[Candidate] = []
    try:
        with _stand_in_group(shared.ranks):
            for state in optimizer_states:
                for reuse in reuse_options:
                    for policy, fractions in bases:
                        base = _plan_policy(policy, template, args, loss_fn, device_capacity, None, shared.dtype,
                                            shared.chunk_size, reuse, gradient_accumulation_steps,
                                            shared.grad_accum_dtype, optimizer_state=state, **fractions)
                        with_disk = shared.disk_capacity is not None and state == "fp32"
                        for optim_disk, param_disk in _disk_variants(policy, base, reuse, with_disk):
                            candidates.append(_candidate(base, policy, fractions, reuse, optim_disk, param_disk,
                                                         shared, state))
    finally:
        tiers.set_device_memory_capacity(saved_capacity)
    return candidates


def _check_choose_arguments(dtype: torch.dtype, chunk_size: int | None, ranks: int, profile: Any,
                            static_fractions: Any, reuse_fp16_shard: Any, gradient_accumulation_steps: int,
                            grad_accum_dtype: torch.dtype | None, buffer_count: int, buffer_size: int,
                            atomic_step: bool, nvme_path: Any, policies: Any, measure_operators: Any,
                            optimizer_states: Any = ("fp32",)) -> None:
    """:func:`choose`'s checks of its arguments (the budgets are parsed by :func:`choose`), before anything runs."""
    check_dtype("dtype", dtype)
    check_chunk_size(chunk_size, dtype)
    check_number("ranks", ranks, low=1, integer=True)
    if profile is not None and not isinstance(profile, MachineProfile):
        raise ArgumentTypeError("profile", type(profile).__name__, "a chunkmem.plan.machine_profile.MachineProfile or None")
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
    check_accumulation(gradient_accumulation_steps, grad_accum_dtype, dtype, reuse_fp16_shard)
    check_disk_arguments(None, None, None, buffer_count, buffer_size, atomic_step, "cpu", False)
    if nvme_path is not None and (not isinstance(nvme_path, (str, os.PathLike)) or not os.path.isdir(nvme_path)):
        raise InvalidArgumentError("nvme_path", nvme_path, "None or an existing directory (str or os.PathLike)")
    if isinstance(policies, str) or not policies:
        raise InvalidArgumentError("policies", policies, "a non-empty sequence of 'cuda', 'cpu', 'auto', 'static'")
    for name in policies:
        check_choice("policies", name, ("cuda", "cpu", "auto", "static"))
    if measure_operators is not None and not isinstance(measure_operators, bool):
        raise ArgumentTypeError("measure_operators", measure_operators, "None, True or False")
    _check_optimizer_states(optimizer_states, ranks)
    if dist.is_available() and dist.is_initialized() and (ranks > 1 or dist.get_world_size() > 1):
        raise UnsupportedOperationError("chunkmem.choose plans from one process (ranks= says how many it plans "
                                        "for); call it before init_process_group (or in a process without one)")


def _check_optimizer_states(optimizer_states: Any, ranks: int) -> None:
    """Refuse :func:`choose`'s ``optimizer_states`` unless a non-empty sequence of ``"fp32"`` and ``"8bit"``, the
    latter with one rank only."""
    allowed = "a non-empty sequence of 'fp32', '8bit' (e.g. ('fp32', '8bit'))"
    if isinstance(optimizer_states, str) or not isinstance(optimizer_states, (list, tuple)) or not optimizer_states:
        raise InvalidArgumentError("optimizer_states", optimizer_states, allowed)
    for state in optimizer_states:
        check_choice("optimizer_states", state, OPTIMIZER_STATES)
    if "8bit" in optimizer_states and ranks > 1:
        raise InvalidArgumentError("optimizer_states", optimizer_states,
                                   f"('fp32',) with ranks={ranks}: 8-bit state trains on one rank for now")


def _placements(policies: Sequence[str], static_fractions: Sequence[tuple[float, float]]
                ) -> list[tuple[str, dict[str, float]]]:
    """The placements :func:`choose` plans, each with its ``static`` offload fractions (none for the others)."""
    bases: list[tuple[str, dict[str, float]]] = [(name, {}) for name in ("cuda", "cpu", "auto") if name in policies]
    if "static" in policies:
        bases += [("static", {"offload_param_frac": float(p), "offload_optim_frac": float(o)})
                  for p, o in static_fractions]
    return bases


@dataclass(frozen=True)
class _DiskSettings:
    buffer_count: int
    buffer_size: int
    atomic_step: bool


@dataclass(frozen=True)
class _Shared:
    """What every candidate of one :func:`choose` shares: the disk tier's settings, the dtype, the chunk size
    asked for, the ranks, the host and disk budgets, the profile, one forward and backward's compute seconds,
    and ``grad_accum_dtype``."""

    disk: _DiskSettings
    dtype: torch.dtype
    chunk_size: int | None
    ranks: int
    host_capacity: int | None
    disk_capacity: int | None
    profile: MachineProfile
    compute_seconds: float
    grad_accum_dtype: torch.dtype | None


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


def _settings_and_name(base: PolicyPlan, policy: str, fractions: dict[str, float], reuse: bool, optim_disk: bool,
                       param_disk: bool, disk: _DiskSettings, dtype: torch.dtype, chunk_size: int | None,
                       grad_accum_dtype: torch.dtype | None) -> tuple[dict[str, Any], str]:
    """A candidate's :class:`~chunkmem.ShardedModelV2` settings and its name."""
    settings: dict[str, Any] = {"tensor_placement_policy": policy, "dtype": dtype,
                                "chunk_size": base.chunk_bytes if chunk_size is None else chunk_size,
                                "reuse_fp16_shard": reuse, **fractions}
    if grad_accum_dtype is not None:
        settings["grad_accum_dtype"] = grad_accum_dtype
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
    return settings, name


def _optimizer_chunks_kept_on_host(policy: str, host_capacity: int | None, numels: list[int], families: int,
                                   reuse: bool, dtype: torch.dtype, host_now: int, disk: _DiskSettings,
                                   streamed: int) -> int:
    """With the optimizer state on disk: how many chunks' state stays on the host all the same (under ``auto``
    with a host capacity, the first ones that fit, as ShardedOptimizerV2 decides; else none). ``host_now``:
    the host bytes of the parameters (and the disk's fetch buffer)."""
    if policy != "auto" or host_capacity is None or not numels:
        return 0
    state_bytes = families * numels[0] * 4
    grads = 0 if reuse else len(numels) * numels[0] * dtype.itemsize
    free = host_capacity - host_now - grads - disk.buffer_count * streamed * disk.buffer_size
    return min(max(free, 0) // state_bytes, len(numels))


def _disk_file_bytes(base: PolicyPlan, disk: _DiskSettings, families: int, param_disk: bool, optim_disk: bool,
                     param_kept: int, optim_on_disk: int) -> int:
    """The bytes of the disk tier's files: regions (two slots with ``atomic_step``) for the chunks whose
    parameters (all but ``param_kept``) or optimizer state (``optim_on_disk`` chunks) rest on disk only."""
    ex = base.extra
    world = ex["world"]
    slots = 2 if disk.atomic_step else 1
    shard = ex["chunk_numel"] // world
    files = 0
    if param_disk:
        files += aligned_nbytes(base.chunk_bytes // world) * slots * (base.num_chunks - param_kept)
    if optim_disk:
        files += families * aligned_nbytes(shard * 4) * slots * optim_on_disk
        if not ex["has_master"] and disk.atomic_step:
            files += aligned_nbytes(shard * 4) * optim_on_disk
    return files


def _disk_traffic(base: PolicyPlan, param_disk: bool, optim_disk: bool, param_kept: frozenset[int],
                  optim_on_disk: set[int], on_disk_numel: int, families: int) -> tuple[int, int, int, int, list[int]]:
    """A step's disk traffic: bytes the step reads and writes, bytes the forward and backward read (the
    parameters resting on disk), bytes still moved to the device from the host (those kept there), and the
    parameter bytes of each chunk the step loads into host memory to update it outside the streamed step."""
    ex = base.extra
    shard_bytes = ex["param_shard_bytes"]
    read = written = read_compute = 0
    moved_to_device = base.moved_to_device_per_step
    if param_disk:  # the forward's and backward's fetches of chunks resting on disk come from the files
        fetched = [0 if ex["param_on_device"][i] else n * shard_bytes[i] for i, n in enumerate(ex["fetches"])]
        read_compute = sum(b for i, b in enumerate(fetched) if i not in param_kept)
        moved_to_device = sum(b for i, b in enumerate(fetched) if i in param_kept)
    if optim_disk:
        read += families * on_disk_numel * 4
        written += families * on_disk_numel * 4
    # parameter chunks on disk: the step writes each back; it reads it too, except where the streamed
    # step (the chunk's optimizer state on disk) writes 16-bit parameters as its output; one updated
    # outside the streamed step is read into host memory first
    param_chunks = [(k, i) for k, i in enumerate(ex["trainable_index"])
                    if param_disk and not ex["param_on_device"][i] and i not in param_kept]
    written += sum(shard_bytes[i] for _, i in param_chunks)
    read += sum(shard_bytes[i] for k, i in param_chunks if not (ex["has_master"] and k in optim_on_disk))
    loaded = [shard_bytes[i] for k, i in param_chunks if k not in optim_on_disk]
    return read, written, read_compute, moved_to_device, loaded


def _verdict(base: PolicyPlan, host_peak: int, host_capacity: int | None, files: int, disk_capacity: int | None,
             time: StepTime | None, uses_disk: bool) -> tuple[bool, str]:
    """Whether a candidate fits, and why not (or why it has no predicted time)."""
    fits, reason = base.fits, base.reason
    if fits and host_capacity is not None and host_peak > host_capacity:
        fits, reason = False, f"host: a peak of {host_peak} bytes of chunks exceeds host_memory={host_capacity}"
    if fits and disk_capacity is not None and files > disk_capacity:
        fits, reason = False, f"disk: the files need {files} bytes, more than disk_memory={disk_capacity}"
    if fits and time is None:
        reason = "the profile has no disk bandwidth" if uses_disk else "the profile has no collective bandwidth"
    return fits, reason


@dataclass
class _Placed:
    """Where one candidate's chunk bytes rest (``tier_bytes``: tier -> family -> bytes), with what its disk
    accounting reads: the host bytes of the parameters before any went to disk (``param_host``), the chunks
    whose parameters stay on the host all the same (``param_kept``, ``kept_param_bytes``), the trainable chunks
    whose optimizer state rests on disk (``optim_on_disk``, ``on_disk_numel`` elements) and the disk tier's I/O
    buffers on the host (``disk_io``)."""

    tier_bytes: dict[str, dict[str, int]]
    param_host: int
    param_kept: frozenset[int]
    kept_param_bytes: int
    optim_on_disk: set[int]
    on_disk_numel: int
    disk_io: int


def _place_bytes(base: PolicyPlan, policy: str, reuse: bool, optim_disk: bool, param_disk: bool,
                 families: tuple[str, ...], shared: _Shared) -> _Placed:
    """Where the meta run ``base``'s bytes rest once the disk variant moves parameters and optimizer state to
    disk (under ``auto`` with a host capacity the first chunks that fit stay on the host, as ShardedModelV2 and
    ShardedOptimizerV2 decide)."""
    ex, disk, dtype, host_capacity = base.extra, shared.disk, shared.dtype, shared.host_capacity
    has_master = ex["has_master"]
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
        host_now = param_host if not param_disk else kept_param_bytes + (io if params_to_disk else 0)
        kept = _optimizer_chunks_kept_on_host(policy, host_capacity, numels, len(families), reuse, dtype, host_now,
                                              disk, streamed)
    on_disk_numel, optim_on_disk = 0, set()
    if optim_disk:  # (else the state off the device rests on the host, as the meta run counted it)
        for family in families:
            tier_bytes["host"].pop(family, None)
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
    return _Placed(tier_bytes, param_host, param_kept, kept_param_bytes, optim_on_disk, on_disk_numel, disk_io)


def _host_peak(base: PolicyPlan, placed: _Placed, families: tuple[str, ...], param_disk: bool, optim_disk: bool,
               loaded: list[int]) -> int:
    """The most chunk bytes on the host at once: the meta run's, less the parameters gone to disk, plus the
    optimizer state and I/O buffers on the host, the largest parameter chunk loaded from disk for its update
    (``loaded``), and the host copies of parameters resting on the device that the host's Adam updates."""
    ex = base.extra
    host_peak = ex["host_peak_meta"] - (placed.param_host - placed.kept_param_bytes if param_disk else 0) + sum(
        n for f, n in placed.tier_bytes["host"].items() if f in families) + placed.disk_io
    host_peak += max(loaded, default=0)
    # a chunk whose parameters rest on the device and whose Adam runs on the host ('static') is updated in
    # a host copy of its parameters: one at a time, or all of them in the streamed disk step
    copies = [ex["param_shard_bytes"][i] for k, i in enumerate(ex["trainable_index"])
              if ex["param_on_device"][i] and not ex["optim_on_device"][k]]
    host_peak += sum(copies) if optim_disk else max(copies, default=0)
    return host_peak


def _candidate(base: PolicyPlan, policy: str, fractions: dict[str, float], reuse: bool, optim_disk: bool,
               param_disk: bool, shared: _Shared, optimizer_state: str = "fp32") -> Candidate:
    """One candidate on the meta run ``base`` (planned with ``optimizer_state``); ``shared.compute_seconds``: one
    forward and backward's operators (the step runs ``base.gradient_accumulation_steps`` of them)."""
    ex = base.extra
    moments = LOW_BIT_FAMILIES if optimizer_state == "8bit" else ADAM_STATE
    families = (("master",) if ex["has_master"] else ()) + tuple(moments)
    settings, name = _settings_and_name(base, policy, fractions, reuse, optim_disk, param_disk, shared.disk,
                                        shared.dtype, shared.chunk_size, shared.grad_accum_dtype)
    name += "+8bit" if optimizer_state == "8bit" else ""
    placed = _place_bytes(base, policy, reuse, optim_disk, param_disk, families, shared)
    # the disk tier's files and traffic
    files = _disk_file_bytes(base, shared.disk, len(families), param_disk, optim_disk, len(placed.param_kept),
                             len(placed.optim_on_disk))
    moved_to_host = base.moved_to_host_per_step
    read, written, read_compute, moved_to_device, loaded = _disk_traffic(
        base, param_disk, optim_disk, placed.param_kept, placed.optim_on_disk, placed.on_disk_numel, len(families))
    host_peak = _host_peak(base, placed, families, param_disk, optim_disk, loaded)
    cost_inputs = dict(moved_bytes=moved_to_device + moved_to_host, adam_elements=sum(ex["trainable_shard_numels"]),
                       disk_adam_elements=placed.on_disk_numel, disk_read_step=read, disk_written_step=written,
                       disk_read_compute=read_compute, collective_bytes_sent=ex["collective_bytes_sent"])
    steps = base.gradient_accumulation_steps
    time = step_time(shared.profile, shared.compute_seconds * steps, shared.dtype, **cost_inputs)
    fits, reason = _verdict(base, host_peak, shared.host_capacity, files, shared.disk_capacity, time,
                            uses_disk=bool(read or written or read_compute))
    return Candidate(policy, fits, reason, placed.tier_bytes, base.non_model_peak, base.chunk_bytes, base.num_chunks,
                     moved_to_device, moved_to_host, base.device_peak_bytes, dict(ex), name=name, settings=settings,
                     ranks=shared.ranks, host_peak_bytes=host_peak, disk_file_bytes=files,
                     disk_read_per_step=read + read_compute, disk_written_per_step=written,
                     collective_bytes_per_step=ex["collective_bytes_sent"], time=time,
                     cost_inputs=cost_inputs, gradient_accumulation_steps=steps, optimizer_state=optimizer_state)
