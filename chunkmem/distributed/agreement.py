"""Ranks agree on what they shard before the first collective that depends on it.

Ranks that build different models, or the same model with another dtype or chunk size, would run
collectives of different sizes or meanings: gloo aborts the process or mixes the bits of one dtype
into another, or one rank waits for ever. So before such a collective every rank contributes a
fixed-size digest (32 bytes, SHA-256) of a :class:`LayoutDescription`: where it is (``step``), its
settings (world size, dtype, chunk size in elements, placement policy, ...) and its parameters
(name, shape, trainable) in packing order. The digests travel in one all-gather of fixed length, so
ranks that disagree cannot crash it. If any digest differs, the ranks exchange the descriptions
themselves and every rank raises the same :class:`LayoutMismatchError` naming what differs.

``ShardedModelV2`` agrees once its layout is known, before it builds or changes any chunk
(:mod:`chunkmem.model.builder`). ``ZeroInitContext(shard_param=True)`` agrees before every gather its
parameter writes need while the model is built and when it closes (:mod:`chunkmem.faces.init_context`):
every collective of the context is then preceded by an agreement, so ranks that build different models
stop at the first agreement after they diverge instead of pairing mismatched gathers. The optimizers
agree on their settings when they are built (:mod:`chunkmem.optim.mixed_precision`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from ..errors import LayoutMismatchError, StepMismatchError
from .collectives import ShardGroup

DIGEST_BYTES = 32  # SHA-256
_MAX_PARAM_DIFFERENCES = 3  # parameters named in one message


@dataclass
class ParamRecord:
    """A rank's parameters as ``(name, shape, trainable)`` entries, hashed as they are added (so a
    record that grows is not hashed again from the start)."""

    entries: list[tuple[str, tuple[int, ...], bool]] = field(default_factory=list)
    _hash: Any = field(default_factory=hashlib.sha256, repr=False)

    def add(self, name: str, shape: Sequence[int], trainable: bool) -> None:
        entry = (name, tuple(int(n) for n in shape), bool(trainable))
        self.entries.append(entry)
        self._hash.update(json.dumps(entry).encode() + b"\n")

    def digest(self) -> bytes:
        return self._hash.copy().digest()


@dataclass
class LayoutDescription:
    """What the ranks must agree on: ``step`` (where they compare), ``settings`` (name and value text,
    in a fixed order) and ``params``."""

    step: str
    settings: list[tuple[str, str]]
    params: ParamRecord

    def digest(self) -> bytes:
        """:data:`DIGEST_BYTES` bytes that differ (but for a hash collision) when the descriptions do."""
        head = json.dumps([self.step, self.settings]).encode()
        return hashlib.sha256(head + b"\0" + self.params.digest()).digest()

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, "settings": self.settings, "params": self.params.entries}).encode()

    @staticmethod
    def decode(data: bytes) -> "LayoutDescription":
        doc = json.loads(data.decode())
        record = ParamRecord()
        for name, shape, trainable in doc["params"]:
            record.add(name, shape, trainable)
        return LayoutDescription(doc["step"], [tuple(s) for s in doc["settings"]], record)


def agree(shards: ShardGroup, description: LayoutDescription) -> None:
    """Raise :class:`LayoutMismatchError` on every rank of ``shards`` unless all hold an equal
    ``description`` (a collective when sharded: every rank calls it at the same point)."""
    if not shards.sharded:
        return
    mine = torch.frombuffer(bytearray(description.digest()), dtype=torch.uint8)
    everyone = torch.empty(shards.world * DIGEST_BYTES, dtype=torch.uint8)
    shards.all_gather(everyone, mine, what=f"the layout digests ({description.step})")
    by_rank = everyone.view(shards.world, DIGEST_BYTES)
    if bool((by_rank == by_rank[0]).all()):
        return
    texts = shards.all_gather_bytes(description.encode(), f"the layout descriptions ({description.step})")
    raise LayoutMismatchError(mismatch_message([LayoutDescription.decode(t) for t in texts]))


ARGUMENTS = "arguments"
"""The first setting of an optimizer's agreement: ``"accepted"``, or on a rank that refused its
arguments, the refusal (see :func:`refuse_together`)."""


def refuse_together(shards: ShardGroup, step: str, error: Exception) -> NoReturn:
    """Raise ``error``, a refusal of this rank's arguments before the ranks' agreement at ``step``, after
    taking part in that agreement with the refusal as its only setting: a rank whose arguments were
    accepted then raises :class:`LayoutMismatchError` naming the refusal at once, instead of waiting in a
    collective this rank never joins until the collective timeout. (Ranks that all refuse alike agree, and
    each raises its error.)"""
    refusal = LayoutDescription(step, [(ARGUMENTS, f"refused: {type(error).__name__}: {error}")], ParamRecord())
    try:
        agree(shards, refusal)
    except LayoutMismatchError:
        pass
    raise error


def mismatch_message(descriptions: list[LayoutDescription]) -> str:
    """What differs between the ranks' descriptions (index = rank), the same text on every rank."""
    differences = []
    steps = [d.step for d in descriptions]
    if len(set(steps)) > 1:
        differences.append("where they compare: " + _by_rank(steps))
    names = list(dict.fromkeys(name for d in descriptions for name, _ in d.settings))
    for name in names:
        values = [dict(d.settings).get(name, "(not set)") for d in descriptions]
        if len(set(values)) > 1:
            differences.append(f"{name}: " + _by_rank(values))
    differences.extend(_param_differences([d.params.entries for d in descriptions]))
    where = steps[0] if len(set(steps)) == 1 else "at different points"
    return (f"the {len(descriptions)} ranks disagree on the model they shard ({where}); every rank must build "
            f"the same model with the same settings. " + ("; ".join(differences) or "The descriptions differ"))


