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
from .machine_profile import MachineProfile, dtype_name
from .cost_model import StepTime, missing_figure, step_time, trace_compute
from .disk_accounting import DiskSettings, bytes_per_rank, disk_file_bytes, disk_traffic, host_peak, place_bytes
from ..settings import check_chunk_size, check_dtype
from ..core.tiers import parse_size
from .meta_run import (OPTIMIZER_STATES, PolicyPlan, _meta_inputs, _meta_model, _plan_policy, check_accumulation,
                       check_optimizer_state)


@dataclass
class Candidate(PolicyPlan):
    """One configuration the planner considered: a :class:`PolicyPlan` (bytes per tier, now with
    ``"disk"``; with ``ranks`` > 1 every figure is one rank's: ``tier_bytes`` rank 0's, ``tier_bytes_per_rank``
    each rank's, which differ only by the 8-bit state's block scales and small parameters' moments, the peaks and
    the disk writes the largest rank's) and more.

    ``name``: a short label (``"static(0.5,0.5)+optim@disk"``). ``settings``: the keyword arguments of
    :class:`~chunkmem.ShardedModelV2` it stands for (``nvme_path`` left out: see :meth:`model_config`;
    ``grad_accum_dtype`` there when :func:`choose` was given one).
    ``host_peak_bytes``: the most chunk bytes on the host at once (the gradients before the step, widened
    to fp32 when they accumulate over several backwards, the optimizer state and the disk tier's I/O buffers
    included): what a host capacity must allow.
    ``disk_file_bytes``: what the disk tier's files occupy (preallocated, both slots of an atomic step):
    what the disk budget must allow. ``disk_read_per_step`` / ``disk_written_per_step``: bytes the disk
    tier reads and writes in one step (forward, backward and optimizer step), the writes the largest rank's
    (the ranks wait for the slowest); ``disk_written_per_rank``: each rank's writes (rank ``r`` at index ``r``),
    which differ with 8-bit state on disk by the pages of codes around the blocks the rank's shard boundaries cut,
    written again. ``collective_bytes_per_step``: bytes this rank sends in the training collectives of one step
    (ring implementation). ``time``: the predicted :class:`~chunkmem.plan.cost_model.StepTime` in seconds
    (``None`` when the profile lacks a figure it needs, e.g. no disk bandwidth).
    ``recommended``: the one :func:`choose` recommends.
    ``cost_inputs``: what the cost model was given besides the compute (bytes copied, Adam elements, disk
    bytes, collective bytes: :func:`chunkmem.plan.cost_model.step_time`'s arguments), all per step, i.e. over its
    ``gradient_accumulation_steps`` forward/backward passes. ``optimizer_state``: the optimizer state it was
    planned with (:func:`~chunkmem.plan.plan`'s ``optimizer_state``): ``"fp32"``, ``"8bit"`` (train it with
    ``HybridAdam(..., state_dtype="8bit")`` or torchao's ``AdamW8bit`` / ``Adam8bit``) or ``"8bit-bf16"`` (the same
    optimizers with ``bf16_stochastic_round=True``); ``chunkmem.initialize(..., plan=)`` refuses
    an optimizer that does not keep that state.
    """

    name: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    ranks: int = 1
    disk_file_bytes: int = 0
    disk_read_per_step: int = 0
    disk_written_per_step: int = 0
    disk_written_per_rank: list[int] = field(default_factory=list)
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
        optimizer_states: among :func:`plan`'s ``optimizer_state`` values: ``"fp32"`` (the default), ``"8bit"``,
            ``"8bit-bf16"`` (``dtype=torch.bfloat16`` only; no ``reuse_fp16_shard`` candidate). The 8-bit ones are
            another optimizer, so they are planned only when asked for: every placement and disk variant with
            each (names ending in ``+8bit`` / ``+8bit-bf16``), on any number of ranks; their update timed at the
            profile's 8-bit rates, the disk step's I/O from the bytes of their families on disk.
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
    shared = _Shared(DiskSettings(buffer_count, buffer_size, atomic_step), dtype, chunk_size, ranks, host_capacity,
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
    process group with several ranks), then each of its disk variants (no ``reuse_fp16_shard`` with ``"8bit-bf16"``:
    refused by ShardedOptimizerV2). The device capacity setting is restored after."""
    saved_capacity = tiers.device_memory_capacity_setting()
    candidates: list[Candidate] = []
    try:
        with _stand_in_group(shared.ranks):
            for state in optimizer_states:
                for reuse in [r for r in reuse_options if not (r and state == "8bit-bf16")]:
                    for policy, fractions in bases:
                        base = _plan_policy(policy, template, args, loss_fn, device_capacity, None, shared.dtype,
                                            shared.chunk_size, reuse, gradient_accumulation_steps,
                                            shared.grad_accum_dtype, optimizer_state=state, **fractions)
                        for optim_disk, param_disk in _disk_variants(policy, base, reuse,
                                                                     shared.disk_capacity is not None):
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
    _check_optimizer_states(optimizer_states, dtype, reuse_fp16_shard)
    if dist.is_available() and dist.is_initialized() and (ranks > 1 or dist.get_world_size() > 1):
        raise UnsupportedOperationError("chunkmem.choose plans from one process (ranks= says how many it plans "
                                        "for); call it before init_process_group (or in a process without one)")


def _check_optimizer_states(optimizer_states: Any, dtype: torch.dtype, reuse_fp16_shard: bool | None) -> None:
    """Refuse :func:`choose`'s ``optimizer_states`` unless a non-empty sequence of :data:`OPTIMIZER_STATES`
    (``"8bit-bf16"`` with a bf16 ``dtype`` and ``reuse_fp16_shard`` ``None`` or ``False`` only)."""
    allowed = "a non-empty sequence of " + ", ".join(repr(s) for s in OPTIMIZER_STATES) + " (e.g. ('fp32', '8bit'))"
    if isinstance(optimizer_states, str) or not isinstance(optimizer_states, (list, tuple)) or not optimizer_states:
        raise InvalidArgumentError("optimizer_states", optimizer_states, allowed)
    for state in optimizer_states:
        check_optimizer_state("optimizer_states", state, dtype, reuse_fp16_shard)


def _placements(policies: Sequence[str], static_fractions: Sequence[tuple[float, float]]
                ) -> list[tuple[str, dict[str, float]]]:
    """The placements :func:`choose` plans, each with its ``static`` offload fractions (none for the others)."""
    bases: list[tuple[str, dict[str, float]]] = [(name, {}) for name in ("cuda", "cpu", "auto") if name in policies]
    if "static" in policies:
        bases += [("static", {"offload_param_frac": float(p), "offload_optim_frac": float(o)})
                  for p, o in static_fractions]
    return bases


@dataclass(frozen=True)
class _Shared:
    """What every candidate of one :func:`choose` shares: the disk tier's settings, the dtype, the chunk size
    asked for, the ranks, the host and disk budgets, the profile, one forward and backward's compute seconds,
    and ``grad_accum_dtype``."""

    disk: DiskSettings
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
                       param_disk: bool, disk: DiskSettings, dtype: torch.dtype, chunk_size: int | None,
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


def _verdict(base: PolicyPlan, host_peak: int, host_capacity: int | None, files: int, disk_capacity: int | None,
             missing: str | None) -> tuple[bool, str]:
    """Whether a candidate fits, and why not (or why it has no predicted time: ``missing``, the profile's figure
    it lacks)."""
    fits, reason = base.fits, base.reason
    if fits and host_capacity is not None and host_peak > host_capacity:
        fits, reason = False, f"host: a peak of {host_peak} bytes of chunks exceeds host_memory={host_capacity}"
    if fits and disk_capacity is not None and files > disk_capacity:
        fits, reason = False, f"disk: the files need {files} bytes, more than disk_memory={disk_capacity}"
    if fits and missing is not None:
        reason = f"the profile has no {missing}"
    return fits, reason


def _candidate(base: PolicyPlan, policy: str, fractions: dict[str, float], reuse: bool, optim_disk: bool,
               param_disk: bool, shared: _Shared, optimizer_state: str = "fp32") -> Candidate:
    """One candidate on the meta run ``base`` (planned with ``optimizer_state``); ``shared.compute_seconds``: one
    forward and backward's operators (the step runs ``base.gradient_accumulation_steps`` of them)."""
    ex = base.extra
    settings, name = _settings_and_name(base, policy, fractions, reuse, optim_disk, param_disk, shared.disk,
                                        shared.dtype, shared.chunk_size, shared.grad_accum_dtype)
    name += "" if optimizer_state == "fp32" else "+" + optimizer_state
    placed = place_bytes(base, policy, reuse, optim_disk, param_disk, shared.disk, shared.dtype, shared.host_capacity)
    files = disk_file_bytes(base, shared.disk, param_disk, len(placed.param_kept), placed.optim_on_disk)
    moved_to_host = base.moved_to_host_per_step
    read, written_per_rank, read_compute, moved_to_device, loaded = disk_traffic(base, param_disk, placed)
    written = max(written_per_rank)
    peak = host_peak(base, placed, param_disk, optim_disk, loaded)
    cost_inputs = dict(moved_bytes=moved_to_device + moved_to_host, adam_elements=sum(ex["trainable_shard_numels"]),
                       disk_adam_elements=placed.on_disk_numel, disk_read_step=read, disk_written_step=written,
                       disk_read_compute=read_compute, collective_bytes_sent=ex["collective_bytes_sent"],
                       optimizer_state=optimizer_state)
    steps = base.gradient_accumulation_steps
    time = step_time(shared.profile, shared.compute_seconds * steps, shared.dtype, **cost_inputs)
    missing = missing_figure(shared.profile, shared.dtype, **cost_inputs) if time is None else None
    fits, reason = _verdict(base, peak, shared.host_capacity, files, shared.disk_capacity, missing)
    per_rank = bytes_per_rank(base, placed, shared.ranks) if optim_disk or param_disk else base.tier_bytes_per_rank
    return Candidate(policy, fits, reason, placed.tier_bytes, base.non_model_peak, base.chunk_bytes, base.num_chunks,
                     moved_to_device, moved_to_host, base.device_peak_bytes, dict(ex), name=name, settings=settings,
                     ranks=shared.ranks, host_peak_bytes=peak, disk_file_bytes=files,
                     disk_read_per_step=read + read_compute, disk_written_per_step=written,
                     disk_written_per_rank=written_per_rank,
                     collective_bytes_per_step=ex["collective_bytes_sent"], time=time,
                     cost_inputs=cost_inputs, gradient_accumulation_steps=steps, optimizer_state=optimizer_state,
                     tier_bytes_per_rank=per_rank)
