"""examples/hf_trainer.py with tiny settings (skipped without transformers or accelerate): the loss falls, the
plain run (--plain) logs the same losses, save_model's directory loads with from_pretrained, and a run resumed
from a checkpoint continues bit for bit."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "hf_trainer.py")
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "32", "--seq-len", "16", "--batch-size", "4",
        "--steps", "8", "--warmup", "1", "--lr", "1e-2", "--log-every", "1", "--quiet"]


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_changed_lines_train_as_the_plain_script_save_and_resume(tmp_path):
    example = _example()
    ours = example.main(TINY + ["--save-steps", "4", "--output-dir", str(tmp_path / "run")])
    losses = ours["losses"]
    assert len(losses) == 8
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2
    plain = example.main(TINY + ["--plain", "--output-dir", str(tmp_path / "plain")])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "run" / "final")
    weights = ours["model"].state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in loaded.state_dict().items())

    resumed = example.main(TINY + ["--output-dir", str(tmp_path / "resumed"),
                                   "--resume", str(tmp_path / "run" / "checkpoint-4")])
    assert resumed["losses"] == losses  # Trainer's log of the first 4 steps comes with the checkpoint
    again = resumed["model"].state_dict()
    assert all(torch.equal(again[key], weights[key]) for key in weights)
