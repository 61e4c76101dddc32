"""One ZeRO-3 training step's communication, on paper: bytes per rank and link, and time, at 8 to 1024 ranks.

For a model of ``--params`` parameters in chunks of ``--chunk-numel`` elements on nodes of
``--ranks-per-node`` ranks, each layout's collectives of one step (one forward and backward, no gradient
accumulation) are listed and priced:

* ``flat``: chunkmem's ZeRO-3, every chunk sharded over all W ranks;
* ``mics``: shard groups of one node's ranks (``shard_group_size = ranks per node``);
* ``hpz``: ZeRO++'s secondary partition (``secondary_partition_size``), the backward's gathers inside a node;
* ``qwz``: flat, parameters gathered as int8 with one fp32 scale per ``--block`` elements of each rank's
  shard (``quantized_weights``);
* ``qgz``: flat, gradients exchanged as int8 with one fp32 scale per block in one all-to-all a chunk
  (``quantized_gradients``);
* ``zero++``: hpz + qwz + qgz.

What chunkmem issues, per step, with the parameters resting on the host (``cpu`` or ``auto`` placement,
modules using their chunks in order): every chunk is gathered in the forward and again in the backward,
except the forward's last chunk, which stays gathered into the backward (2C - 1 gathers of C chunks);
every trainable chunk's gradients are reduce-scattered once, in buckets of at most
``reduce_scatter_bucket_size_mb`` of input; with shard groups each reduced shard is then all-reduced once
over the replica group. A collective's bytes sent per rank are those of a ring implementation
(:func:`chunkmem.distributed.traffic.bytes_sent`); a collective whose group spans nodes is priced at the
inter-node bandwidth (the slowest link of the ring), one inside a node at the intra-node bandwidth.
Compute, latency and overlap are left out: the times are the communication alone, serialised.

``--check`` runs the implementation here (gloo, 2 and 4 ranks, flat, 2 groups of 2, and 2 ranks with
quantized gradients or weights, 4 ranks with secondary partitions of 2, and all of ZeRO++) for one step of a
small model and compares the collectives it counted (:mod:`chunkmem.distributed.traffic`) with the
model's list for the same chunks: they must agree exactly (calls and buffer bytes of each kind).

Usage::

    python benchmarks/comm_model.py                      # the 7B and 70B tables (README)
    python benchmarks/comm_model.py --params 13e9 --ranks-per-node 4 --inter-gbps 50
    python benchmarks/comm_model.py --check              # against the collectives counted here (~20 s)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from fractions import Fraction

from chunkmem.distributed.traffic import bytes_sent

LAYOUTS = ("flat", "mics", "hpz", "qwz", "qgz", "zero++")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind in a step: ``calls`` of them over groups of ``world`` ranks, ``buffer_bytes``
    in all (see :mod:`chunkmem.distributed.traffic`), ``spans_nodes`` when a group crosses nodes."""

    what: str
    collective: str
    world: int
    calls: int
    buffer_bytes: int
    spans_nodes: bool

    @property
    def sent(self) -> Fraction:
        return bytes_sent(self.collective, self.world, self.buffer_bytes)


