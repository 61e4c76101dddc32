"""Ranks that disagree stop with a clear error on every rank, within seconds, and the processes exit.

Each scenario runs as two plain gloo processes (tests/rank_scenarios.py) that leave with the ordinary
interpreter teardown. Every rank must end with the expected chunkmem error (never a silent divergence,
a gloo abort or a hang) and both processes must exit with code 0 within ``EXIT_BOUND`` seconds of their
start: the disagreement is seen at construction or in the step's own first collective, never at the
collective timeout.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "rank_scenarios.py")
EXIT_BOUND = 90.0  # seconds from start to exit, torch's import and the gloo rendezvous included


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(name: str, tmp_path, bound: float = EXIT_BOUND) -> list[dict]:
    """Both ranks of ``name``: exit code, outcome, seconds each took from start to exit, output."""
    port = _free_port()
    env = dict(os.environ, RANK_SCENARIO_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    began = time.monotonic()
    procs = [subprocess.Popen([sys.executable, SCRIPT, name, str(r), "2", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    ranks = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(bound - (time.monotonic() - began), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += "\n[killed: did not exit within the bound]"
        outcome = [line.split()[1:] for line in output.splitlines() if line.startswith("OUTCOME ")]
        ranks.append({"rc": proc.returncode, "outcome": outcome[-1][0] if outcome else None,
                      "exited_after": time.monotonic() - began, "output": output})
    return ranks


@pytest.mark.parametrize("scenario, error", [
    ("scaler_differs", "LayoutMismatchError"),
    ("clip_on_one_rank", "StepMismatchError"),
    ("lr_on_one_rank", "StepMismatchError"),
    ("llz_lr_on_one_rank", "StepMismatchError"),
    ("step_skipped", "StepMismatchError"),
    ("step_skipped_fp16", "StepMismatchError"),
    ("disk_on_one_rank", "LayoutMismatchError"),
    ("gather_node_size_on_one_rank", "LayoutMismatchError"),
    ("llz_bucket_differs", "LayoutMismatchError"),
    ("llz_clip_differs", "LayoutMismatchError"),
    ("llz_step_skipped", "StepMismatchError"),
])
def test_disagreement_is_an_error_on_every_rank_and_both_exit(scenario, error, tmp_path):
    ranks = run_scenario(scenario, tmp_path)
    for rank, result in enumerate(ranks):
        assert result["rc"] == 0 and result["outcome"] == error, (rank, result["output"][-3000:])
        assert result["exited_after"] < EXIT_BOUND


def test_a_rank_whose_partner_never_comes_times_out_and_exits_while_the_partner_lives(tmp_path):
    """Rank 0's forward waits for rank 1, which sleeps 20 s: rank 0 raises CollectiveTimeoutError at the
    3 s bound and exits at once (gloo's own worker gives up at the same bound), long before rank 1."""
    ranks = run_scenario("partner_gone", tmp_path)
    first, second = ranks
    assert first["rc"] == 0 and first["outcome"] == "CollectiveTimeoutError", first["output"][-3000:]
    assert second["rc"] == 0 and second["outcome"] == "ok", second["output"][-3000:]
    assert first["exited_after"] < second["exited_after"] - 10, (first["exited_after"], second["exited_after"])


@pytest.mark.parametrize("scenario", ["clean_zero3", "clean_zero12"])
def test_clean_runs_exit_with_code_zero(scenario, tmp_path):
    """A finished run exits 0 with the interpreter's normal teardown (the last collectives' handles are
    kept until then: gloo's worker never drops a tensor's last reference while the interpreter ends).
    benchmarks/clean_exit.py runs this 50 times in a row."""
    for _ in range(3):
        for rank, result in enumerate(run_scenario(scenario, tmp_path)):
            assert result["rc"] == 0 and result["outcome"] == "ok", (rank, result["output"][-3000:])
