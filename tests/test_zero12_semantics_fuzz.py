"""The differential fuzz of ``test_semantics_fuzz.py`` for :class:`chunkmem.LowLevelZeroOptimizer` (ZeRO-1/2) in one
process: random sequences of ordinary user operations on a plain module trained by LowLevelZeroOptimizer and on the
same module with ``torch.optim.AdamW(fused=True)``, compared bit for bit after every operation (the parameters, and
after steps each parameter's ``step``, ``exp_avg``, ``exp_avg_sq`` and the fp32 masters of ``model_state_dict``),
with the machinery, the operations and the refusal rule of that file (a :class:`chunkmem.ChunkmemError` counts only
when nothing changed; the operation is then skipped on both sides). Added here: ``clip_grad_value_``, in-place
changes and assignments of ``p.grad`` (``mul_``, ``div_``, ``add_``, ``zero_``, ``copy_``, ``clamp_``, an index
write, ``p.grad = tensor``), a backward inside ``optim.no_sync()``, ``model.zero_grad()``, the wrapped optimizer's
``zero_grad``, in-place changes of a parameter under ``torch.no_grad()``, ``model.load_state_dict``, and loading
torch's optimizer's state dict.

The configurations: stage 1 and stage 2 (``partition_grad``), ``cpu_offload`` off and on, fp32; the wrapped
optimizer ``torch.optim.AdamW(fused=True)`` or HybridAdam (both run chunkmem's Adam kernel, whose fp32 update is
fused AdamW's bit for bit), and AdamW with the optimizer's own clipping (``clip_grad_norm=``).

Mirrored on torch's side, by design (DESIGN.md principle 12, the reference being ColossalAI's LowLevelZeroOptimizer):
the step releases the gradients it used; the optimizer's own clipping takes the reference's norm (float64 sums of
exact squares, not torch's fp32 ``clip_grad_norm_`` norm: checked to 1e-5 relative) and its coefficient
``max_norm / (norm + 1e-6)`` clamped to 1, which torch's side multiplies into its gradients before its step.

Before 2026-11-28 it found (regression tests in test_zero12_idioms.py): ``p.grad = tensor`` then
``zero_grad(set_to_none=False)`` dropped the gradient (``p.grad`` read ``None``, the step left ``p`` alone; torch
zeroes the tensor and steps zeros), and a backward, one inside ``no_sync`` and one outside summed the gradients as
``g1 + (g2 + g3)`` where torch sums ``(g1 + g2) + g3`` (the last bits; one rank now defers nothing).
"""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from tests.models import lm_loss
from tests.test_semantics_fuzz import OPS as BASE_OPS
from tests.test_semantics_fuzz import SEEDS, Branching, Sequence, _groups

OWN_CLIP = 0.5  # the optimizer's own clipping, where configured
OPS = {**BASE_OPS, "clip_value": 1, "grad_in_place": 2, "no_sync_backward": 2, "module_zero_grad": 1,
       "wrapped_zero_grad": 1, "param_in_place": 1, "module_load_state_dict": 1, "load_torch_state": 1}


