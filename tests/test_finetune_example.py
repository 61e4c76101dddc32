"""examples/finetune_hf.py with tiny settings (skipped without transformers): the loss falls, --save writes
a checkpoint and a Hugging Face export, --resume continues bit for bit."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "finetune_hf.py")
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "32", "--seq-len", "16", "--batch-size", "4",
        "--steps", "8", "--warmup", "2", "--lr", "1e-2", "--log-every", "4", "--eval-every", "4", "--quiet"]


def _example():
    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_falls_and_resume_continues_bitwise(tmp_path):
    example = _example()
    straight = example.main(TINY)
    losses = straight["losses"]
    assert len(losses) == 8
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2
    assert [s for s, _ in straight["eval_losses"]] == [4, 8]
    assert straight["eval_losses"][1][1] < straight["eval_losses"][0][1]

    first = example.main(TINY + ["--stop-at", "4", "--save", str(tmp_path / "run")])
    assert first["losses"] == losses[:4]
    resumed = example.main(TINY + ["--resume", str(tmp_path / "run")])
    assert resumed["losses"] == losses[4:]  # bit for bit: masters, moments, schedule, random state
    ours, theirs = resumed["model"].state_dict(), straight["model"].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    # the hf/ export of the first half loads with plain transformers and holds its weights
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "hf")
    saved = first["model"].state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, saved["model." + key]), key
    # ...and is a valid --model for another fine-tuning run
    again = example.main(TINY + ["--model", str(tmp_path / "run" / "hf"), "--steps", "2"])
    assert len(again["losses"]) == 2
