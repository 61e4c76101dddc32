"""LowLevelZeroOptimizer (ZeRO-1/2) against independent references: plain PyTorch AdamW on one process
with the doubled batch (fp32), a hand-written 16-bit loop that reduces the two ranks' gradients as the
collectives do (fp16/bf16), exact byte counts, and torch's AdamW state layout."""
import itertools

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.optim.host_adam_ext import fp32_reference_options
from distributed import run_ranks

LR, WD, SCALE, STEPS = 1e-2, 0.01, 2.0**10, 3
# partition_grad, dtype, cpu_offload, overlap_communication, communication_dtype, reduce_scatter: stage 2
# over gloo all-reduces its buckets (faster there); True forces the reduce-scatter NCCL uses
CONFIGS = [c + (None, False) for c in itertools.product((False, True), (torch.float32, torch.float16, torch.bfloat16),
                                                        (False, True), (False, True))]
CONFIGS += [(partition, torch.float16, False, True, torch.float32, False) for partition in (False, True)]
CONFIGS += [(True, dtype, False, overlap, None, True) for dtype in (torch.float32, torch.float16)
            for overlap in (False, True)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8))
    return model.to(torch.bfloat16).float()  # values exact in every 16-bit dtype


def data(steps: int = STEPS, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g).bfloat16().float(), torch.randn(batch, 8, generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _train_configs(rank: int, world: int) -> list:
    results = []
    for partition, dtype, offload, overlap, comm, reduce_scatter in CONFIGS:
        model = make_model().to(dtype)
        optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD),
                                         initial_scale=SCALE, partition_grad=partition, cpu_offload=offload,
                                         overlap_communication=overlap, reduce_bucket_size=100,
                                         communication_dtype=comm)
        assert not optim.buckets.reduce_scatter  # gloo (and one process): all-reduce
        optim.buckets.reduce_scatter = reduce_scatter
        most_in_flight = [0]
        flush = optim.buckets.flush

        def counting_flush() -> None:
            flush()
            most_in_flight[0] = max(most_in_flight[0], len(optim.buckets.in_flight))
        optim.buckets.flush = counting_flush
        for x, y in data():
            half = x.shape[0] // world
            sl = slice(rank * half, (rank + 1) * half)
            optim.backward(loss_fn(model(x[sl].to(dtype)), y[sl]))
            assert optim.buckets.idle  # every collective waited for by the end of the backward
            assert optim.step()
            optim.zero_grad()
        # with overlap, several buckets' collectives are in flight at once during the backward
        assert (most_in_flight[0] >= 2) if overlap else (most_in_flight[0] == 0)
        masters = [optim.master_of(p) for p in model.parameters()]
        results.append(([p.detach().float().clone() for p in model.parameters()], masters,
                        optim.buckets.collectives))
    return results


def reference_16bit(dtype: torch.dtype, comm: torch.dtype | None = None, world: int = 2) -> list[torch.Tensor]:
    """Each rank's half batch through a 16-bit copy, the gradients summed and divided by the world size
    in the communication dtype (as the collectives do), cast back to the 16-bit dtype, unscaled into
    fp32 masters stepped by torch's AdamW."""
    comm = comm or dtype
    model16 = make_model().to(dtype)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model16.parameters()]
    optim = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, **fp32_reference_options())
    scale = SCALE if dtype == torch.float16 else 1.0
    for x, y in data():
        half = x.shape[0] // world
        grads = []
        for r in range(world):
            model16.zero_grad(set_to_none=True)
            sl = slice(r * half, (r + 1) * half)
            (loss_fn(model16(x[sl].to(dtype)), y[sl]) * scale).backward()
            grads.append([p.grad.to(comm) for p in model16.parameters()])
        for master, *per_rank in zip(masters, *grads):
            total = per_rank[0]
            for g in per_rank[1:]:
                total = total + g
            master.grad = (total / world).to(dtype).float() * (1.0 / scale)
        optim.step()
        with torch.no_grad():
            for master, p in zip(masters, model16.parameters()):
                p.copy_(master)
    return [m.detach() for m in masters]


