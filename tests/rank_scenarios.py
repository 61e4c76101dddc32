"""Two-rank scenarios run as plain processes that exit the ordinary way (tests/test_rank_disagreement.py).

``python tests/rank_scenarios.py SCENARIO RANK WORLD PORT``: joins a gloo group over TCP on 127.0.0.1,
runs the scenario, prints ``OUTCOME <exception type or ok> <seconds>`` and leaves with the interpreter's
normal teardown (no ``os._exit``, no ``destroy_process_group``), so a worker thread left blocked or a
tensor released at the wrong moment shows as a hang or an abort of the process.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import chunkmem as cm  # noqa: E402
from models import TinyGPT, batches, lm_loss  # noqa: E402


def _zero3(rank: int, dtype: torch.dtype = torch.float32, **model_kwargs):
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=16384, **model_kwargs)
    return model


def _zero3_step(model, optim, x) -> None:
    optim.backward(lm_loss(model(x), x))
    optim.step()


def scaler_differs(rank: int) -> None:
    model = _zero3(rank, torch.float16)
    cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), initial_scale=2**10 if rank == 0 else 2**12)


def clip_on_one_rank(rank: int) -> None:
    model = _zero3(rank)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    x = batches(1, seed=rank)[0]
    optim.backward(lm_loss(model(x), x))
    if rank == 0:
        optim.clip_grad_norm(1.0)
    optim.step()


def lr_on_one_rank(rank: int) -> None:
    """A schedule stepped on one rank only (ReduceLROnPlateau on a rank-local metric): before 2026-11-27 each
    rank stepped its shards with its own lr, silently."""
    model = _zero3(rank)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    x = batches(1, seed=rank)[0]
    _zero3_step(model, optim, x)
    if rank == 1:
        optim.param_groups[0]["lr"] = 5e-4
    _zero3_step(model, optim, x)


def llz_lr_on_one_rank(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters()), partition_grad=True)
    for i, x in enumerate(batches(2, seed=rank)):
        if i == 1 and rank == 1:
            optim.param_groups[0]["weight_decay"] = 0.5
        optim.backward(lm_loss(model(x), x))
        optim.step()


def step_skipped(rank: int) -> None:
    model = _zero3(rank)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    for i, x in enumerate(batches(3, seed=rank)):
        optim.backward(lm_loss(model(x), x))
        if not (rank == 1 and i == 1):  # rank 1 skips its second step
            optim.step()


def step_skipped_fp16(rank: int) -> None:
    model = _zero3(rank, torch.float16)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), initial_scale=2**8)
    for i, x in enumerate(batches(3, seed=rank)):
        optim.backward(lm_loss(model(x), x))
        if not (rank == 1 and i == 1):
            optim.step()


def gather_node_size_on_one_rank(rank: int) -> None:
    """A setting that shapes the sub-groups every rank creates, on one rank only: before 2026-11-27 rank 0 waited
    in torch.distributed.new_group for a rank that never came (MiCS' shard_group_size at 4 ranks did the same)."""
    _zero3(rank, gather_node_size=1 if rank == 0 else None)


def disk_on_one_rank(rank: int) -> None:
    disk = dict(offload_optimizer="disk", nvme_path=os.environ["RANK_SCENARIO_DIR"]) if rank == 0 else {}
    _zero3(rank, **disk)


def llz_bucket_differs(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters()), reduce_bucket_size=4096 if rank == 0 else 8192)


def llz_clip_differs(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters()), clip_grad_norm=1.0 if rank == 0 else 0.0,
                             partition_grad=True)


def llz_step_skipped(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters()), partition_grad=True)
    for i, x in enumerate(batches(3, seed=rank)):
        optim.backward(lm_loss(model(x), x))
        if not (rank == 1 and i == 1):
            optim.step()


def partner_gone(rank: int) -> None:
    """Rank 1 never joins rank 0's forward: it sleeps 20 s (far past the 3 s bound), then leaves."""
    cm.set_collective_timeout(3.0)
    model = _zero3(rank)
    if rank == 0:
        x = batches(1)[0]
        model(x)
    else:
        time.sleep(20.0)


def clean_zero3(rank: int) -> None:
    model = _zero3(rank)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    for x in batches(2, seed=rank):
        _zero3_step(model, optim, x)


def clean_zero12(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters()), partition_grad=True,
                                     overlap_communication=True, reduce_bucket_size=2048)
    for x in batches(2, seed=rank):
        optim.backward(lm_loss(model(x), x))
        optim.step()


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))  # gloo's default: chunkmem lowers it
    began = time.monotonic()
    outcome = "ok"
    try:
        globals()[scenario](rank)
    except cm.ChunkmemError as exc:
        outcome = type(exc).__name__
        print(f"MESSAGE {exc}", flush=True)
    print(f"OUTCOME {outcome} {time.monotonic() - began:.1f}", flush=True)


if __name__ == "__main__":
    main()
