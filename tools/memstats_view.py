#!/usr/bin/env python3
"""Draw a chunkmem memory-stats dump (``ShardedModelV2.dump_memory_stats``).

    python tools/memstats_view.py memstats.json --png memstats.png --trace memstats.trace.json

``--png``: device chunk bytes and non-model bytes stacked per period, the capacity as a line, and the
bytes moved to and from the device as markers (needs matplotlib). ``--trace``: a Chrome / Perfetto
trace (open it at ui.perfetto.dev or chrome://tracing) with one slice per period and counters for the
device bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MIB = 2**20


def period_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per period: label, device model bytes, non-model bytes, bytes moved in and out (0 where unknown)."""
    rows = []
    for p in doc["periods"]:
        rows.append({
            "label": f"{p['name']} {p['phase'][0]}",
            "model": p["device_model_bytes"] or 0,
            "non_model": p["non_model_peak_bytes"],
            "in": p["moved_to_device_bytes"] or 0,
            "out": p["moved_to_host_bytes"] or 0,
        })
    return rows


def draw_png(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = period_rows(doc)
    x = list(range(len(rows)))
    model = [r["model"] / MIB for r in rows]
    non_model = [r["non_model"] / MIB for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows) + 2), 4.5))
    ax.bar(x, model, label="chunks on device", color="#4c72b0")
    ax.bar(x, non_model, bottom=model, label="non-model (peak)", color="#dd8452")
    ax.axhline(doc["capacity_bytes"] / MIB, color="black", linestyle="--", linewidth=1, label="capacity")
    top = max([m + n for m, n in zip(model, non_model)] + [1e-9])
    fetched = [i for i, r in enumerate(rows) if r["in"]]
    evicted = [i for i, r in enumerate(rows) if r["out"]]
    ax.scatter(fetched, [top * 1.04] * len(fetched), marker="v", color="#55a868", label="moved to device")
    ax.scatter(evicted, [top * 1.09] * len(evicted), marker="^", color="#c44e52", label="moved to host")
    ax.set_xticks(x)
    ax.set_xticklabels([r["label"] for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, max(top * 1.15, doc["capacity_bytes"] / MIB * 1.05))
    ax.set_title(f"chunkmem: policy {doc['policy']}, {doc['chunks']['count']} chunks, rank {doc['rank']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chrome_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """One complete slice per period (1 µs each, in order) and counters of device bytes."""
    events: list[dict[str, Any]] = []
    for i, (p, r) in enumerate(zip(doc["periods"], period_rows(doc))):
        events.append({"name": r["label"], "ph": "X", "ts": i, "dur": 1, "pid": doc["rank"], "tid": 0,
                       "args": {"chunks": p["chunks"], "moved_to_device_bytes": r["in"],
                                "moved_to_host_bytes": r["out"]}})
        events.append({"name": "device bytes", "ph": "C", "ts": i, "pid": doc["rank"],
                       "args": {"chunks": r["model"], "non_model": r["non_model"]}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", help="a JSON file written by ShardedModelV2.dump_memory_stats")
    parser.add_argument("--png", help="write the picture here (needs matplotlib)")
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace here")
    args = parser.parse_args(argv)
    doc = json.load(open(args.dump))
    if doc.get("schema") != "chunkmem.memstats/1":
        print(f"{args.dump}: not a chunkmem.memstats/1 document", file=sys.stderr)
        return 2
    if args.png:
        draw_png(doc, args.png)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(doc), f)
    if not args.png and not args.trace:
        for r in period_rows(doc):
            print(f"{r['label']:<32} chunks {r['model'] / MIB:8.3f} MiB  non-model {r['non_model'] / MIB:8.3f} MiB  "
                  f"in {r['in'] / MIB:7.3f}  out {r['out'] / MIB:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