def reference_fp32() -> list[torch.Tensor]:
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())
    for x, y in data():
        loss_fn(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    return [p.detach() for p in model.parameters()]


def _checkpoint_run(rank: int, world: int, path: str) -> bool:
    """Two ranks (stage 2) train, save with chunkmem.save_checkpoint, and a second optimizer loads it and
    continues bitwise as the first does."""
    model = make_model()
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD), partition_grad=True)
    other = make_model()
    resumed = cm.LowLevelZeroOptimizer(cm.HybridAdam(other.parameters(), lr=0.5), partition_grad=True)
    batches = data(4)
    for n, (x, y) in enumerate(batches):
        if n == 2:
            cm.save_checkpoint(path, model, optim)
            cm.load_checkpoint(path, other, resumed)
        pairs = ((model, optim),) if n < 2 else ((model, optim), (other, resumed))
        for m, o in pairs:
            o.backward(loss_fn(m(x[rank * 2:rank * 2 + 2]), y[rank * 2:rank * 2 + 2]))
            o.step()
            o.zero_grad()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def _all_two_rank_scenarios(rank: int, world: int, path: str) -> dict:
    return dict(train=_train_configs(rank, world), bytes=_bytes_of(rank, world),
                overflow=_overflow_on_rank1(rank, world), no_sync=_no_sync_run(rank, world),
                checkpoint=_checkpoint_run(rank, world, path))


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("llz") / "ckpt.pt")


@pytest.fixture(scope="module")
def two_ranks(checkpoint_path) -> list[dict]:
    """Every two-process scenario of this file in one spawn (starting the processes costs most)."""
    return run_ranks(_all_two_rank_scenarios, 2, checkpoint_path)


def test_two_rank_checkpoint_resumes_bitwise_and_loads_everywhere(two_ranks, checkpoint_path):
    assert [r["checkpoint"] for r in two_ranks] == [True, True]
    # the same file into ShardedModelV2 + ShardedOptimizerV2, plain module + torch AdamW, one-rank LLZ
    sharded = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float32)
    sopt = cm.ShardedOptimizerV2(sharded, cm.HybridAdam(sharded.parameters(), lr=0.5))
    cm.load_checkpoint(checkpoint_path, sharded, sopt)
    full = cm.consolidate_checkpoint(checkpoint_path)
    plain = make_model()
    plain.load_state_dict(full["model"])
    adamw = torch.optim.AdamW(plain.parameters(), lr=0.5, **fp32_reference_options())
    adamw.load_state_dict(full["optimizer"])
    for group in adamw.param_groups:  # the loaded groups carry the saving optimizer's fused/foreach
        group.update(fp32_reference_options())
    single = make_model()
    llz = cm.LowLevelZeroOptimizer(torch.optim.AdamW(single.parameters(), lr=0.5))
    cm.load_checkpoint(checkpoint_path, single, llz)
    assert full["optimizer"]["state"][0]["step"].item() == 2.0
    x, y = data(4)[2]
    sopt.backward(loss_fn(sharded(x), y))
    sopt.step()
    loss_fn(plain(x), y).backward()
    adamw.step()
    llz.backward(loss_fn(single(x), y))
    llz.step()
    state = sharded.state_dict()
    for (name, p), q in zip(plain.named_parameters(), single.parameters()):
        assert torch.equal(p, q) and torch.equal(state[name], p.detach()), name


def test_two_ranks_match_one_process_with_the_doubled_batch(two_ranks):
    per_rank = [r["train"] for r in two_ranks]
    refs = {(torch.float32, None): reference_fp32(), (torch.float16, None): reference_16bit(torch.float16),
            (torch.bfloat16, None): reference_16bit(torch.bfloat16),
            (torch.float16, torch.float32): reference_16bit(torch.float16, torch.float32)}
    for n, (partition, dtype, offload, overlap, comm, reduce_scatter) in enumerate(CONFIGS):
        where = (f"partition_grad={partition} dtype={dtype} cpu_offload={offload} overlap={overlap} comm={comm} "
                 f"reduce_scatter={reduce_scatter}")
        (params0, masters0, buckets0), (params1, masters1, buckets1) = per_rank[0][n], per_rank[1][n]
        assert buckets0 == buckets1 and buckets0 >= 2 * STEPS, where  # several buckets per backward
        for p0, p1 in zip(params0, params1):
            assert torch.equal(p0, p1), where  # the replicas agree exactly after the all-gather
        for m0, m1, ref, p0 in zip(masters0, masters1, refs[(dtype, comm)], params0):
            assert torch.equal(m0, m1), where
            # fp32: the mean of two half-batch gradients vs one doubled-batch gradient, fp32 rounding.
            # 16-bit: the reference reduces as the collectives do, so only the fp32 Adam arithmetic
            # (host kernel vs torch) may differ: 1e-6, as the existing mixed-precision tests allow.
            assert rel(m0, ref) <= 1e-6, (where, rel(m0, ref))
            assert torch.equal(p0, m0.to(dtype).float()), where  # working copy = master rounded


