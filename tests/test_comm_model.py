"""``benchmarks/comm_model.py``: its list of a step's collectives equals what the implementation counts
(:mod:`chunkmem.distributed.traffic`) at 2 and 4 gloo ranks, flat, in 2 shard groups of 2 and with quantized
gradients or weights, exactly."""
from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import pytest

from chunkmem.distributed.traffic import bytes_sent

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "comm_model.py")


def _comm_model():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import comm_model
    finally:
        sys.path.pop(0)
    return comm_model


def test_the_model_equals_the_collectives_counted_at_two_and_four_ranks():
    done = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "every count agrees" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("MATCH") == 17 and "DIFF" not in done.stdout


def test_ring_bytes_and_the_layouts_on_paper():
    assert bytes_sent("all_gather", 4, 400) == 300 and bytes_sent("all_reduce", 3, 10) == Fraction(40, 3)
    with pytest.raises(ValueError, match="broadcast"):
        bytes_sent("broadcast", 2, 1)
    model = _comm_model()
    numels = [4096] * 3
    flat = {(c.what, c.collective): c for c in model.step_collectives(numels, [True] * 3, 16, "flat", ranks_per_node=8)}
    assert flat["parameters", "all_gather"].calls == 5 and flat["parameters", "all_gather"].spans_nodes
    mics = model.step_collectives(numels, [True] * 3, 16, "mics", ranks_per_node=8)
    assert [(c.collective, c.world, c.spans_nodes) for c in mics] == [
        ("all_reduce", 2, True), ("reduce_scatter", 8, False), ("all_gather", 8, False)]
    qwz = {c.collective: c for c in model.step_collectives(numels, [True] * 3, 16, "qwz", ranks_per_node=8, block=2048)}
    assert qwz["all_gather"].buffer_bytes == 5 * 16 * (256 + 4)  # each rank's 256 int8 values and one scale
    priced = model.price(mics, 100.0, 10.0)
    assert priced["inter"] == float(sum(c.sent for c in mics if c.spans_nodes))
