"""Finished two-rank runs exit with code 0, run after run (issue 20: 50 in a row, ZeRO-3 and ZeRO-1/2).

Each run is two fresh gloo processes (tests/rank_scenarios.py: a short ZeRO-3 or ZeRO-1/2 training) that
leave with the interpreter's ordinary teardown. Prints one line per configuration and exits non-zero if
any process did not exit with code 0 (an abort at exit, ``terminate called without an active
exception``, was the failure this guards against).

    python benchmarks/clean_exit.py            # 50 runs of each
    python benchmarks/clean_exit.py --runs 5
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_rank_disagreement import run_scenario  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="consecutive two-rank runs per configuration")
    args = parser.parse_args()
    failed = 0
    print(f"{'configuration':<14} {'runs':>5} {'clean':>6} {'seconds per run':>16}")
    for scenario in ("clean_zero3", "clean_zero12"):
        clean, began = 0, time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.runs):
                ranks = run_scenario(scenario, tmp)
                if all(r["rc"] == 0 and r["outcome"] == "ok" for r in ranks):
                    clean += 1
                else:
                    bad = [r for r in ranks if r["rc"] != 0 or r["outcome"] != "ok"]
                    print(f"  a run failed: exit codes {[r['rc'] for r in ranks]}; {bad[0]['output'][-400:]!r}")
        failed += args.runs - clean
        print(f"{scenario:<14} {args.runs:>5} {clean:>6} {(time.monotonic() - began) / args.runs:>16.1f}")
    print("PASS" if not failed else f"MISS: {failed} run(s) did not exit cleanly")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