def step_collectives(numels: list[int], trainable: list[bool], world: int, layout: str, *, ranks_per_node: int,
                     element_bytes: int = 2, reduce_element_bytes: int | None = None,
                     bucket_bytes: int = 25 * 2**20, block: int = 2048, group_size: int | None = None
                     ) -> list[Collective]:
    """The collectives one rank takes part in during one step (module docstring) for chunks of ``numels``
    elements (``trainable`` each) on ``world`` ranks. ``group_size``: the shard group (``mics``, default
    ``ranks_per_node``) or the secondary partition (``hpz``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    reduce_element_bytes = reduce_element_bytes or element_bytes
    node = min(ranks_per_node, world)
    group = group_size or node
    quantized_weights = layout in ("qwz", "zero++")
    quantized_grads = layout in ("qgz", "zero++")
    secondary = layout in ("hpz", "zero++")
    shard_world = group if layout == "mics" else world
    spans = shard_world > ranks_per_node
    out: dict[tuple, list[int]] = {}

    def add(what: str, collective: str, n: int, buffer: int, spans_nodes: bool) -> None:
        if n <= 1:
            return
        entry = out.setdefault((what, collective, n, spans_nodes), [0, 0])
        entry[0] += 1
        entry[1] += buffer

    def weight_bytes(numel: int) -> int:  # every rank's shard quantized on its own
        shard = numel // shard_world
        return shard_world * (shard + 4 * math.ceil(shard / block)) if quantized_weights else numel * element_bytes

    for k, numel in enumerate(numels):
        last = k == len(numels) - 1
        add("parameters", "all_gather", shard_world, weight_bytes(numel), spans)  # forward
        if not last:  # backward (the forward's last chunk is still gathered)
            if secondary:  # the secondary partition holds the computed (16-bit) values: not quantized again
                add("parameters", "all_gather", group, numel * element_bytes, group > ranks_per_node)
            else:
                add("parameters", "all_gather", shard_world, weight_bytes(numel), spans)
        if not trainable[k]:
            continue
        if quantized_grads:  # every rank's part quantized on its own: its blocks restart at each part
            part = numel // shard_world
            add("gradients", "all_to_all", shard_world, shard_world * (part + 4 * math.ceil(part / block)), spans)
            continue
        piece = max(bucket_bytes // (shard_world * reduce_element_bytes), 1)
        shard = numel // shard_world
        for start in range(0, shard, piece):
            add("gradients", "reduce_scatter", shard_world, shard_world * (min(start + piece, shard) - start)
                * reduce_element_bytes, spans)
        if layout == "mics" and world > shard_world:
            add("gradients", "all_reduce", world // shard_world, shard * reduce_element_bytes, True)
    return [Collective(what, collective, n, calls, buffer, spans_nodes)
            for (what, collective, n, spans_nodes), (calls, buffer) in sorted(out.items())]


def chunk_numels(params: float, chunk_numel: int, world: int) -> list[int]:
    """``params`` elements in chunks of ``chunk_numel`` (the last one trimmed, every chunk a multiple of
    ``world``)."""
    total = int(params)
    full, rest = divmod(total, chunk_numel)
    numels = [chunk_numel] * full + ([rest] if rest else [])
    return [math.ceil(n / world) * world for n in numels]


def price(collectives: list[Collective], intra_bytes_per_s: float, inter_bytes_per_s: float) -> dict[str, float]:
    """Bytes each rank sends inside a node and across nodes, and the seconds they take, serialised."""
    intra = sum(c.sent for c in collectives if not c.spans_nodes)
    inter = sum(c.sent for c in collectives if c.spans_nodes)
    return {"intra": float(intra), "inter": float(inter),
            "seconds": float(intra) / intra_bytes_per_s + float(inter) / inter_bytes_per_s}


def table(params: float, ranks: tuple[int, ...], ranks_per_node: int, intra_gbps: float, inter_gbps: float,
          chunk_numel: int, block: int) -> list[str]:
    lines = [f"model: {params / 1e9:g}B parameters, 16-bit, chunks of {chunk_numel} elements; nodes of "
             f"{ranks_per_node} ranks; links {intra_gbps:g} GB/s inside a node, {inter_gbps:g} GB/s per rank "
             f"across nodes; quantization blocks of {block} elements",
             f"{'ranks':>6} {'layout':<8} {'intra GB/rank':>14} {'inter GB/rank':>14} {'comm s/step':>12} "
             f"{'x flat':>7}"]
    for world in ranks:
        numels = chunk_numels(params, chunk_numel, world)
        trainable = [True] * len(numels)
        base = None
        for layout in LAYOUTS:
            cost = price(step_collectives(numels, trainable, world, layout, ranks_per_node=ranks_per_node,
                                          block=block), intra_gbps * 1e9, inter_gbps * 1e9)
            base = base or cost["seconds"]
            lines.append(f"{world:>6} {layout:<8} {cost['intra'] / 1e9:>14.2f} {cost['inter'] / 1e9:>14.2f} "
                         f"{cost['seconds']:>12.2f} {cost['seconds'] / base:>7.2f}")
    return lines


# ---- the check against the implementation ----------------------------------------------------------------

def _counted_step(rank: int, world: int, group_size: int | None, layout: str) -> dict:
    import torch

    import chunkmem as cm
    from chunkmem.distributed.traffic import reset_traffic, traffic

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=2 * 64 * 65 * 4, shard_group_size=group_size if layout == "mics" else None,
                              reduce_scatter_bucket_size_mb=0.01, quantized_gradients=layout in ("qgz", "zero++"),
                              quantized_weights=layout in ("qwz", "zero++"),
                              secondary_partition_size=group_size if layout in ("hpz", "zero++") else None)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    for step in range(3):  # the first step traces; the counted one follows the schedule
        if step == 2:
            reset_traffic()
        optim.backward(model(x).square().mean())
        optim.step()
        optim.zero_grad()
    counted = {key: (c.calls, c.buffer_bytes) for key, c in traffic().items()}
    return {"counted": counted, "numels": [c.numel for c in model.chunks],
            "trainable": [c.trainable for c in model.chunks], "bucket_bytes": model.settings.reduction.bucket_bytes}


CASES = ((2, "flat", None), (4, "flat", None), (4, "mics", 2), (2, "qgz", None), (2, "qwz", None), (4, "hpz", 2),
         (4, "zero++", 2))  # (ranks, layout, shard group or secondary partition)


def _counted_steps(rank: int, world: int, cases: list[tuple[int | None, str]]) -> list[dict]:
    """:func:`_counted_step` of each ``(group_size, layout)`` in turn, in one group of ``world`` ranks (each
    case's model built afresh, its counts reset before its counted step)."""
    return [_counted_step(rank, world, group, layout) for group, layout in cases]


def check() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from distributed import run_ranks  # the test suite's gloo launcher

    results_of = {}  # one launch per world size, its cases in turn
    for world in sorted({world for world, _, _ in CASES}):
        cases = [(group, layout) for w, layout, group in CASES if w == world]
        for case, results in zip(cases, zip(*run_ranks(_counted_steps, world, cases))):
            results_of[(world, *case)] = list(results)
    failures = 0
    print(f"{'ranks':>5} {'layout':<7} {'collective':<28} {'model calls/bytes':>18} {'counted calls/bytes':>20}")
    for world, layout, group in CASES:
        results = results_of[world, group, layout]
        first = results[0]
        predicted = step_collectives(first["numels"], first["trainable"], world, layout, ranks_per_node=2,
                                     element_bytes=4, bucket_bytes=first["bucket_bytes"], group_size=group,
                                     block=2048)
        model = {(c.what, c.collective, c.world): (c.calls, c.buffer_bytes) for c in predicted}
        for rank, result in enumerate(results):
            if result["counted"] != model:
                failures += 1
                print(f"rank {rank}: counted {result['counted']} != model {model}")
        for key, value in model.items():
            counted = first["counted"].get(key)
            mark = "MATCH" if counted == value else "DIFF"
            print(f"{world:>5} {layout:<7} {' '.join(map(str, key)):<28} {str(value):>18} {str(counted):>20}  {mark}")
    print("every count agrees" if not failures else f"{failures} rank(s) disagree with the model")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, action="append", help="parameters (default: 7e9 and 70e9)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--intra-gbps", type=float, default=150.0, help="GB/s per rank inside a node")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="GB/s per rank across nodes")
    parser.add_argument("--chunk-numel", type=int, default=2**26, help="elements per chunk")
    parser.add_argument("--block", type=int, default=2048, help="elements per quantization scale")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="world sizes (default 8 to 1024)")
    parser.add_argument("--check", action="store_true", help="compare with the collectives counted at 2 and 4 ranks")
    args = parser.parse_args()
    if args.check:
        return check()
    for params in args.params or [7e9, 70e9]:
        print("\n".join(table(params, tuple(args.ranks), args.ranks_per_node, args.intra_gbps, args.inter_gbps,
                              args.chunk_numel, args.block)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
