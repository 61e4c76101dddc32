"""A differential fuzz test: random sequences of ordinary user operations, applied side by side to a chunkmem
model and optimizer and to the plain module with torch's optimizer, compared bit for bit after every operation.

Each sequence (a fixed seed) draws operations a training script does: forward and backward (``optim.backward(loss)``
or plain ``loss.backward()`` on chunkmem), the step, ``zero_grad`` with ``set_to_none`` either way, gradient
accumulation (several backwards before a step), freezing and unfreezing a parameter with ``requires_grad_``,
changing a param group's ``lr`` or ``weight_decay``, a branch of the model taken or not,
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``, ``p.grad = None``, reads of the parameters, of
``p.grad`` and of ``model.state_dict()``, an ``optimizer.state_dict()`` / ``load_state_dict()`` round trip and an
eval-mode forward under ``torch.no_grad()``. After every operation each parameter (and, after steps, each parameter's ``step``,
``exp_avg`` and ``exp_avg_sq`` in the optimizer's state dict) must be ``torch.equal`` to plain torch's.

A chunkmem refusal (a :class:`chunkmem.ChunkmemError`) is accepted only when nothing changed before it was
raised; the operation is then skipped on both sides (a refused step is followed by ``zero_grad()`` on both, as a
user would do). Sequences alternate between comparing after every operation (the comparison reads the
parameters and so waits for copies) and comparing through the losses only, with reads at the end, so that a read
cannot hide a missing wait of the ``deferred`` copy engine.

The configurations: placement ``cuda``, ``cpu`` and ``auto`` (with a device capacity small enough that chunks
move), HybridAdam against ``torch.optim.AdamW(fused=True)`` and a wrapped ``torch.optim.AdamW`` against the same,
the ``plain`` and the ``deferred`` copy engine.

One difference from torch is chunkmem's by design and mirrored on torch's side, not tested: the step releases the
gradients it used, as ColossalAI's does (DESIGN.md principle 12), where torch keeps them (a second ``step()`` with
no backward between re-applies them in torch, and is a no-op here).

Before 2026-11-28 it found: a step after ``zero_grad(set_to_none=False)`` updated nothing (torch steps zeros); a
parameter frozen between its backward and the step was not updated; ``p.grad = None`` still let the step update
the parameter; ``clip_grad_norm_``'s per-parameter norms were off torch's in the last bit; and its norm after a
backward that added to clipped gradients was wrong (the regression tests are in test_torch_semantics.py and
test_plain_idioms.py).
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import chunkmem as cm
from tests.models import TinyGPT, batches, lm_loss

SEEDS = range(6)
OPS_PER_SEQUENCE = 25
AUTO_CAPACITY = 96 * 1024  # bytes: the chunks of 4096 fp32 elements do not all fit, so they move
OPS = {  # operation -> weight
    "forward_backward": 8, "step": 5, "zero_grad": 3, "freeze": 2, "unfreeze": 2, "lr": 1, "weight_decay": 1,
    "clip": 2, "grad_to_none": 1, "read_params": 1, "read_grads": 1, "state_dict": 1, "optim_round_trip": 1,
    "eval_forward": 1,
}


class Branching(TinyGPT):
    """TinyGPT (tied embedding and head, ``side`` used functionally) with a branch that runs only when
    ``taken``."""

    def __init__(self) -> None:
        super().__init__(vocab=64, d=32, layers=2, seq=16)
        self.branch = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.taken = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.taken:
            x = x + self.branch(x)
        x = x + 0.5 * F.linear(x, self.side.weight)
        return self.lm_head(self.ln_f(x))


def _groups(module: nn.Module) -> list[dict]:
    """Matrices with weight decay, vectors without (two param groups, both sides the same split)."""
    named = list(module.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2]},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _sides(optimizer: str, placement: str):
    torch.manual_seed(0)
    reference = Branching()
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(_groups(plain), lr=1e-2, weight_decay=0.01, fused=True)
    module = copy.deepcopy(reference)
    if optimizer == "hybrid":
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                                  dtype=torch.float32, chunk_size=16384)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(_groups(model.module), lr=1e-2, weight_decay=0.01))
    else:  # any torch optimizer: built over the plain module, then wrapped (as chunkmem.initialize does)
        inner = torch.optim.AdamW(_groups(module), lr=1e-2, weight_decay=0.01, fused=True)
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                                  dtype=torch.float32, chunk_size=16384)
        optim = cm.ShardedOptimizerV2(model, inner)
    return model, optim, plain, plain_optim


class Mismatch(AssertionError):
    """chunkmem and torch differ; the message lists the operations that led there."""


class Sequence:
    """One random sequence of operations on both sides; ``history`` lists what was done."""

    ops = OPS  # operation name -> weight of its draw (a subclass adds its own)

    def __init__(self, seed: int, optimizer: str, placement: str, check_every_op: bool) -> None:
        self.rng = random.Random(seed)
        self.model, self.optim, self.plain, self.plain_optim = self.build(optimizer, placement)
        self.module = getattr(self.model, "module", self.model)  # the nn.Module trained (chunkmem's side)
        self.names = [n for n, _ in self.plain.named_parameters()]
        self.data = batches(OPS_PER_SEQUENCE * 2, seed=100 + seed)
        self.batch = 0
        self.check_every_op = check_every_op
        self.history: list[str] = []
        self.moved = 0  # bytes the chunks moved between the tiers in the iterations seen (of a forward)

    def build(self, optimizer: str, placement: str):
        """chunkmem's model and optimizer and torch's, built from the same module (a subclass's sides)."""
        return _sides(optimizer, placement)

    # ---- the two sides' parameters ----------------------------------------------------------------------------

    def _ours(self):
        return dict(self.module.named_parameters())

    def _theirs(self):
        return dict(self.plain.named_parameters())

    def fail(self, what: str) -> None:
        raise Mismatch(f"{what}\nafter the operations:\n  " + "\n  ".join(self.history))

    def compare_params(self) -> None:
        ours, theirs = self._ours(), self._theirs()
        with torch.no_grad():
            for name in self.names:
                a, b = ours[name].detach().clone(), theirs[name].detach()
                if not torch.equal(a, b):
                    self.fail(f"parameter {name} differs: max |diff| {(a - b).abs().max().item():.3e}")

    def compare_state_dicts(self) -> None:
        ours, theirs = self.model.state_dict(), self.plain.state_dict()
        for key, value in theirs.items():
            if not torch.equal(ours[key], value):
                self.fail(f"model.state_dict()[{key!r}] differs")

    def compare_optimizer_state(self) -> None:
        ours, theirs = self.optim.state_dict(), self.plain_optim.state_dict()
        for group_a, group_b in zip(ours["param_groups"], theirs["param_groups"]):
            for key in ("lr", "weight_decay", "params"):
                if group_a[key] != group_b[key]:
                    self.fail(f"param group {key}: {group_a[key]} != {group_b[key]}")
        theirs = {i: e for i, e in theirs["state"].items()}
        if sorted(ours["state"]) != sorted(theirs):
            self.fail(f"parameters with optimizer state differ: {sorted(ours['state'])} != {sorted(theirs)}")
        for index, entry in theirs.items():
            mine = ours["state"][index]
            if int(mine["step"]) != int(entry["step"]):
                self.fail(f"step of parameter {index} ({self.names[index]}): {int(mine['step'])} != "
                          f"{int(entry['step'])}")
            for key in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(mine[key], entry[key]):
                    self.fail(f"{key} of parameter {index} ({self.names[index]}) differs")

    def compare_grads(self) -> None:
        ours, theirs = self._ours(), self._theirs()
        for name in self.names:
            a, b = ours[name].grad, theirs[name].grad
            if (a is None) != (b is None):
                self.fail(f"{name}.grad is {'None' if a is None else 'set'} on chunkmem, "
                          f"{'None' if b is None else 'set'} in torch")
            if a is not None and not torch.equal(a.clone(), b):
                self.fail(f"{name}.grad differs: max |diff| {(a.clone() - b).abs().max().item():.3e}")

    def check(self, after_step: bool) -> None:
        if not self.check_every_op:
            return
        self.compare_params()
        if after_step:
            self.compare_optimizer_state()

    # ---- refusals ---------------------------------------------------------------------------------------------

    def on_both(self, op: str, ours, theirs) -> bool:
        """Run ``ours()`` on chunkmem, then ``theirs()`` on torch, unless chunkmem refuses; a refusal must leave
        the parameters and the optimizer state as they were, that is as torch's (which has not run ``op``)."""
        try:
            result = ours()
        except cm.ChunkmemError as error:
            self.history.append(f"  -> refused: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            self.compare_params()
            self.compare_optimizer_state()
            return False
        other = theirs()
        if isinstance(result, torch.Tensor) and isinstance(other, torch.Tensor) and not torch.equal(result, other):
            self.fail(f"{op} returned {result!r} on chunkmem, {other!r} in torch")
        return True

    # ---- operations -------------------------------------------------------------------------------------------

    def run(self, engine: str) -> None:
        assert self.model.memory_stats()["copy_engine"]["engine"] == engine
        self.play()
        if self.model.memory_stats()["policy"] == "auto":
            assert self.moved, "the chunks never moved between the tiers"

    def play(self) -> None:
        """The drawn operations, a last step, and the final comparisons."""
        ops, weights = zip(*self.ops.items())
        for _ in range(OPS_PER_SEQUENCE):
            getattr(self, "op_" + self.rng.choices(ops, weights)[0])()
        self.op_step()
        self.final_checks()

    def final_checks(self) -> None:
        self.compare_params()
        self.compare_state_dicts()
        self.compare_optimizer_state()

    def _next_batch(self) -> torch.Tensor:
        x = self.data[self.batch % len(self.data)]
        self.batch += 1
        return x

    def op_forward_backward(self) -> None:
        taken = self.rng.random() < 0.6
        plain_backward = self.rng.random() < 0.3
        x = self._next_batch()
        backward = "loss.backward()" if plain_backward else "optim.backward(loss)"
        self.history.append(f"forward_backward(taken={taken}, {backward})")
        self.module.taken = self.plain.taken = taken
        ours_loss = lm_loss(self.model(x), x)
        theirs_loss = lm_loss(self.plain(x), x)
        if not torch.equal(ours_loss.detach(), theirs_loss.detach()):
            self.fail(f"loss {ours_loss.item()!r} != {theirs_loss.item()!r}")
        self.on_both("backward", (ours_loss.backward if plain_backward else lambda: self.optim.backward(ours_loss)),
                     theirs_loss.backward)
        self.note_moves()
        self.check(False)

    def note_moves(self) -> None:
        """Record whether the chunks moved between the tiers (once they have, the placement was exercised)."""
        if not self.moved:
            totals = self.model.memory_stats()["totals"]
            self.moved = totals["moved_to_device_bytes"] + totals["moved_to_host_bytes"]

    def op_step(self) -> None:
        self.history.append("step()")
        if not self.on_both("step", self.optim.step, self._plain_step):
            self.history.append("zero_grad() (after the refusal)")
            self.optim.zero_grad()
            self.plain_optim.zero_grad()
        self.check(True)

    def _plain_step(self) -> None:
        """torch's step, then the release of the gradients it used: chunkmem's step releases them, as
        ColossalAI's does (DESIGN.md principle 12, docs/guides/getting-started.md), where torch keeps them."""
        self.plain_optim.step()
        self.plain_optim.zero_grad(set_to_none=True)

    def op_zero_grad(self) -> None:
        set_to_none = self.rng.random() < 0.5
        self.history.append(f"zero_grad(set_to_none={set_to_none})")
        self.on_both("zero_grad", lambda: self.optim.zero_grad(set_to_none=set_to_none),
                     lambda: self.plain_optim.zero_grad(set_to_none=set_to_none))
        self.check(False)

    def _requires_grad(self, flag: bool) -> None:
        name = self.rng.choice(self.names)
        self.history.append(f"{name}.requires_grad_({flag})")
        self.on_both("requires_grad_", lambda: self._ours()[name].requires_grad_(flag),
                     lambda: self._theirs()[name].requires_grad_(flag))
        self.check(False)

    def op_freeze(self) -> None:
        self._requires_grad(False)

    def op_unfreeze(self) -> None:
        self._requires_grad(True)

    def _group_value(self, key: str, values) -> None:
        index = self.rng.randrange(len(self.plain_optim.param_groups))
        value = self.rng.choice(values)
        self.history.append(f"param_groups[{index}][{key!r}] = {value}")

        def ours():
            self.optim.param_groups[index][key] = value

        def theirs():
            self.plain_optim.param_groups[index][key] = value

        self.on_both(key, ours, theirs)
        self.check(False)

    def op_lr(self) -> None:
        self._group_value("lr", [1e-3, 5e-3, 1e-2, 3e-2])

    def op_weight_decay(self) -> None:
        self._group_value("weight_decay", [0.0, 0.01, 0.1])

    def op_clip(self) -> None:
        max_norm = self.rng.choice([0.05, 0.5, 100.0])
        self.history.append(f"clip_grad_norm_(model.parameters(), {max_norm})")
        self.on_both("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm),
                     lambda: torch.nn.utils.clip_grad_norm_(self.plain.parameters(), max_norm))
        self.check(False)

    def op_grad_to_none(self) -> None:
        name = self.rng.choice(self.names)
        self.history.append(f"{name}.grad = None")

        def set_none(params):
            params[name].grad = None

        self.on_both("p.grad = None", lambda: set_none(self._ours()), lambda: set_none(self._theirs()))
        self.check(False)

    def op_read_params(self) -> None:
        self.history.append("read the parameters")
        self.compare_params()

    def op_read_grads(self) -> None:
        self.history.append("read p.grad")
        self.on_both("reading p.grad", self.compare_grads, lambda: None)
        self.check(False)

    def op_state_dict(self) -> None:
        self.history.append("model.state_dict()")
        self.compare_state_dicts()

    def op_optim_round_trip(self) -> None:
        self.history.append("optim.load_state_dict(optim.state_dict())")
        self.on_both("optimizer state dict round trip", lambda: self.optim.load_state_dict(self.optim.state_dict()),
                     lambda: self.plain_optim.load_state_dict(self.plain_optim.state_dict()))
        self.check(True)

    def op_eval_forward(self) -> None:
        taken = self.rng.random() < 0.5
        x = self._next_batch()
        self.history.append(f"eval forward under no_grad(taken={taken})")
        self.module.taken = self.plain.taken = taken
        self.model.eval()
        self.plain.eval()
        with torch.no_grad():
            ours, theirs = self.model(x), self.plain(x)
        self.model.train()
        self.plain.train()
        if not torch.equal(ours, theirs):
            self.fail("the eval forward's output differs")
        self.check(False)


CONFIGS = [(placement, optimizer, engine) for placement in ("cuda", "cpu", "auto") for optimizer in ("hybrid", "adamw")
           for engine in ("plain", "deferred")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="bit for bit against torch on the CPU: with CUDA the device "
                    "tier computes on the GPU")
@pytest.mark.parametrize("placement,optimizer,engine", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_random_user_operations_train_as_plain_torch(placement, optimizer, engine, monkeypatch):
    monkeypatch.setenv("CHUNKMEM_COPY_ENGINE", engine)
    if placement == "auto":
        cm.set_device_memory_capacity(AUTO_CAPACITY)
    for seed in SEEDS:
        Sequence(seed, optimizer, placement, check_every_op=seed % 2 == 0).run(engine)


@pytest.mark.parametrize("placement", ["auto", "cpu"])
def test_a_chunk_frozen_since_wrapping_leaves_the_device_after_its_backward(placement):
    """Every parameter of a trainable chunk frozen after wrapping (as chunkmem's own error advises): no gradient
    of the backward says when it is done with the chunk, which before 2026-11-28 stayed on the device to the end
    of the backward and filled it ("device tier full during period 17 (blocks.0.fc2 backward)", the pending
    gradients dropped). It now leaves as a chunk laid out frozen does, and training is torch's, bit for bit."""
    cm.set_device_memory_capacity(AUTO_CAPACITY)
    model, optim, plain, plain_optim = _sides("hybrid", placement)
    assert [slot.name for slot in model.chunks[5].slots] == ["blocks.1.fc1.weight"]  # a chunk of its own
    for i, x in enumerate(batches(5, seed=3)):
        if i == 2:
            model.module.blocks[1].fc1.weight.requires_grad_(False)
            plain.blocks[1].fc1.weight.requires_grad_(False)
        model.module.taken = plain.taken = i < 2  # the branch not taken: the case that overfilled the device
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
        lm_loss(plain(x), x).backward()
        plain_optim.step()
        plain_optim.zero_grad()
    ours, theirs = model.state_dict(), plain.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
