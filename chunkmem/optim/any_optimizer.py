"""Any torch optimizer over the chunks: the update of an optimizer that is not Adam (SGD, RMSprop,
Adagrad, AdamW with ``amsgrad``, ...), by :class:`~chunkmem.ShardedOptimizerV2` and
:class:`~chunkmem.LowLevelZeroOptimizer`.

**What the optimizer keeps.** :func:`probe_state` steps a throw-away copy of the optimizer (same class,
same hyper-parameters per group) twice on a small tensor and a 64 x 128 one and sorts what it keeps per
parameter: a plain tensor shaped like the parameter, for both, is **per-element** state (SGD's ``momentum_buffer``, Adagrad's ``sum``,
RMSprop's ``square_avg``, AMSGrad's ``max_exp_avg_sq``); a 0-d tensor or a number is **scalar** state
(``step``, NAdam's ``mu_product``). Each per-element key becomes an fp32 state family of every trainable
chunk, named as the key: it lives on the chunk's optimizer tier, moves with it, and the ledger counts it.
Scalar state is kept per parameter, as torch keeps it (a parameter frozen for a while, or without a gradient
in a step, keeps its ``step`` while the others advance), on the host (a few bytes each), under the parameter's
:attr:`ParamView.key` (its position in its chunk; for :class:`~chunkmem.LowLevelZeroOptimizer` its index in
the param groups): :func:`step_parameters`.

**Whole-parameter state.** An optimizer that keeps anything else (Adafactor's factored ``row_var`` /
``col_var``, a quantized state with per-block scales, such as torchao's 4-bit and fp8 Adams keep for larger
tensors: a tensor subclass) has no per-element families: all its state is kept
per parameter, as its step made it, on the tier where the chunk's update runs (moved there at each step),
outside the chunks and not counted by the ledger (factors are rows + columns per matrix). Its step must
see whole parameters, so it runs in one process only, with the optimizer state off the disk tier
(:data:`ELEMENTWISE` does not list it).

**The update.** For a chunk, on the tier where its state lives, the optimizer's own ``step`` runs on
stand-in parameters that are views of this rank's part of each parameter in the fp32 master (shaped like
the parameter when the rank holds it whole, flat pieces when it is sharded), with gradients unscaled and
clipped, and the state entries views of the families (before a parameter's first step there is none: the
optimizer creates it as torch would, SGD's momentum buffer a copy of the gradient, Adagrad's sum its
initial accumulator, and it is copied into the families after; a parameter has state once it has stepped
itself, whatever its neighbours did: it then has scalar state). The math is the optimizer's own, so
the result equals plain PyTorch for every element. An optimizer whose step reads a whole parameter
(a norm, a trust ratio: LAMB, LARS, Adafactor's factors) would see a piece when the chunk is sharded: only
the classes of :data:`ELEMENTWISE` are stepped on a sharded model.

**On the disk tier** the streamed step (:mod:`chunkmem.optim.disk_step`) hands each chunk over in pieces
of its I/O buffers' size: :class:`PieceStep` steps every piece on flat stand-ins (so again only the
classes of :data:`ELEMENTWISE`), each piece from its parameters' scalar state before the step; the scalar
state after it is committed with the step, and forgotten when a failed step is undone.

**On several ranks** a stepped parameter none of whose elements lie in this rank's shard steps a one-element
stand-in (:meth:`ParamView.elsewhere`), so that every rank advances its scalar state alike.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..distributed.agreement import hyper_parameter_digest
from ..errors import InvalidArgumentError, UnsupportedOperationError

__all__ = ["ELEMENTWISE", "ParamView", "PieceStep", "StateLayout", "check_elementwise", "probe_state",
           "step_parameters"]

ELEMENTWISE: tuple[type, ...] = (torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adam,
                                 torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                                 torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta)
"""Optimizer classes whose step treats every element on its own (a sharded model may use them)."""


@dataclass(frozen=True)
class StateLayout:
    """What an optimizer keeps per parameter, per param group (see the module docstring).

    Attributes:
        families: the per-element keys over all groups, in first-seen order (the chunks' state families).
        per_group: for each param group, its per-element keys.
        whole: all state is kept per parameter (whole-parameter state; ``families`` is empty).
    """

    families: tuple[str, ...]
    per_group: tuple[tuple[str, ...], ...]
    whole: bool = False


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _copy_of(optimizer: Optimizer, groups: list[dict[str, Any]]) -> Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups``, built with its defaults as constructor
    arguments (some read those, not the group's: Adagrad's ``initial_accumulator_value``)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})


def _per_element(value: Any, probe: torch.Tensor) -> bool:
    """Whether ``value`` is a plain tensor shaped like ``probe`` (not a tensor subclass such as a quantized state)."""
    return type(value) in (torch.Tensor, nn.Parameter) and tuple(value.shape) == tuple(probe.shape)


def probe_state(optimizer: Optimizer) -> StateLayout:
    """Sort the state ``optimizer`` keeps per parameter (module docstring); refuse with
    :class:`~chunkmem.InvalidArgumentError` naming ``optimizer`` one whose copy cannot be built or stepped."""
    families: list[str] = []
    per_group = []
    whole = False
    for index, group in enumerate(optimizer.param_groups):
        small, large = torch.zeros(2, 3, requires_grad=True), torch.zeros(64, 128, requires_grad=True)
        try:
            shadow = _copy_of(optimizer, [{**_hyper(group), "params": [small, large]}])
            for value in (0.5, -0.25):
                for probe in (small, large):
                    probe.grad = torch.full_like(probe, value)
                shadow.step()
        except Exception as e:  # noqa: BLE001 - any failure means chunkmem cannot run this optimizer's step
            raise InvalidArgumentError("optimizer", type(optimizer).__name__,
                                       f"an optimizer chunkmem can step on stand-in parameters (building and stepping "
                                       f"a copy of param group {index} failed: {type(e).__name__}: {e})") from e
        keys = []
        for key, value in shadow.state[small].items():
            if _per_element(value, small):
                keys.append(key)
                if key not in families:
                    families.append(key)
            elif isinstance(value, torch.Tensor) and value.numel() != 1:
                whole = True
        for key, value in shadow.state[large].items():  # quantized or factored for larger tensors only
            if isinstance(value, torch.Tensor) and not _per_element(value, large) and (key in keys or value.numel() != 1):
                whole = True
        per_group.append(tuple(keys))
    if whole:
        return StateLayout((), tuple(() for _ in per_group), whole=True)
    if "master" in families:
        raise InvalidArgumentError("optimizer", type(optimizer).__name__, "an optimizer without a state key 'master'")
    return StateLayout(tuple(families), tuple(per_group))


class LayoutWatch:
    """Holds an optimizer to the :class:`StateLayout` its chunks were given: before each step whose
    hyper-parameters changed since the last look (``SGD``'s momentum switched on by ``OneCycleLR``'s
    ``cycle_momentum``, say), the state the optimizer keeps is probed again, and a step that would keep
    other per-element state (a momentum buffer, which has no chunk family) is refused instead of being
    kept, a piece standing for the whole, with the scalar state."""

    def __init__(self, optimizer: Optimizer, layout: StateLayout, owner: str) -> None:
        self.optimizer = optimizer
        self.layout = layout
        self.owner = owner
        self._seen = hyper_parameter_digest(optimizer.param_groups)

    def check(self) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError`, with nothing changed, if the optimizer's
        current hyper-parameters make it keep other per-element state than the chunks have."""
        seen = hyper_parameter_digest(self.optimizer.param_groups)
        if seen == self._seen:
            return
        now = probe_state(self.optimizer)
        if now.whole != self.layout.whole or now.per_group != self.layout.per_group:
            changed = [n for n, (a, b) in enumerate(zip(now.per_group, self.layout.per_group)) if a != b]
            group = changed[0] if changed else 0
            raise UnsupportedOperationError(
                f"{type(self.optimizer).__name__}'s param group {group} now keeps the per-element state "
                f"{list(now.per_group[group]) if group < len(now.per_group) else []} where {self.owner} was built "
                f"for {list(self.layout.per_group[group]) if group < len(self.layout.per_group) else []} (a "
                f"hyper-parameter changed since, e.g. SGD's momentum switched on by a schedule): the chunks have no "
                f"family for it; build {self.owner} with the setting that keeps that state from the start (a "
                f"schedule may change its value afterwards); nothing was changed")
        self._seen = seen


def check_elementwise(optimizer: Optimizer, where: str, why: str) -> None:
    """Refuse an optimizer outside :data:`ELEMENTWISE` ``where`` its step would see pieces of parameters
    (``why``: what cuts them)."""
    if type(optimizer) not in ELEMENTWISE:
        raise InvalidArgumentError(
            "optimizer", type(optimizer).__name__,
            f"{where}, an optimizer that treats every element on its own: "
            + ", ".join(c.__name__ for c in ELEMENTWISE) + f" ({type(optimizer).__name__} may read a whole parameter, "
            f"and {why})")


@dataclass
class ParamView:
    """One parameter's part in this rank's shard, for one update: where it is (``start``, ``count`` in
    the shard; ``count`` 0: none of its elements, see :meth:`elsewhere`), its shape when whole (``None``: a
    flat piece), its param group and ``key``, the number its scalar and whole-parameter state are kept
    under (its position in the chunk; :class:`~chunkmem.LowLevelZeroOptimizer`: its index in the param groups)."""

    start: int
    count: int
    shape: tuple[int, ...] | None
    group: int
    key: Hashable = -1

    @classmethod
    def of_part(cls, offset: int, numel: int, shape: Sequence[int], part: tuple[int, int], shard_offset: int,
                group: int, key: Hashable) -> "ParamView":
        """The view of elements ``part`` (``(start, end)`` of the parameter) of a parameter of ``numel``
        elements and ``shape`` at ``offset`` in its chunk, in the rank's shard starting at ``shard_offset``
        (elements of the chunk): shaped when the part is the whole parameter."""
        whole = part == (0, numel)
        return cls(offset + part[0] - shard_offset, part[1] - part[0], tuple(shape) if whole else None, group, key)

    @classmethod
    def elsewhere(cls, group: int, key: Hashable) -> "ParamView":
        """A stepped parameter none of whose elements lie in this rank's shard: its step advances only its
        scalar state (on a one-element stand-in), as on the ranks that hold it."""
        return cls(0, 0, None, group, key)


def step_parameters(optimizer: Optimizer, layout: StateLayout, views: Iterable[ParamView], master: torch.Tensor,
                    grad: torch.Tensor, families: dict[str, torch.Tensor], scalars: dict[Hashable, dict[str, Any]],
                    whole_state: dict[Hashable, dict[str, Any]] | None = None) -> None:
    """Run ``optimizer``'s step over the stepped parameters of one chunk (``views``, one each) on stand-ins:
    views of ``master`` (this rank's fp32 shard, updated in place) with gradients from ``grad`` (fp32, same
    layout, unscaled and clipped) and per-element state from ``families`` (``{key: fp32 shard}``, written
    in place).

    Scalar state (``step``, ...) is per parameter, as torch keeps it: ``scalars[view.key]`` holds a
    parameter's and is replaced by its new values. A parameter without an entry takes its first step: the
    optimizer creates its state, per-element part included (copied into the families), as torch does at a
    parameter's first step, whatever its neighbours' count. A view of no elements
    (:meth:`ParamView.elsewhere`) steps a one-element stand-in: every rank keeps the same scalar state. With
    ``layout.whole``, ``whole_state[view.key]`` holds each parameter's whole state instead (absent before
    its first step) and every view must be shaped."""
    views = [view for view in views if view.count or not layout.whole]  # (whole state: one process)
    if not views:  # (a piece of the disk step with no stepped parameter in it)
        return
    if layout.whole:
        _step_whole(optimizer, views, master, grad, whole_state)
        return
    stand_ins: list[tuple[ParamView, torch.Tensor, dict[str, torch.Tensor]]] = []  # (view, stand-in, state views)
    for view in views:
        keys = layout.per_group[view.group]
        if view.count == 0:  # held by other ranks: its scalar state advances here too
            param = torch.zeros(1, device=master.device)
            param.grad = torch.zeros(1, device=master.device)
            stand_ins.append((view, param, {key: torch.zeros(1, device=master.device) for key in keys}))
            continue

        def cut(flat: torch.Tensor, v: ParamView = view) -> torch.Tensor:
            piece = flat[v.start:v.start + v.count]
            return piece.view(v.shape) if v.shape is not None else piece
        param = cut(master)
        param.grad = cut(grad)
        stand_ins.append((view, param, {key: cut(families[key]) for key in keys}))
    by_group: dict[int, list[torch.Tensor]] = {}
    for view, param, _ in stand_ins:
        by_group.setdefault(view.group, []).append(param)
    shadow = _copy_of(optimizer, [{**_hyper(optimizer.param_groups[g]), "params": params}
                                  for g, params in by_group.items()])
    for view, param, state in stand_ins:
        if view.key in scalars:  # stepped before: per-element views written in place, scalars a copy
            own = dict(state)
            own.update((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars[view.key].items())
            shadow.state[param] = own
    with torch.no_grad():
        shadow.step()
    for view, param, state in stand_ins:
        kept = shadow.state[param]
        for key, target in state.items():
            if kept[key] is not target:  # created by this step: into the family
                target.copy_(kept[key])
        scalars[view.key] = {k: v for k, v in kept.items() if k not in state}
        param.grad = None


class PieceStep:
    """One chunk's update by ``optimizer`` piece by piece, as the disk tier's streamed step calls it
    (:class:`~chunkmem.optim.disk_step.PieceRule`). ``views``: the stepped parameters' parts of this
    rank's shard (:meth:`ParamView.elsewhere` for those with none); ``scalars``: the parameters' scalar
    state before the step, by key (not changed: the new one is :attr:`scalars_after`, where the parameters
    not stepped keep theirs); ``multiplier``: what the gradients are multiplied by (unscaling and
    clipping). Every piece steps its parameters from their state before the step (a parameter over several
    pieces gets the same scalar state from each); the parameters held elsewhere step with the first piece."""

    def __init__(self, optimizer: Optimizer, layout: StateLayout, views: list[ParamView],
                 scalars: dict[Hashable, dict[str, Any]], multiplier: float) -> None:
        self.optimizer, self.layout, self.views = optimizer, layout, views
        self.scalars_before, self.multiplier = scalars, multiplier
        self.scalars_after: dict[Hashable, dict[str, Any]] = dict(scalars)

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], start: int,
                 end: int) -> None:
        inside = []
        for view in self.views:
            if view.count == 0:
                if start == 0:
                    inside.append(view)
                continue
            lo, hi = max(view.start, start), min(view.start + view.count, end)
            if lo < hi:
                inside.append(ParamView(lo - start, hi - lo, None, view.group, view.key))
        grad32 = grad[start:end].to(device=master.device, dtype=torch.float32, copy=True).mul_(self.multiplier)
        scalars = {view.key: self.scalars_before[view.key] for view in inside if view.key in self.scalars_before}
        step_parameters(self.optimizer, self.layout, inside, master, grad32, state, scalars)
        self.scalars_after.update(scalars)


def _step_whole(optimizer: Optimizer, views: Iterable[ParamView], master: torch.Tensor, grad: torch.Tensor,
                whole_state: dict[Hashable, dict[str, Any]]) -> None:
    """:func:`step_parameters` for whole-parameter state: each stand-in gets its parameter's own state back."""
    by_group: dict[int, list[torch.Tensor]] = {}
    stand_ins = []
    for view in views:
        assert view.shape is not None, "whole-parameter state needs whole parameters"
        param = master[view.start:view.start + view.count].view(view.shape)
        param.grad = grad[view.start:view.start + view.count].view(view.shape)
        by_group.setdefault(view.group, []).append(param)
        stand_ins.append((view.key, param))
    shadow = _copy_of(optimizer, [{**_hyper(optimizer.param_groups[g]), "params": params}
                                  for g, params in by_group.items()])
    for key, param in stand_ins:
        if key in whole_state:  # on the tier the update runs on now
            shadow.state[param] = {k: v.to(master.device) if isinstance(v, torch.Tensor) and k != "step" else v
                                   for k, v in whole_state[key].items()}
    with torch.no_grad():
        shadow.step()
    for key, param in stand_ins:
        whole_state[key] = dict(shadow.state[param])
        param.grad = None
