"""The disk tier's benchmarks run end to end in their tiny modes: disk_adam.py (bytes per step checked
against 12 B a parameter each way, every buffer_count), largest_model.py with the optimizer state on disk
under `cpu` and under `auto` with a small host capacity (bitwise equal results, a different run told
apart), and the estimate of the disk tier's files against the files made."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_disk_adam_tiny_counts_exact_bytes_for_every_buffer_count(tmp_path):
    out = _run("disk_adam.py", "--tiny", "--nvme-path", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # 4 layers x 256 x 256 parameters, one 12-byte fp32 state triple each, read and written once a step
    assert "formula 12 B x 262,144 = 3,145,728 each way: MATCH" in out.stdout
    assert "read 3,145,728, written 3,145,728" in out.stdout
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) MiB \|", out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8]
    # the I/O buffers: buffer_count x 3 families x 64 KiB, and the one buffer of whole-region writes
    assert [float(r[1]) for r in rows] == [round((c * 3 + 1) * 65536 / 2**20, 1) for c in (1, 2, 4, 8)]
    assert "TINY run done" in out.stdout
    assert os.listdir(tmp_path) == []  # scratch files and the bandwidth file are gone


def test_largest_model_tiny_auto_with_half_the_state_on_disk_is_bitwise_the_all_on_disk_run(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    first = tmp_path / "disk.json"
    out = _run("largest_model.py", "--tiny", "--dtype", "bf16", "--nvme-path", scratch, "--no-atomic-step",
               "--results", first)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(first.read_text())
    assert len(result["losses"]) == 2 and len(result["checksum"]) == 64
    # all three chunks' state on disk: 12 B a chunk element read and written by each step
    chunk_elements = 3 * 65536
    assert f"disk read {12 * chunk_elements / 2**30:.2f} GiB" in out.stdout
    assert re.search(r"model.tier_bytes\(\): exp_avg 0.8 MiB, exp_avg_sq 0.8 MiB, master 0.8 MiB", out.stdout)
    # one slot of 3 chunks x 65536 fp32 elements (4096-aligned) per family: the estimate is exact
    assert f"files {3 * 3 * 65536 * 4:,} bytes (estimated {3 * 3 * 65536 * 4:,})" in out.stdout

    # auto, a host capacity of the 16-bit parameters + the I/O buffers + about one chunk's state
    out = _run("largest_model.py", "--tiny", "--dtype", "bf16", "--nvme-path", scratch, "--no-atomic-step",
               "--placement", "auto", "--host-memory", "2MiB", "--compare-to", first)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BITWISE EQUAL" in out.stdout
    assert re.search(r"model.tier_bytes\(\): exp_avg 0.5 MiB, exp_avg_sq 0.5 MiB, master 0.5 MiB", out.stdout)

    # a run that differs (one step) is told apart and fails
    out = _run("largest_model.py", "--tiny", "--dtype", "bf16", "--nvme-path", scratch, "--steps", "1",
               "--compare-to", first)
    assert out.returncode == 1 and "DIFFERENT" in out.stdout, out.stdout + out.stderr
    assert os.listdir(scratch) == []


def test_largest_model_tiny_atomic_step_files_are_two_slots(tmp_path):
    out = _run("largest_model.py", "--tiny", "--dtype", "bf16", "--nvme-path", tmp_path, "--steps", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"files {2 * 3 * 3 * 65536 * 4:,} bytes (estimated {2 * 3 * 3 * 65536 * 4:,})" in out.stdout