def _bytes_of(rank: int, world: int) -> dict:
    out = {}
    for partition, dtype in itertools.product((False, True), (torch.float32, torch.float16)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False)).to(dtype)  # 256 elements
        optim = cm.LowLevelZeroOptimizer(torch.optim.Adam(model.parameters()), partition_grad=partition)
        optim.backward(model(torch.ones(2, 16, dtype=dtype)).float().sum())
        out[(partition, dtype)] = optim.model_state_bytes()
        # the chunks' memory is the shared one: each buffer counted once by the ledger (nothing on the host here),
        # this rank's shard of the working chunk a view of it; the gradient store in the parameters' dtype after
        # one backward, the whole chunk (stage 1) or this rank's shard (stage 2)
        counted = {"param": 256 * dtype.itemsize, "exp_avg": 1024 // world, "exp_avg_sq": 1024 // world,
                   "grad": (256 // world if partition else 256) * dtype.itemsize}
        assert optim.memory.breakdown() == {"device": {**counted, **({"master": 1024 // world} if dtype == torch.float16
                                                                     else {})}, "host": {}}
        assert all(c.own(c.param).data_ptr() == c.param_buffer.local().data_ptr() for c in optim.chunks)
    return out


def test_per_rank_bytes_are_exactly_halved_where_the_stage_says(two_ranks):
    two = [r["bytes"] for r in two_ranks]
    one = _bytes_of(0, 1)
    for (partition, dtype), single in one.items():
        es = 2 if dtype == torch.float16 else 4
        # one process: 256 parameters, 256 gradients, fp32 master only for fp16, two fp32 moments
        assert single == {"params": 256 * es, "grads": 256 * es, "master": 1024 if dtype == torch.float16 else 0,
                          "exp_avg": 1024, "exp_avg_sq": 1024}
        for rank_bytes in (two[0][(partition, dtype)], two[1][(partition, dtype)]):
            assert rank_bytes["params"] == single["params"]  # replicated
            assert rank_bytes["grads"] == (single["grads"] // 2 if partition else single["grads"])
            for family in ("master", "exp_avg", "exp_avg_sq"):
                assert rank_bytes[family] == single[family] // 2


def _overflow_on_rank1(rank: int, world: int) -> dict:
    model = make_model().half()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), hysteresis=1,
                                     partition_grad=True)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(1)[0]
    loss = loss_fn(model(x[rank * 2:rank * 2 + 2].half()), y[rank * 2:rank * 2 + 2])
    optim.backward(loss * (float("inf") if rank == 1 else 1.0))
    stepped = optim.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    moments_zero = all(not c.stepped and not any(s.any() for s in c.state.values()) for c in optim.chunks)
    masters_equal = all(torch.equal(optim.master_of(p), b.float()) for p, b in zip(model.parameters(), before))
    return dict(stepped=stepped, unchanged=unchanged, moments_zero=moments_zero, masters=masters_equal,
                scale=optim.loss_scale, dropped=all(c.grad is None for c in optim.chunks))


def test_gradient_stores_are_counted_widened_and_kept_over_zero_grad():
    model = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False)).to(torch.bfloat16)
    optim = cm.LowLevelZeroOptimizer(torch.optim.Adam(model.parameters()))
    (chunk,) = optim.chunks

    def backward() -> None:
        optim.backward(model(torch.ones(2, 16, dtype=torch.bfloat16)).float().sum())

    def grad_bytes() -> int:
        assert optim.model_state_bytes()["grads"] == optim.memory.breakdown()["device"].get("grad", 0)
        return optim.model_state_bytes()["grads"]
    assert grad_bytes() == 0 and chunk.grad is None  # no store before a backward
    backward()
    assert grad_bytes() == 256 * 2 and chunk.grad.dtype == torch.bfloat16
    backward()  # accumulating: summed in fp32
    assert grad_bytes() == 256 * 4 and chunk.grad.dtype == torch.float32
    optim.zero_grad()  # the widened store is given back: the next backward's is 16-bit
    assert grad_bytes() == 0 and chunk.grad is None
    backward()
    kept = chunk.grad.data_ptr()
    optim.zero_grad()  # kept for the next backward, still counted
    assert grad_bytes() == 256 * 2 and chunk.grad is None
    backward()
    assert chunk.grad.data_ptr() == kept and grad_bytes() == 256 * 2
    optim.zero_grad(set_to_none=False)
    assert not chunk.grad.any() and grad_bytes() == 256 * 2


