"""What a user does between ``optim.step()`` and the next forward, while the step's copies are still in flight: a
differential fuzz against plain torch and between the copy engines, bit for bit.

``optim.step()`` ends by starting to fetch the chunks of the next forward's first period (``cpu`` and ``auto``),
and under ``static`` with ``offload_optim_frac=1.0`` it leaves the copy of each host-updated chunk back to the
device in flight. Whatever touches such a chunk before the next forward must wait for its copy or drop it. The
deferred copy engine (chunkmem/core/copy_engine.py) finds a missing wait without a GPU: a copy completes only when
its handle is waited on, and until then its destination is NaN.

A seeded sequence trains :data:`ITERATIONS` + 1 iterations (forward; backward by ``optim.backward(loss)`` or
``loss.backward()``; step) and spreads :data:`OPS_BETWEEN_STEPS` operations drawn from :data:`OPS` over the gaps
after the steps: in-place writes of a parameter under ``torch.no_grad()`` (``p.mul_(0.5)``, ``p.data.add_(1)``,
``p.copy_(v)``); the same inside ``GatheredParameters(..., modifier_rank=0)`` over one, three or all parameters;
a read inside a read-only ``GatheredParameters``; ``chunkmem.utils.safe_set_full_fp32_param`` and
``safe_set_full_optimizer_state`` of values read with the getters; ``model.load_state_dict`` and
``optim.load_state_dict`` of the state dicts last read (the optimizer's possibly from before the first step);
a checkpoint saved and loaded back; reads (``p.detach().clone()``, ``model.state_dict()``, ``optim.state_dict()``,
the ``safe_get_full_*`` accessors, ``p.grad``, ``memory_stats()``, which must not change any chunk's copy state);
an eval-mode forward under ``torch.no_grad()``; a forward of another batch shape (the schedule is traced again);
``optim.zero_grad()`` with ``set_to_none`` either way; a second ``step()``; ``clip_grad_norm_``; a new ``lr``.
Within the iterations: now and then a batch of another shape, ``zero_grad()`` between the backward and the step,
and ``model.state_dict()`` there (refused while a ``step_in_backward`` backward's updates wait for the step, and
then changing no chunk's copy state).

(b) Against torch: torch's side is a copy of the module trained by ``torch.optim.AdamW(fused=True)``, over its fp32
parameters or, for bf16, over fp32 masters of the bf16 module (HybridAdam's update is fused AdamW's bit for bit). It
mirrors every operation; a ``GatheredParameters`` write rewrites a master only where the new bf16 value differs
from the master's rounding, as chunkmem's does, and where the step clips, torch's gradients are multiplied by
chunkmem's coefficient. Every drawn read, loss and forward output, and at the end the parameters,
``model.state_dict()`` and the optimizer's state, must equal torch's (``torch.equal``). The machinery, including
the refusal rule, is test_semantics_fuzz.py's :class:`Sequence`: a :class:`chunkmem.ChunkmemError` counts only
when the parameters and the optimizer state are still torch's, and the operation is then skipped on both sides.
One sequence in three also compares the parameters after every operation; the others compare only at the drawn
reads, so that no comparison waits for a copy that the operation under test forgot.

(a) Between the engines: each sequence runs once under the plain and once under the deferred engine. The
operations and refusals (``history``), what the reads returned, ``memory_stats()`` (less what depends on the
engine by design: :data:`ENGINE_DEPENDENT_STATS`, and with ``step_in_backward`` the per-period statistics and
peaks) and the final state dicts must be equal, and free of NaN.

Configurations (:data:`CONFIGS`): ``cpu``, ``auto`` (a device tier small enough that chunks move) and ``static``
with ``offload_optim_frac=1.0``; fp32 and bf16; ``step_in_backward`` off and on; ``cpu`` bf16 with the parameters
on disk (``offload_param="disk"``); and two with clipping, where the step undoes and redoes the backward's updates.
:func:`test_a_missing_wait_fails_the_fuzz` shows that the fuzz fails when one wait is skipped.

No defect of chunkmem found when this file was written (2026-11-28).
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch

import chunkmem as cm
from chunkmem import utils
from chunkmem.runtime.executor import ChunkExecutor
from tests.test_deferred_reads_fuzz import DTYPES, _assert_equal, _assert_no_nan, _build, _clone, _config_id, _reference
from tests.test_deferred_reads_fuzz import _one_thread  # noqa: F401 (its autouse fixture: one intra-op thread here too)
from tests.test_semantics_fuzz import Sequence

ITERATIONS = 8
OPS_BETWEEN_STEPS = 20
SEQUENCES = 3
ODD_SHAPES = ((1, 16), (3, 12), (2, 8))  # (batch, sequence length): the schedule is traced again for each
ENGINE_DEPENDENT_STATS = ("copy_engine", "block_pool", "capacity_bytes")
"""Not compared between the engines: each engine's own counters; the block pool's cache (the deferred engine keeps a
copy's source from reuse until the copy runs); the default capacity (it follows the machine's free memory)."""
OPS = {  # operation between a step and the next forward -> weight of its draw
    "param_in_place": 3, "gathered_write": 3, "set_param": 2, "set_state": 2, "load_earlier": 1,
    "optim_load_earlier": 1, "checkpoint": 1, "read_params": 2, "state_dict": 2, "optim_state_dict": 1,
    "accessors": 2, "read_grads": 1, "memory_stats": 2, "eval_forward": 2, "odd_batch_forward": 2, "zero_grad": 2,
    "optim_round_trip": 1, "gathered_read": 2, "extra_step": 1, "clip": 1, "lr": 1,
}


def _changes(rng, shape: torch.Size, dtype: torch.dtype) -> tuple[str, Callable[[torch.Tensor], object]]:
    """An in-place change of a parameter drawn with ``rng``: its description and the change (on either side)."""
    kind = rng.randrange(3)
    if kind == 0:
        return "mul_(0.5)", lambda p: p.mul_(0.5)
    if kind == 1:
        return "data.add_(1)", lambda p: p.data.add_(1)
    seed = rng.randrange(2**31)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return f"copy_(randn seeded {seed})", lambda p: p.copy_(value)


def _seeded_noise(seed: int, shape: torch.Size, scale: float) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class _MastersAdamW(torch.optim.AdamW):
    """Fused AdamW (``_build``'s HybridAdam hyperparameters) over the fp32 masters of a 16-bit module, whose
    ``zero_grad`` is also the module's: the backward gives the module's parameters their gradients, which the
    step copies to the masters."""

    def __init__(self, module: torch.nn.Module, masters: list[torch.Tensor]) -> None:
        super().__init__(masters, lr=1e-2, weight_decay=0.01, fused=True)
        self.module = module

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.module.zero_grad(set_to_none)


class AfterStepSequence(Sequence):
    """A random sequence on a chunkmem model built by test_deferred_reads_fuzz.py's ``_build`` under one copy
    engine, and on torch's side (the module docstring). ``log``: what the drawn reads returned, for the
    comparison of the engines."""

    ops = OPS

    def __init__(self, seed: int, config: dict, engine: str, work_dir, check_every_op: bool) -> None:
        self.config, self.engine = config, engine
        self.work_dir = work_dir / engine
        self.work_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(seed, "hybrid", config["placement"], check_every_op)
        self.log: list[tuple[str, object]] = []
        self.earlier = (_clone(self.model.state_dict()), _clone(self._theirs_fp32()))
        self.earlier_optim = (_clone(self.optim.state_dict()), _clone(self.plain_optim.state_dict()))

    def build(self, optimizer: str, placement: str):
        disk_dir = None
        if self.config.get("param_disk"):
            disk_dir = self.work_dir / "nvme"
            disk_dir.mkdir(exist_ok=True)
        model, optim = _build(self.engine, self.config, disk_dir)
        dtype = DTYPES[self.config["dtype"]]
        plain = copy.deepcopy(_reference()).to(dtype)
        self.masters = None  # fp32: torch's parameters are their own masters
        trained = list(plain.parameters())
        if dtype != torch.float32:
            self.masters = {name: p.detach().float().clone() for name, p in plain.named_parameters()}
            trained = list(self.masters.values())
        plain_optim = (_MastersAdamW(plain, trained) if self.masters is not None
                       else torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.01, fused=True))
        return model, optim, plain, plain_optim

    # ---- torch's side -----------------------------------------------------------------------------------------

    def _theirs_fp32(self) -> dict[str, torch.Tensor]:
        """torch's fp32 values by parameter name: the masters, or the fp32 parameters themselves."""
        return self.masters if self.masters is not None else self._theirs()

    def _set_theirs_fp32(self, name: str, value: torch.Tensor) -> None:
        """What ``safe_set_full_fp32_param`` and loading a state dict do: the master becomes ``value``, the
        parameter its rounding."""
        with torch.no_grad():
            if self.masters is not None:
                self.masters[name].copy_(value)
            self._theirs()[name].copy_(value)

    def _change_theirs(self, name: str, change) -> None:
        """An in-place change of torch's parameter; a master is rewritten only where the parameter's new value
        differs from the master's rounding (as ``GatheredParameters`` writes back)."""
        param = self._theirs()[name]
        with torch.no_grad():
            change(param)
            if self.masters is not None:
                master = self.masters[name]
                changed = master.to(param.dtype) != param
                master[changed] = param[changed].float()

    def _plain_step(self) -> None:
        """torch's step on the fp32 values (bf16: the masters, given the bf16 gradients in fp32), clipped as
        chunkmem's step clips where ``max_norm`` is set, then the release of the gradients it used."""
        trained = list(self._theirs_fp32().values())
        if self.masters is not None:
            for master, param in zip(trained, self.plain.parameters()):
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
        grads = [t.grad for t in trained if t.grad is not None]
        if self.config["max_norm"] and grads:
            self._clip_as_chunkmem(grads)
        self.plain_optim.step()
        self.plain_optim.zero_grad(set_to_none=True)
        if self.masters is not None:
            with torch.no_grad():
                for name, param in self._theirs().items():
                    param.copy_(self.masters[name])

    def _clip_as_chunkmem(self, grads: list[torch.Tensor]) -> None:
        """The step's clipping: chunkmem's norm (float64 sums), checked against torch's fp32 one to 1e-5, and
        ``torch.nn.utils.clip_grad_norm_``'s coefficient, multiplied into the gradients."""
        norm, theirs = self.optim.global_grad_norm, torch.nn.utils.get_total_norm(grads).item()
        if abs(norm - theirs) > 1e-5 * theirs:
            self.fail(f"the step's gradient norm {norm!r}, torch's {theirs!r}")
        torch._foreach_mul_(grads, min(1.0, self.config["max_norm"] / (norm + 1e-6)))

    # ---- comparisons ------------------------------------------------------------------------------------------

    def compare_state_dicts(self) -> None:
        """``model.state_dict()`` holds the fp32 values: torch's masters (or fp32 parameters)."""
        ours, theirs = self.model.state_dict(), self._theirs_fp32()
        self.log.append(("model.state_dict()", _clone(ours)))
        for name in self.names:
            if not torch.equal(ours[name], theirs[name].detach()):
                self.fail(f"model.state_dict()[{name!r}] differs")

    def check(self, after_step: bool) -> None:
        if self.optim.backward_updates:
            return  # the backward's speculative updates are in the parameters until step(): torch's has none
        super().check(after_step)

    def _copy_states(self) -> list[tuple]:
        return [(c.param.device_state, c.param.shard_state) for c in self.model.chunks]

    # ---- the sequence -----------------------------------------------------------------------------------------

    def play(self) -> None:
        """:data:`ITERATIONS` iterations with the drawn operations after their steps, one more, the comparisons."""
        after = [self.rng.randrange(ITERATIONS) for _ in range(OPS_BETWEEN_STEPS)]  # the step each one follows
        ops, weights = zip(*self.ops.items())
        for iteration in range(ITERATIONS + 1):
            self.op_forward_backward()
            if self.rng.random() < 0.1:  # the iteration dropped (set_to_none=True) or stepped with zeros (False)
                self.op_zero_grad()
            if self.rng.random() < 0.2:
                self.op_state_dict_before_step()
            self.op_step()
            for _ in range(after.count(iteration)):
                getattr(self, "op_" + self.rng.choices(ops, weights)[0])()
        self.final_checks()

    def _next_batch(self) -> torch.Tensor:
        x = super()._next_batch()
        if self.rng.random() < 0.15:
            batch, length = self.rng.choice(ODD_SHAPES)
            x = torch.cat([x, x])[:batch, :length]
        return x

    def op_state_dict_before_step(self) -> None:
        """Refused while a ``step_in_backward`` backward's updates wait for the step (the parameters hold them),
        changing nothing; otherwise torch's values before its step."""
        self.history.append("model.state_dict() between the backward and step()")
        if not self.optim.backward_updates:
            self.compare_state_dicts()
            return
        before = self._copy_states()
        with pytest.raises(cm.UnsupportedOperationError):
            self.model.state_dict()
        if self._copy_states() != before:
            self.fail("the refused model.state_dict() changed the chunks' copy states")

    def op_param_in_place(self) -> None:
        name = self.rng.choice(self.names)
        what, change = _changes(self.rng, self._theirs()[name].shape, self._theirs()[name].dtype)
        self.history.append(f"{name}.{what} under no_grad")

        def ours():
            with torch.no_grad():
                change(self._ours()[name])

        self.on_both(what, ours, lambda: self._change_theirs(name, change))
        self.check(False)

    def op_gathered_write(self) -> None:
        """One ``GatheredParameters(..., modifier_rank=0)`` block over one, three or all parameters, changing each."""
        names = self.rng.sample(self.names, self.rng.choice((1, 1, 3, len(self.names))))
        changes = {name: _changes(self.rng, self._theirs()[name].shape, self._theirs()[name].dtype) for name in names}
        self.history.append("GatheredParameters(modifier_rank=0): "
                            + ", ".join(f"{name}.{what}" for name, (what, _) in changes.items()))

        def ours():
            params = self._ours()
            with cm.GatheredParameters([params[name] for name in names], modifier_rank=0), torch.no_grad():
                for name, (_, change) in changes.items():
                    change(params[name])

        def theirs():
            for name, (_, change) in changes.items():
                self._change_theirs(name, change)

        self.on_both("GatheredParameters write", ours, theirs)
        self.check(False)

    def op_gathered_read(self) -> None:
        name = self.rng.choice(self.names)
        self.history.append(f"GatheredParameters([{name}]): read it")
        param = self._ours()[name]
        with cm.GatheredParameters([param]):
            value = param.detach().clone()
        self.log.append((f"gathered {name}", value))
        if not torch.equal(value, self._theirs()[name].detach()):
            self.fail(f"{name} read inside GatheredParameters differs")

    def op_extra_step(self) -> None:
        """A second ``step()`` with no backward since the last: nothing to apply (the gradients were released)."""
        self.op_step()

    def op_set_param(self) -> None:
        """``safe_set_full_fp32_param(p, safe_get_full_fp32_param(p) * 0.5 + noise)``."""
        name, seed = self.rng.choice(self.names), self.rng.randrange(2**31)
        self.history.append(f"safe_set_full_fp32_param({name}, its value * 0.5 + noise seeded {seed})")

        def ours():
            param = self._ours()[name]
            value = utils.safe_get_full_fp32_param(param)
            utils.safe_set_full_fp32_param(param, value * 0.5 + _seeded_noise(seed, value.shape, 0.01))

        def theirs():
            value = self._theirs_fp32()[name].detach()
            self._set_theirs_fp32(name, value * 0.5 + _seeded_noise(seed, value.shape, 0.01))

        self.on_both("safe_set_full_fp32_param", ours, theirs)
        self.check(False)

    def op_set_state(self) -> None:
        """``safe_set_full_optimizer_state(p, safe_get_full_optimizer_state(p, key) * 0.5 + |noise|, key)``."""
        name, seed = self.rng.choice(self.names), self.rng.randrange(2**31)
        key = self.rng.choice(("exp_avg", "exp_avg_sq"))
        self.history.append(f"safe_set_full_optimizer_state({name}, its {key} * 0.5 + |noise| seeded {seed})")

        def ours():
            param = self._ours()[name]
            value = utils.safe_get_full_optimizer_state(param, key)
            if value is None:
                value = torch.zeros(param.shape)
            utils.safe_set_full_optimizer_state(param, value * 0.5 + _seeded_noise(seed, value.shape, 1e-4).abs(),
                                                key)

        def theirs():
            state = self.plain_optim.state[self._theirs_fp32()[name]][key]
            state.copy_(state * 0.5 + _seeded_noise(seed, state.shape, 1e-4).abs())

        self.on_both("safe_set_full_optimizer_state", ours, theirs)
        self.check(True)

    def op_load_earlier(self) -> None:
        ours, theirs = self.earlier
        self.history.append("model.load_state_dict(the last model.state_dict() read)")

        def load_theirs():
            for name, value in theirs.items():
                self._set_theirs_fp32(name, value)

        self.on_both("model.load_state_dict", lambda: self.model.load_state_dict(_clone(ours)), load_theirs)
        self.check(False)

    def op_optim_load_earlier(self) -> None:
        ours, theirs = self.earlier_optim
        self.history.append("optim.load_state_dict(the last optim.state_dict() read)")
        self.on_both("optim.load_state_dict", lambda: self.optim.load_state_dict(_clone(ours)),
                     lambda: self.plain_optim.load_state_dict(_clone(theirs)))
        self.check(True)

    def op_checkpoint(self) -> None:
        self.history.append("save_checkpoint, then load_checkpoint")
        path = self.work_dir / "ckpt.pt"

        def ours():
            cm.save_checkpoint(path, self.model, self.optim)
            cm.load_checkpoint(path, self.model, self.optim)

        self.on_both("checkpoint", ours, lambda: None)
        self.check(True)

    def op_read_params(self) -> None:
        with torch.no_grad():
            self.log.append(("params", {name: p.detach().clone() for name, p in self._ours().items()}))
        super().op_read_params()

    def op_state_dict(self) -> None:
        super().op_state_dict()
        self.earlier = (self.log[-1][1], _clone(self._theirs_fp32()))

    def op_optim_state_dict(self) -> None:
        self.history.append("optim.state_dict()")
        self.log.append(("optim.state_dict()", _clone(self.optim.state_dict())))
        self.compare_optimizer_state()
        self.earlier_optim = (self.log[-1][1], _clone(self.plain_optim.state_dict()))

    def op_accessors(self) -> None:
        self.history.append("the safe_get_full_* accessors")
        theirs = self._theirs_fp32()
        for name, param in self._ours().items():
            reads = {"fp32": utils.safe_get_full_fp32_param(param), "grad": utils.safe_get_full_grad(param)}
            state = self.plain_optim.state.get(theirs[name], {})
            expected = {"fp32": theirs[name].detach(), "grad": None}
            for key in ("exp_avg", "exp_avg_sq"):
                reads[key] = utils.safe_get_full_optimizer_state(param, key)
                expected[key] = state.get(key)
            self.log.append((f"accessors of {name}", reads))
            for key, value in reads.items():
                if (value is None) != (expected[key] is None) or (
                        value is not None and not torch.equal(value, expected[key])):
                    self.fail(f"safe_get_full {key} of {name} differs")

    def op_memory_stats(self) -> None:
        self.history.append("memory_stats()")
        before = self._copy_states()
        stats = self.model.memory_stats()
        if self._copy_states() != before:
            self.fail("memory_stats() changed the chunks' copy states")
        stats = {k: v for k, v in stats.items() if k not in ENGINE_DEPENDENT_STATS}
        if stats["disk"] is not None:
            stats["disk"] = {k: v for k, v in stats["disk"].items() if k != "path"}  # each run has a folder
        if self.config["step_in_backward"]:
            # the backward period a host update completes in, and so how long its chunk stays on the device, depend
            # on the engine: with copies that complete later, the updates run on a thread of their own and complete
            # when the backward ends (host_updates.py)
            del stats["periods"], stats["last_iteration"]
            stats["totals"] = {k: v for k, v in stats["totals"].items() if k.startswith("moved")}
        self.log.append(("memory_stats()", stats))

    def op_odd_batch_forward(self) -> None:
        batch, length = self.rng.choice(ODD_SHAPES)
        x = torch.cat([Sequence._next_batch(self)] * 2)[:batch, :length]
        self.history.append(f"a forward of a {batch}x{length} batch under no_grad")
        with torch.no_grad():
            ours, theirs = self.model(x), self.plain(x)
        self.log.append(("odd batch forward", ours.clone()))
        if not torch.equal(ours, theirs):
            diff = (ours - theirs).abs().max().item()
            self.fail(f"the forward of another batch shape differs: max |diff| {diff:.3e}")
        self.check(False)

    def outcome(self) -> tuple:
        """What the engines' runs must agree on: the operations done and refused, the reads, the final state."""
        return self.history, self.log, (_clone(self.model.state_dict()), _clone(self.optim.state_dict()))


CONFIGS = [dict(placement=placement, dtype=dtype, step_in_backward=sib, max_norm=0.0)
           for placement in ("cpu", "auto", "static") for dtype in ("fp32", "bf16") for sib in (False, True)] + [
    dict(placement="cpu", dtype="bf16", step_in_backward=False, max_norm=0.0, param_disk=True),
    # clipping: the step undoes the backward's updates and redoes them clipped
    dict(placement="static", dtype="fp32", step_in_backward=True, max_norm=0.05),
    dict(placement="auto", dtype="bf16", step_in_backward=True, max_norm=0.05)]


def _compare_engines(config: dict, seed: int, tmp_path) -> None:
    """The sequence drawn with ``seed`` under the plain and the deferred engine, each compared with torch as it
    runs, then with each other."""
    outcomes = {}
    for engine in ("plain", "deferred"):
        sequence = AfterStepSequence(seed, config, engine, tmp_path, check_every_op=seed % 3 == 0)
        sequence.run(engine)
        outcomes[engine] = sequence.outcome()
    where = f"seed {seed}, operations:\n  " + "\n  ".join(outcomes["deferred"][0]) + "\n"
    _assert_no_nan(outcomes["deferred"][1:], where)
    _assert_equal(outcomes["plain"], outcomes["deferred"], where)


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="bit for bit against torch on the CPU: with CUDA the "
                              "device tier computes on the GPU")


@cpu_only
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_operations_between_step_and_forward_train_as_plain_torch(config, tmp_path):
    for sequence in range(SEQUENCES):
        _compare_engines(config, 1000 * CONFIGS.index(config) + sequence, tmp_path / f"s{sequence}")


@cpu_only
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[8]], ids=_config_id)
def test_a_missing_wait_fails_the_fuzz(config, monkeypatch, tmp_path):
    """The control: a fetch that does not wait for a copy already in flight (the step's fetch for the next
    forward under ``cpu``; under ``static``, the copy back of a host update, which a steady iteration waits for
    at its start, and a ``GatheredParameters`` block between the step and the forward reads) makes the fuzz fail:
    the copy's destination is read as NaN."""
    def fetch_without_waiting_for_copies_in_flight(self, chunks, exact=False):
        fetch(self, [c for c in chunks if not c.param.fetching], exact)

    fetch = ChunkExecutor.fetch
    monkeypatch.setattr(ChunkExecutor, "fetch", fetch_without_waiting_for_copies_in_flight)
    monkeypatch.setattr(AfterStepSequence, "ops", {"gathered_write": 1, "odd_batch_forward": 1})
    with pytest.raises(AssertionError, match="nan"):
        _compare_engines(config, 1, tmp_path)