def _param_differences(params: list[list[tuple[str, tuple[int, ...], bool]]]) -> list[str]:
    out = []
    counts = [len(p) for p in params]
    if len(set(counts)) > 1:
        out.append("number of parameters: " + _by_rank([str(c) for c in counts]))
    listed = 0
    for i in range(max(counts)):
        entries = [p[i] if i < len(p) else None for p in params]
        if all(e == entries[0] for e in entries):
            continue
        if listed == _MAX_PARAM_DIFFERENCES:
            out.append("and more parameters differ")
            break
        listed += 1
        names = {e[0] for e in entries if e is not None}
        if len(names) == 1 and None not in entries:
            name = names.pop()
            if len({e[1] for e in entries}) > 1:
                out.append(f"parameter {name!r} shape: " + _by_rank([str(e[1]) for e in entries]))
            if len({e[2] for e in entries}) > 1:
                out.append(f"parameter {name!r} requires_grad: " + _by_rank([str(e[2]) for e in entries]))
        else:
            out.append(f"parameter #{i} in packing order: "
                       + _by_rank(["none" if e is None else f"{e[0]!r} {e[1]}" for e in entries]))
    return out


def _by_rank(values: list[str]) -> str:
    """``"a on rank 0, b on ranks 1-3"``: each distinct value with the ranks that hold it."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on {_ranks_text(rs)}" for value, rs in ranks.items())


def _ranks_text(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


# ---- where the ranks are during training ----------------------------------------------------------

POINTS = ("forward", "backward", "clip", "step")
"""The points of training the ranks compare (:func:`agree_on_point`)."""
POINT_FIELDS = 6
"""Values compared at each point (unused ones are 0): the record has the same shape at every point, so
ranks at different points meet in the same collective and see that they differ."""


def agree_on_settings_before_groups(shards: ShardGroup, where: str, settings: Sequence[tuple[str, int | None]]) -> None:
    """Raise :class:`LayoutMismatchError` on every rank of ``shards`` unless all passed the same ``settings``
    (``(name, value)``: the sizes that shape the sub-groups every rank creates together, e.g.
    ``shard_group_size``). One all-reduce, before any group is created: a rank that disagreed would otherwise
    create other groups than the rest, and ``torch.distributed.new_group`` would wait for it forever."""
    if not shards.sharded:
        return
    values = [-1 if v is None else int(v) for _, v in settings]
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
    shards.all_reduce_(both, dist.ReduceOp.MAX, what=f"the ranks' settings of {where}")
    high, low = both[:len(values)].tolist(), [-v for v in both[len(values):].tolist()]
    differing = [f"{name}: {_shown(low[i])} on some ranks, {_shown(high[i])} on others (this rank: {_shown(values[i])})"
                 for i, (name, _) in enumerate(settings) if high[i] != low[i]]
    if differing:
        raise LayoutMismatchError(f"the {shards.world} ranks build {where} with different settings: "
                                  + "; ".join(differing) + ". Every rank must pass the same ones; nothing was changed")


def _shown(value: int) -> str:
    return "None" if value == -1 else str(value)


def held_on_any_rank(shards: ShardGroup, flags: Sequence[bool], what: str) -> list[bool]:
    """For each of ``flags``, whether it holds on any rank of ``shards`` (one all-reduce; every rank passes
    as many flags, in the same order). ``what`` names them for a collective's error."""
    if not shards.sharded:
        return list(flags)
    held = torch.tensor([bool(f) for f in flags], dtype=torch.int32)
    shards.all_reduce_(held, dist.ReduceOp.MAX, what=what)
    return [bool(v) for v in held.tolist()]