def test_an_overflow_on_one_rank_skips_the_step_on_both(two_ranks):
    for result in [r["overflow"] for r in two_ranks]:
        assert result == dict(stepped=False, unchanged=True, moments_zero=True, masters=True, scale=2.0**15,
                              dropped=True)


K = 3


def _no_sync_run(rank: int, world: int) -> list:
    out = []
    for partition in (False, True):
        model = make_model()
        optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                                         partition_grad=partition, reduce_bucket_size=100)
        for x, y in data(2, batch=2 * world * K):
            mine = slice(rank * 2 * K, (rank + 1) * 2 * K)
            micro = [(x[mine][2 * i:2 * i + 2], y[mine][2 * i:2 * i + 2]) for i in range(K)]
            before = optim.buckets.collectives
            with optim.no_sync():
                for xi, yi in micro[:-1]:
                    optim.backward(loss_fn(model(xi), yi) / K)
            assert optim.buckets.collectives == before  # no collective inside no_sync
            optim.backward(loss_fn(model(micro[-1][0]), micro[-1][1]) / K)
            assert optim.buckets.collectives > before
            optim.step()
            optim.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_no_sync_over_k_micro_batches_equals_one_batch_k_times_larger(two_ranks):
    per_rank = [r["no_sync"] for r in two_ranks]
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())
    for x, y in data(2, batch=2 * 2 * K):
        loss_fn(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    for params in per_rank[0] + per_rank[1]:
        for p, ref in zip(params, model.parameters()):
            assert rel(p, ref.detach()) <= 1e-6


def test_state_dict_is_torch_adamw_layout_and_resumes_bitwise():
    model = make_model()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    batches = data(4)
    for x, y in batches[:2]:
        optim.backward(loss_fn(model(x), y))
        optim.step()
        optim.zero_grad()
    saved_model = optim.model_state_dict(model)
    saved = optim.state_dict()

    # into plain torch AdamW: the exact moments and step; then the same next steps, bitwise
    plain = make_model()
    plain.load_state_dict(saved_model)
    adamw = torch.optim.AdamW(plain.parameters(), lr=0.5, weight_decay=WD, **fp32_reference_options())
    adamw.load_state_dict(saved)
    for group in adamw.param_groups:  # the loaded groups carry the saving optimizer's fused/foreach
        group.update(fp32_reference_options())
    assert adamw.param_groups[0]["lr"] == LR
    # into a fresh LowLevelZeroOptimizer
    resumed_model = make_model()
    resumed = cm.LowLevelZeroOptimizer(torch.optim.AdamW(resumed_model.parameters(), lr=0.5, weight_decay=WD))
    resumed.load_model_state_dict(resumed_model, saved_model)
    resumed.load_state_dict(saved)
    for x, y in batches[2:]:
        for m, o in ((model, optim), (resumed_model, resumed)):
            o.backward(loss_fn(m(x), y))
            o.step()
            o.zero_grad()
        loss_fn(plain(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    for a, b, c in zip(model.parameters(), resumed_model.parameters(), plain.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert optim.state_dict()["state"][0]["step"].item() == 4.0


def test_checkpoint_loads_into_sharded_optimizer_v2():
    model = make_model()
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    batches = data(3)
    for x, y in batches[:2]:
        optim.backward(loss_fn(model(x), y))
        optim.step()
        optim.zero_grad()
    sharded = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float32)
    sopt = cm.ShardedOptimizerV2(sharded, cm.HybridAdam(sharded.parameters(), lr=0.5, weight_decay=WD))
    sharded.load_state_dict(optim.model_state_dict(model))
    sopt.load_state_dict(optim.state_dict())
    x, y = batches[2]
    optim.backward(loss_fn(model(x), y))
    optim.step()
    sopt.backward(loss_fn(sharded(x), y))
    sopt.step()
    state = sharded.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach())


def test_fp16_checkpoint_keeps_the_fp32_masters():
    model = make_model().half()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), initial_scale=SCALE)
    x, y = data(1)[0]
    optim.backward(loss_fn(model(x.half()), y))
    optim.step()
    saved = optim.model_state_dict(model)
    assert all(v.dtype == torch.float32 for v in saved.values())
    other = make_model().half()
    resumed = cm.LowLevelZeroOptimizer(torch.optim.AdamW(other.parameters(), lr=LR), initial_scale=SCALE)
    resumed.load_model_state_dict(other, saved)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(optim.master_of(p), resumed.master_of(q)) and torch.equal(p, q)


