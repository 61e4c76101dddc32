"""examples/train_gpt.py: clipping, the LR schedule and --resume. A run stopped at step 2 and resumed
ends bitwise where the uninterrupted run ends (model, optimizer state and the losses it prints)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

import chunkmem as cm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch-size", "2",
        "--steps", "4", "--warmup-steps", "1", "--lr", "0.01", "--grad-clip", "0.5"]


def start(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *TINY, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return stdout


def run(*extra: str) -> str:
    return finish(start(*extra))


def step_losses(stdout: str) -> dict[int, str]:
    rows = (line.split() for line in stdout.splitlines())
    return {int(r[0]): r[1] for r in rows if len(r) >= 5 and r[0].isdigit()}


def test_resume_continues_bitwise(tmp_path):
    whole, first, second = (str(tmp_path / n) for n in ("whole.pt", "first.pt", "second.pt"))
    whole_run, first_run = start("--save", whole), start("--stop-after", "2", "--save", first)  # independent
    straight = step_losses(finish(whole_run))
    finish(first_run)
    resumed = run("--resume", first, "--save", second)
    assert "resumed from" in resumed
    assert sorted(straight) == [1, 2, 3, 4] and sorted(step_losses(resumed)) == [3, 4]
    assert {k: straight[k] for k in (3, 4)} == step_losses(resumed)
    a, b = cm.consolidate_checkpoint(whole), cm.consolidate_checkpoint(second)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    flat_a = [t for t in _tensors(a["optimizer"])]
    flat_b = [t for t in _tensors(b["optimizer"])]
    assert len(flat_a) == len(flat_b) > 0 and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))
    loop = torch.load(second + ".loop0", weights_only=True)
    assert loop["step"] == 4 and loop["scheduler"]["last_epoch"] == 4


def _tensors(tree):
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_gpt
    finally:
        sys.path.pop(0)
    args = SimpleNamespace(lr_schedule="cosine", warmup_steps=2, steps=10)
    factors = [train_gpt.lr_factor(s, args) for s in range(10)]
    assert factors[:3] == [1 / 3, 2 / 3, 1.0]
    assert math.isclose(factors[2 + 4], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert all(a > b for a, b in zip(factors[2:], factors[3:]))
    assert math.isclose(train_gpt.lr_factor(10, args), 0.1)
    assert train_gpt.lr_factor(5, SimpleNamespace(lr_schedule="constant", warmup_steps=2, steps=10)) == 1.0