HYPER_PARAMETERS_FIELD = "the param groups' hyper-parameters (a digest of every group's lr, betas, weight_decay, ...)"


def hyper_parameter_digest(param_groups: Sequence[dict]) -> float:
    """A 52-bit digest (exact in a float64) of every param group's settings but its parameters, for
    :func:`agree_on_point`: a schedule stepped on one rank only (``ReduceLROnPlateau`` on a rank-local metric)
    would otherwise train each rank's shards with other hyper-parameters, silently."""
    groups = [[(key, _comparable(value)) for key, value in sorted(group.items(), key=lambda kv: str(kv[0]))
               if key != "params"] for group in param_groups]
    return _digest52(json.dumps(groups).encode())


def _comparable(value: Any) -> Any:
    """What of a setting every rank can compare: numbers, strings and their sequences, a tensor's values;
    anything else (an object whose text holds its address) only by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (tuple, list)):
        return [_comparable(v) for v in value]
    return type(value).__name__


def _digest52(data: bytes) -> float:
    return float(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12)


def agree_on_point(shards: ShardGroup, point: str, where: str, fields: Sequence[tuple[str, float]]) -> None:
    """Raise :class:`StepMismatchError` on every rank of ``shards`` unless all are at ``point`` (one of
    :data:`POINTS`; ``where`` names it for the message, e.g. ``"ShardedOptimizerV2.step()"``) with equal
    ``fields`` (at most :data:`POINT_FIELDS` named values).

    One all-reduce (max) of a 52-bit digest of the record and of its negation: every rank learns the
    largest and the smallest digest, equal only when all agree. Two values, not the record: gloo
    all-reduces up to two values in one round trip and longer tensors in two (250 against 450 us on
    this project's machine). Only when they differ do the ranks all-reduce the records themselves (the
    same way) to name what differs. A collective: every rank calls it at the same point (that is what
    it checks)."""
    if not shards.sharded:
        return
    if len(fields) > POINT_FIELDS:
        raise ValueError(f"internal error: {len(fields)} fields at {where}, at most {POINT_FIELDS}")
    record = [float(POINTS.index(point))] + [float(v) for _, v in fields]
    record += [0.0] * (1 + POINT_FIELDS - len(record))
    digest = _digest52(json.dumps(record).encode())
    extremes = torch.tensor([digest, -digest], dtype=torch.float64)
    shards.all_reduce_(extremes, dist.ReduceOp.MAX, what=f"the ranks' agreement at {where}")
    if extremes[0].item() == -extremes[1].item():
        return
    both = torch.tensor(record + [-v for v in record], dtype=torch.float64)
    shards.all_reduce_(both, dist.ReduceOp.MAX, what=f"the ranks' agreement at {where}")
    high, low = both[:len(record)].tolist(), [-v for v in both[len(record):].tolist()]
    if high == low:
        return
    if high[0] != low[0]:
        reached = sorted({POINTS[int(low[0])], POINTS[int(high[0])]})
        raise StepMismatchError(
            f"the {shards.world} ranks are at different points of training: some reached {reached[0]!r}, "
            f"others {reached[1]!r} (this rank: {where}). Every rank must run the same forwards, backwards, "
            f"clip_grad_norm and step calls in the same order; the training state now differs between the ranks: "
            f"restart from a checkpoint")
    differing = [name if name == HYPER_PARAMETERS_FIELD else
                 f"{name}: from {low[i + 1]:g} to {high[i + 1]:g} over the ranks (this rank: {value:g})"
                 for i, (name, value) in enumerate(fields) if high[i + 1] != low[i + 1]]
    raise StepMismatchError(f"the {shards.world} ranks disagree at {where}: " + "; ".join(differing)
                            + ". Every rank must train with the same settings and call the same steps")