def test_unscaled_fp16_backward_is_refused():
    model = make_model().half()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()))
    x, y = data(1)[0]
    loss_fn(model(x.half()), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(cm.UnscaledBackwardError):
        optim.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clip_grad_norm_clips_by_the_global_norm():
    model, ref = make_model(), make_model()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), clip_grad_norm=0.05)
    x, y = data(1)[0]
    optim.backward(loss_fn(model(x), y))
    loss_fn(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    assert norm > 0.05  # the clipping is real
    # AdamW's first step moves each element by lr * g / (|g| + eps'): equal for g and c*g up to eps, so
    # compare the first moment instead: (1 - beta1) * clipped gradient
    optim.step()
    sd = optim.state_dict()["state"]
    for i, p in enumerate(ref.parameters()):
        torch.testing.assert_close(sd[i]["exp_avg"], 0.1 * p.grad, rtol=1e-5, atol=1e-9)


BAD = [
    ("initial_scale", 0, cm.InvalidArgumentError), ("min_scale", "1", cm.ArgumentTypeError),
    ("growth_factor", 1.0, cm.InvalidArgumentError), ("backoff_factor", 2.0, cm.InvalidArgumentError),
    ("growth_interval", 0, cm.InvalidArgumentError), ("hysteresis", 1.5, cm.ArgumentTypeError),
    ("max_scale", float("inf"), cm.InvalidArgumentError), ("clip_grad_norm", -1.0, cm.InvalidArgumentError),
    ("clip_grad_norm", float("nan"), cm.InvalidArgumentError), ("verbose", 1, cm.ArgumentTypeError),
    ("reduce_bucket_size", 0, cm.InvalidArgumentError), ("reduce_bucket_size", 2.5, cm.ArgumentTypeError),
    ("communication_dtype", torch.int8, cm.InvalidArgumentError), ("communication_dtype", "fp16", cm.ArgumentTypeError),
    ("overlap_communication", "yes", cm.ArgumentTypeError), ("partition_grad", None, cm.ArgumentTypeError),
    ("cpu_offload", 0, cm.ArgumentTypeError), ("forced_dtype", torch.float64, cm.InvalidArgumentError),
    ("dp_process_group", "world", cm.ArgumentTypeError),
]


@pytest.mark.parametrize("argument,value,error", BAD)
def test_bad_arguments_name_the_argument_and_change_nothing(argument, value, error):
    model = make_model()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(error, match=argument):
        cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), **{argument: value})
    assert [p.data_ptr() for p in model.parameters()] == before  # parameters not repacked
    cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()))  # and still free to wrap