class ZeroSequence(Sequence):
    """A random sequence on LowLevelZeroOptimizer over a plain module (``self.model`` is that module)."""

    ops = OPS

    def __init__(self, seed: int, stage: int, cpu_offload: bool, optimizer: str, own_clip: bool,
                 check_every_op: bool) -> None:
        self.config = (stage, cpu_offload, optimizer, own_clip)
        super().__init__(seed, optimizer, "cpu", check_every_op)

    def build(self, optimizer: str, placement: str):
        stage, cpu_offload, optimizer, own_clip = self.config
        torch.manual_seed(0)
        reference = Branching()
        plain = copy.deepcopy(reference)
        plain_optim = torch.optim.AdamW(_groups(plain), lr=1e-2, weight_decay=0.01, fused=True)
        module = copy.deepcopy(reference)
        if optimizer == "hybrid":
            inner = cm.HybridAdam(_groups(module), lr=1e-2, weight_decay=0.01)
        else:
            inner = torch.optim.AdamW(_groups(module), lr=1e-2, weight_decay=0.01, fused=True)
        optim = cm.LowLevelZeroOptimizer(inner, partition_grad=stage == 2, cpu_offload=cpu_offload,
                                         clip_grad_norm=OWN_CLIP if own_clip else 0.0)
        return module, optim, plain, plain_optim

    def note_moves(self) -> None:
        """No tiers here."""

    def final_checks(self) -> None:
        super().final_checks()
        self.compare_masters()

    def compare_masters(self) -> None:
        """The fp32 masters (``model_state_dict``) are the parameters, as torch's fp32 module is its own."""
        ours, theirs = self.optim.model_state_dict(self.module), self.plain.state_dict()
        for key, value in theirs.items():
            if not torch.equal(ours[key], value):
                self.fail(f"optim.model_state_dict(module)[{key!r}] differs")

    def check(self, after_step: bool) -> None:
        super().check(after_step)
        if self.check_every_op and after_step:
            self.compare_masters()

    def _plain_step(self) -> None:
        """torch's step (after ``clip_grad_norm_`` where the optimizer clips itself), then the release of the
        gradients it used, as the reference's step releases them."""
        if self.config[3]:
            self.plain_clip()
        super()._plain_step()

    def plain_clip(self) -> None:
        """The optimizer's own clipping on torch's side: the reference's (ColossalAI's) norm is chunkmem's
        ``global_grad_norm`` (float64 sums of exact squares; checked against torch's fp32 one to 1e-5), its coefficient
        ``max_norm / (norm + 1e-6)`` clamped to 1, multiplied into the gradients as torch's ``clip_grad_norm_``
        does."""
        grads = [p.grad for p in self.plain.parameters() if p.grad is not None]
        if not grads:  # no step
            return
        norm = self.optim.global_grad_norm
        theirs = torch.nn.utils.get_total_norm(grads).item()
        if abs(norm - theirs) > 1e-5 * theirs:
            self.fail(f"the optimizer's own clipping: norm {norm!r}, torch's {theirs!r}")
        coef = min(1.0, OWN_CLIP / (norm + 1e-6))
        torch._foreach_mul_(grads, coef)

    def op_forward_backward(self) -> None:
        plain_backward = self.rng.random() < 0.3
        taken = self.rng.random() < 0.6
        x = self._next_batch()
        self.history.append(f"forward_backward(taken={taken}, "
                            f"{'loss.backward()' if plain_backward else 'optim.backward(loss)'})")
        self.module.taken = self.plain.taken = taken
        ours_loss, theirs_loss = lm_loss(self.module(x), x), lm_loss(self.plain(x), x)
        if not torch.equal(ours_loss.detach(), theirs_loss.detach()):
            self.fail(f"loss {ours_loss.item()!r} != {theirs_loss.item()!r}")
        self.on_both("backward", ours_loss.backward if plain_backward else lambda: self.optim.backward(ours_loss),
                     theirs_loss.backward)
        self.check(False)

    def op_eval_forward(self) -> None:
        taken = self.rng.random() < 0.5
        x = self._next_batch()
        self.history.append(f"eval forward under no_grad(taken={taken})")
        self.module.taken = self.plain.taken = taken
        with torch.no_grad():
            if not torch.equal(self.module.eval()(x), self.plain.eval()(x)):
                self.fail("the eval forward's output differs")
        self.module.train()
        self.plain.train()
        self.check(False)

    def op_clip_value(self) -> None:
        value = self.rng.choice([1e-3, 1e-2])
        if all(p.grad is None for p in self.plain.parameters()):
            return  # torch's clip_grad_value_ raises on no gradients at all
        self.history.append(f"clip_grad_value_(model.parameters(), {value})")
        self.on_both("clip_grad_value_", lambda: torch.nn.utils.clip_grad_value_(self.module.parameters(), value),
                     lambda: torch.nn.utils.clip_grad_value_(self.plain.parameters(), value))
        self.check(False)

    def op_grad_in_place(self) -> None:
        name = self.rng.choice(self.names)
        how = self.rng.choice(["mul_(0.5)", "add_(0.01)", "zero_()", "= ones", "div_(3.0)", "= grad * 2", "[0] = 1",
                               "copy_(ones)", "clamp_(-1e-3, 1e-3)"])
        self.history.append(f"{name}.grad.{how}")

        def change(params):
            p = params[name]
            if how == "= ones":
                p.grad = torch.ones_like(p)
            elif p.grad is None:
                return
            elif how == "= grad * 2":
                p.grad = p.grad * 2
            elif how == "[0] = 1":
                p.grad[0] = 1.0
            elif how == "copy_(ones)":
                p.grad.copy_(torch.ones_like(p))
            elif how == "clamp_(-1e-3, 1e-3)":
                p.grad.clamp_(-1e-3, 1e-3)
            else:
                method, argument = how[:-1].split("(")
                getattr(p.grad, method)(*([float(argument)] if argument else []))

        self.on_both("p.grad in place", lambda: change(self._ours()), lambda: change(self._theirs()))
        self.check(False)

    def op_no_sync_backward(self) -> None:
        x = self._next_batch()
        self.history.append("with optim.no_sync(): loss.backward()")
        ours_loss, theirs_loss = lm_loss(self.module(x), x), lm_loss(self.plain(x), x)

        def ours():
            with self.optim.no_sync():
                ours_loss.backward()

        self.on_both("no_sync backward", ours, theirs_loss.backward)
        self.check(False)

    def op_wrapped_zero_grad(self) -> None:
        set_to_none = self.rng.random() < 0.5
        self.history.append(f"optim.optim.zero_grad(set_to_none={set_to_none}) (the wrapped optimizer's)")
        self.on_both("the wrapped optimizer's zero_grad", lambda: self.optim.optim.zero_grad(set_to_none=set_to_none),
                     lambda: self.plain_optim.zero_grad(set_to_none=set_to_none))
        self.check(False)

    def op_load_torch_state(self) -> None:
        self.history.append("optim.load_state_dict(torch's optimizer's state_dict())")
        self.on_both("loading torch's state dict", lambda: self.optim.load_state_dict(self.plain_optim.state_dict()),
                     lambda: None)
        self.check(True)

    def op_module_zero_grad(self) -> None:
        self.history.append("model.zero_grad()")
        self.on_both("model.zero_grad()", self.module.zero_grad, self.plain.zero_grad)
        self.check(False)

    def op_param_in_place(self) -> None:
        name = self.rng.choice(self.names)
        how = self.rng.choice(["mul_", "data.mul_", "copy_"])
        self.history.append(f"with torch.no_grad(): {name}.{how}(...)")

        def change(params):
            p = params[name]
            with torch.no_grad():
                if how == "mul_":
                    p.mul_(0.9)
                elif how == "data.mul_":
                    p.data.mul_(1.1)
                else:
                    p.copy_(torch.full_like(p, 0.125))

        self.on_both("a parameter changed in place", lambda: change(self._ours()), lambda: change(self._theirs()))
        self.check(False)

    def op_module_load_state_dict(self) -> None:
        self.history.append("model.load_state_dict(a changed state dict)")

        def load(module):
            module.load_state_dict({k: v * 0.5 if v.is_floating_point() else v for k, v in module.state_dict().items()})

        self.on_both("module.load_state_dict", lambda: load(self.module), lambda: load(self.plain))
        self.check(False)


CONFIGS = [(stage, offload, optimizer, own_clip) for stage in (1, 2) for offload in (False, True)
           for optimizer, own_clip in (("adamw", False), ("hybrid", False), ("adamw", True))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="bit for bit against torch on the CPU")
@pytest.mark.parametrize("stage,offload,optimizer,own_clip", CONFIGS,
                         ids=[f"stage{s}-{'offload' if o else 'resident'}-{opt}{'-clip' if c else ''}"
                              for s, o, opt, c in CONFIGS])
def test_random_user_operations_train_as_plain_torch(stage, offload, optimizer, own_clip):
    for seed in SEEDS[:3]:  # 3 sequences of 25 operations a configuration: the file in 20 to 40 s on 2 cores
        ZeroSequence(seed, stage, offload, optimizer, own_clip, check_every_op=seed % 2 == 0).play()