def test_bad_optimizer_and_parameters():
    model = make_model()
    with pytest.raises(cm.ArgumentTypeError, match="optimizer"):
        cm.LowLevelZeroOptimizer(object())
    with pytest.raises(cm.InvalidArgumentError, match="closure"):  # its step cannot run on stand-ins
        cm.LowLevelZeroOptimizer(torch.optim.LBFGS(model.parameters()))
    mixed = make_model()
    mixed[0].half()
    with pytest.raises(cm.InvalidArgumentError, match="forced_dtype"):
        cm.LowLevelZeroOptimizer(torch.optim.Adam(mixed.parameters()))
    cm.LowLevelZeroOptimizer(torch.optim.Adam(mixed.parameters()), forced_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in mixed.parameters())
    with pytest.raises(cm.InvalidArgumentError, match="already managed"):
        cm.LowLevelZeroOptimizer(torch.optim.Adam(mixed.parameters()))
    optim = cm.LowLevelZeroOptimizer(torch.optim.Adam(model.parameters()))
    with pytest.raises(cm.InvalidArgumentError, match="state_dict"):
        optim.load_state_dict({"state": {}})
    assert not any(c.stepped for c in optim.chunks)
    # one parameter with state, the others without (torch's state after steps that skipped them): loaded as it is,
    # each parameter with its own step count (before 2026-11-27 refused: one step a chunk)
    sd = torch.optim.Adam(make_model().parameters()).state_dict()
    sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(16, 8), "exp_avg_sq": torch.ones(16, 8)}}
    optim.load_state_dict(sd)
    state = optim.state_dict()["state"]
    assert list(state) == [0] and int(state[0]["step"]) == 1 and torch.equal(state[0]["exp_avg"], torch.ones(16, 8))


def test_another_optimizers_state_dict_is_refused_and_changes_nothing():
    """An AdamW state dict loaded into LowLevelZeroOptimizer(SGD(momentum=0)): before 2026-11-27 the groups took
    AdamW's lr and weight decay and its moments were dropped, silently (stage 3 refused the same pair)."""
    torch.manual_seed(0)
    source = torch.nn.Linear(8, 8)
    adamw = torch.optim.AdamW(source.parameters(), lr=0.5, weight_decay=0.3)
    source(torch.ones(2, 8)).sum().backward()
    adamw.step()
    module = torch.nn.Linear(8, 8)
    optim = cm.LowLevelZeroOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    before = [dict(g) for g in optim.param_groups]
    with pytest.raises(cm.InvalidArgumentError, match="exp_avg.*another optimizer class"):
        optim.load_state_dict(adamw.state_dict())
    assert [dict(g) for g in optim.param_groups] == before


def test_the_old_names_of_the_load_checks_warn_once_and_still_work():
    """``plan_load_state_dict`` / ``plan_load_model_state_dict`` were renamed ``prepare_*`` ("plan" is the
    will-it-fit sizing): the old names warn once per process and do what the new ones do."""
    import warnings

    from chunkmem import errors

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    optim = cm.LowLevelZeroOptimizer(torch.optim.Adam(module.parameters(), lr=0.1))
    module(torch.randn(2, 4)).sum().backward()
    optim.step()
    saved, weights = optim.state_dict(), {k: v.clone() for k, v in module.state_dict().items()}
    errors._RENAMED_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optim.plan_load_state_dict(saved)()
            optim.plan_load_model_state_dict(module, weights)()
    renamed = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert renamed == ["LowLevelZeroOptimizer.plan_load_state_dict is renamed prepare_load_state_dict; the old name "
                       "will be removed", "LowLevelZeroOptimizer.plan_load_model_state_dict is renamed "
                       "prepare_load_model_state_dict; the old name will be removed"]
    assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())


def _train_sgd_fp16(engine: str) -> list[torch.Tensor]:
    from chunkmem.core import copy_engine
    copy_engine.set_copy_engine(engine)
    try:
        model = make_model().half()
        optim = cm.LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                         initial_scale=SCALE)
    finally:
        copy_engine.set_copy_engine(None)
    for x, y in data():
        optim.backward(loss_fn(model(x.half()), y))
        optim.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_masters_reach_the_working_parameters_through_the_copy_engine():
    """The updated fp32 masters are copied into the fp16 working chunks by the chunk runtime's copy engine: with
    the deferred test engine (a copy's destination poisoned until it is waited on) the training is bitwise the
    plain engine's, so every copy is waited on before the parameters are read."""
    deferred, plain = _train_sgd_fp16("deferred"), _train_sgd_fp16("plain")
    assert all(torch.equal(a, b) for a, b in zip(deferred, plain))
    assert not any(p.isnan().any() for p in deferred)
