"""The disk tier for optimizer state: bitwise equal to `cpu` placement, exact bytes, scratch files that
go away, failed steps undone, checkpoints, and bad arguments."""
import copy
import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import chunkmem as cm
from chunkmem.storage.disk_io import inject_faults
from tests.distributed import run_ranks
from tests.models import TinyGPT, batches, lm_loss

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK_BYTES = 16384
PIECE = 8192  # bytes: several pieces per chunk, so the pipeline really streams


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def _build(reference, dtype, policy="cpu", reuse=False, step_in_backward=False, **disk):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              reuse_fp16_shard=reuse, dtype=dtype, chunk_size=CHUNK_BYTES, **disk)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10, step_in_backward=step_in_backward)
    return model, optim


def _on_disk(path, **extra):
    return dict(offload_optimizer="disk", nvme_path=str(path), buffer_size=PIECE, **extra)


def _step(model, optim, x):
    optim.backward(lm_loss(model(x), x))
    return optim.step()


def _train(model, optim, data):
    for x in data:
        _step(model, optim, x)
        optim.zero_grad()


def _same_state(a, oa, b, ob):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    da, db = oa.state_dict(), ob.state_dict()
    assert da["state"].keys() == db["state"].keys()
    for index in da["state"]:
        for name, value in da["state"][index].items():
            assert torch.equal(value, db["state"][index][name]), (index, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reuse", [False, True])
def test_training_with_optimizer_state_on_disk_is_bitwise_cpu_placement(tmp_path, dtype, reuse):
    if reuse and dtype == torch.float32:
        pytest.skip("reuse_fp16_shard needs a 16-bit dtype")
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype, reuse=reuse)
    b, ob = _build(reference, dtype, reuse=reuse, **_on_disk(tmp_path))
    _train(a, oa, data)
    _train(b, ob, data)
    _same_state(a, oa, b, ob)
    assert b.runtime.ledger.read_from_disk > 0 and b.runtime.ledger.written_to_disk > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_exact_bytes_per_tier_and_files(tmp_path, dtype):
    model, optim = _build(_reference(), dtype, **_on_disk(tmp_path, buffer_count=3))
    trainable = [c for c in model.chunks if c.trainable]
    shard = trainable[0].shard_numel
    elements = sum(c.shard_numel for c in trainable)  # the last chunk is trimmed to its parameters
    assert trainable[-1].shard_numel < shard and elements == (len(trainable) - 1) * shard + trainable[-1].shard_numel
    families = ["exp_avg", "exp_avg_sq"] + (["master"] if dtype != torch.float32 else [])
    assert model.tier_bytes()["disk"] == {f: elements * 4 for f in families}
    assert optim.get_memory_usage(with_disk=True) == (
        0, 0 if dtype != torch.float32 else elements * 4, elements * 4 * len(families))
    assert optim.get_memory_usage() == optim.get_memory_usage(with_disk=True)[:2]
    region = -(-shard * 4 // 4096) * 4096  # a file region per chunk of the full size
    journal = len(model.chunks) * region if dtype == torch.float32 else 0  # old fp32 values while a step runs
    assert model.disk_file_bytes() == len(families) * len(model.chunks) * 2 * region + journal
    # the I/O buffers are host memory on the ledger: buffer_count x streamed families x buffer_size, and the
    # one buffer of whole-region writes (the state's initial values) and reads on the caller's thread
    _train(model, optim, batches(1))
    streamed = len(families) + (1 if dtype == torch.float32 else 0)
    assert model.tier_bytes()["host"]["disk_io"] == 3 * streamed * PIECE + PIECE
    assert sorted(os.listdir(model.disk_path)) == sorted([f + ".bin" for f in families + (
        ["journal"] if dtype == torch.float32 else [])] + [cm.storage.disk_io.OWNER_FILE])
    doc = model.memory_stats()
    assert doc["tiers"] == model.tier_bytes() and doc["disk"]["file_bytes"] == model.disk_file_bytes()
    assert doc["optimizer"]["disk_chunks"] == [c.index for c in trainable] and doc["optimizer"]["host_chunks"] == []
    assert doc["optimizer"]["disk_bytes"] == elements * 4 * len(families)
    assert doc["disk"]["read_bytes"] == model.runtime.ledger.read_from_disk > 0


def _fail_one_step(tmp_path, dtype, reuse, fault):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype, reuse=reuse)
    b, ob = _build(reference, dtype, reuse=reuse, **_on_disk(tmp_path))
    _train(a, oa, data[:2])
    _train(b, ob, data[:2])
    before = copy.deepcopy(b.state_dict()), copy.deepcopy(ob.state_dict())
    with inject_faults(**fault):
        with pytest.raises(cm.DiskStepError, match=r"optimizer step undone: (read|write) of chunk\d+\.\w+ in "
                                                   + str(tmp_path)) as info:
            _step(b, ob, data[2])
    assert info.value.undone and isinstance(info.value.cause, cm.DiskIOError)
    after = b.state_dict(), ob.state_dict()
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key
    for index, entry in before[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after[1]["state"][index][name]), (index, name)
    # the step can run again: kept gradients, or (reuse_fp16_shard) a new backward
    if reuse:
        assert _step(b, ob, data[2])
    else:
        assert ob.step()
    ob.zero_grad()
    _step(a, oa, data[2])
    oa.zero_grad()
    _same_state(a, oa, b, ob)


@pytest.mark.parametrize("dtype,reuse", [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
                                         (torch.float16, True)], ids=str)
def test_a_full_disk_during_a_step_undoes_it(tmp_path, dtype, reuse):
    # the writes of the second chunk fail: the first chunk was already updated in memory and on disk
    _fail_one_step(tmp_path, dtype, reuse, dict(write_errno=errno.ENOSPC, what="chunk1."))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_short_read_during_a_step_undoes_it(tmp_path, dtype):
    _fail_one_step(tmp_path, dtype, False, dict(short_read=True, what="chunk2."))


def test_without_atomic_steps_a_failure_asks_for_a_checkpoint(tmp_path):
    reference, data = _reference(), batches(2)
    (tmp_path / "disk").mkdir()
    model, optim = _build(reference, torch.float16, **_on_disk(tmp_path / "disk", atomic_step=False))
    _train(model, optim, data[:1])
    cm.save_checkpoint(tmp_path / "ckpt.pt", model, optim)
    with inject_faults(read_errno=errno.EIO, what="chunk1."):
        with pytest.raises(cm.DiskStepError, match="atomic_step=False") as info:
            _step(model, optim, data[1])
    assert not info.value.undone
    with pytest.raises(cm.DiskStepError):
        optim.step()
    cm.load_checkpoint(tmp_path / "ckpt.pt", model, optim)
    assert _step(model, optim, data[1])


def test_without_atomic_steps_a_crash_in_the_update_asks_for_a_checkpoint(tmp_path, monkeypatch):
    """The update of the second chunk raises (not an I/O error) after the first chunk was written in place: the
    step raises the crash, the next one refuses instead of training on half-updated chunks, and a checkpoint
    loaded trains as a model that never failed."""
    import chunkmem.optim.disk_step as disk_step
    reference, data = _reference(), batches(2)
    (tmp_path / "disk").mkdir()
    model, optim = _build(reference, torch.float16, **_on_disk(tmp_path / "disk", atomic_step=False))
    _train(model, optim, data[:1])
    cm.save_checkpoint(tmp_path / "ckpt.pt", model, optim)
    update, chunks = disk_step.StreamedStep._update, set()

    def crashing(self, piece):
        update(self, piece)
        chunks.add(piece.update.chunk.index)
        if len(chunks) == 2:  # the second chunk's first piece is updated: the first chunk's were written
            raise RuntimeError("a crash inside the update")
    monkeypatch.setattr(disk_step.StreamedStep, "_update", crashing)
    with pytest.raises(RuntimeError, match="a crash inside the update"):
        _step(model, optim, data[1])
    monkeypatch.setattr(disk_step.StreamedStep, "_update", update)
    with pytest.raises(cm.UnsupportedOperationError, match="RuntimeError.*atomic_step=False.*load a checkpoint"):
        optim.step()
    cm.load_checkpoint(tmp_path / "ckpt.pt", model, optim)
    optim.zero_grad()  # (the failed step's gradients, as torch keeps them across a load)
    assert _step(model, optim, data[1])
    optim.zero_grad()
    (tmp_path / "fresh").mkdir()
    fresh, fresh_optim = _build(reference, torch.float16, **_on_disk(tmp_path / "fresh", atomic_step=False))
    _train(fresh, fresh_optim, data)
    _same_state(model, optim, fresh, fresh_optim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_saved_from_disk_state_resumes_bitwise(nvme, dtype, sharded, monkeypatch):
    tmp_path = nvme
    reference, data = _reference(), batches(4)
    a, oa = _build(reference, dtype, **_on_disk(tmp_path / "a", offload_param="disk"))
    _train(a, oa, data[:2])
    if sharded:  # streamed: no disk-resident buffer is read whole into memory
        with monkeypatch.context() as patch:
            patch.setattr(cm.core.disk_tier.DiskTier, "load", lambda *_: pytest.fail("a whole buffer was read"))
            cm.save_checkpoint(tmp_path / "ckpt", a, oa, sharded=True)
    else:
        cm.save_checkpoint(tmp_path / "ckpt", a, oa)
    _train(a, oa, data[2:])
    for placement in (_on_disk(tmp_path / "b", offload_param="disk"), {}):  # into disk placement, and plain cpu
        b, ob = _build(reference, dtype, **placement)
        cm.load_checkpoint(tmp_path / "ckpt", b, ob)
        _train(b, ob, data[2:])
        _same_state(a, oa, b, ob)


@pytest.fixture
def nvme(tmp_path):
    for name in ("a", "b", "disk"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_scratch_files_go_with_the_model(nvme):
    model, optim = _build(_reference(), torch.float16, **_on_disk(nvme / "disk"))
    path = model.disk_path
    assert os.path.isdir(path) and os.path.dirname(path) == str(nvme / "disk")
    del model, optim
    import gc
    gc.collect()
    assert not os.path.exists(path) and os.listdir(nvme / "disk") == []


@pytest.mark.parametrize("ending", ["normal exit", "exception"])
def test_scratch_files_are_removed_when_the_process_ends(tmp_path, ending):
    script = textwrap.dedent(f"""
        import torch, chunkmem as cm
        from tests.models import TinyGPT, batches, lm_loss
        model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float16, offload_optimizer="disk", nvme_path={str(tmp_path)!r})
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
        x = batches(1)[0]
        optim.backward(lm_loss(model(x), x)); optim.step()
        print(model.disk_path, flush=True)
        if {ending == "exception"}:
            raise RuntimeError("the user's code failed")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert (done.returncode != 0) == (ending == "exception"), done.stderr
    assert done.stdout.strip().startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ending", ["normal exit", "exception"])
def test_a_process_that_ends_while_the_backward_s_disk_step_streams_exits_cleanly(tmp_path, ending):
    """A script that stops after a backward with ``step_in_backward`` and the optimizer state on disk (no
    ``step()``: the user's code ended, or raised). The backward's streamed step was still running on its thread,
    here held inside a torch operation (a matmul before the first piece's update) when the interpreter ended.
    Before (found by tests/test_deferred_reads_fuzz.py) the thread was a daemon nothing waited for, and the
    interpreter's finalization ended it by unwinding torch's native frames: the process aborted ("terminate
    called without an active exception", status -6), without the matmul about one run in three. Now the stream
    is closed and joined at exit: the process ends with its own status and its scratch files are removed."""
    script = textwrap.dedent(f"""
        import torch, chunkmem as cm
        from chunkmem.optim import disk_step
        from tests.models import TinyGPT, batches, lm_loss
        update, busy = disk_step.adam_update_, []
        def slow_update(*args, **kwargs):
            if not busy:  # the first piece: the thread is in native code when the main thread ends
                busy.append(print("streaming", flush=True))
                torch.ones(2000, 2000) @ torch.ones(2000, 2000)
            return update(*args, **kwargs)
        disk_step.adam_update_ = slow_update
        model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.bfloat16, chunk_size=16384, offload_optimizer="disk",
                                  nvme_path={str(tmp_path)!r}, buffer_size=8192)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=True)
        x = batches(1)[0]
        optim.backward(lm_loss(model(x), x))
        while not busy:
            pass
        if {ending == "exception"}:
            raise RuntimeError("the user's code failed")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == (1 if ending == "exception" else 0), done.stderr
    assert "terminate called" not in done.stderr and done.stdout == "streaming\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload_optimizer="nvme", nvme_path="."), r"^offload_optimizer='nvme' is not allowed: expected None or 'disk'"),
    (dict(offload_optimizer="disk"), r"^nvme_path=None is not allowed"),
    (dict(nvme_path="."), r"^nvme_path='.' is not allowed: expected None unless"),
    (dict(offload_optimizer="disk", nvme_path=".", buffer_size=1000), r"^buffer_size=1000 is not allowed"),
    (dict(offload_optimizer="disk", nvme_path=".", buffer_count=0), r"^buffer_count=0 is not allowed"),
    (dict(offload_optimizer="disk", nvme_path=".", atomic_step=1), r"^atomic_step=1 is not allowed"),
    (dict(offload_optimizer="disk", nvme_path=".", buffer_count="4"), r"^buffer_count='4' is not allowed"),
    (dict(offload_optimizer="disk", nvme_path=3), r"^nvme_path=3 is not allowed"),
    (dict(offload_param="disk", nvme_path=".", reuse_fp16_shard=True), r"^offload_param='disk' is not allowed"),
    (dict(offload_optimizer="disk", nvme_path=".", tensor_placement_policy="cuda"),
     r"^tensor_placement_policy='cuda' is not allowed"),
])
def test_bad_disk_arguments_are_refused_before_anything_changes(kwargs, match):
    module = _reference()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kwargs = {"tensor_placement_policy": "cpu", **kwargs}
    with pytest.raises(cm.InvalidArgumentError, match=match):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), dtype=torch.float16, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(type(p) is torch.nn.Parameter for p in module.parameters())


def test_missing_directory_and_full_disk_at_build_are_clear(tmp_path, monkeypatch):
    with pytest.raises(cm.InvalidArgumentError, match="nvme_path"):
        cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float16,
                          **_on_disk(tmp_path / "missing"))
    model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=CHUNK_BYTES, **_on_disk(tmp_path))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = model.tier_bytes()
    with pytest.raises(cm.DiskIOError, match=str(tmp_path)):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    assert model.tier_bytes() == before and not model.optimizer_attached


def test_host_capacity_refuses_clearly_before_anything_changes(tmp_path):
    module = _reference()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    capacity = CHUNK_BYTES + 4 * PIECE  # one chunk being built, and the disk tier's I/O buffers
    param_bytes = 3 * CHUNK_BYTES + 5248 * 2  # fp16: 3 chunks of 8192 elements, the last one trimmed to 5248
    cm.set_host_memory_capacity(capacity)
    try:
        with pytest.raises(cm.HostCapacityError, match=r"^host tier too small: the 4 parameter chunks resting on "
                                                       rf"the host need {param_bytes} bytes, the capacity "
                                                       rf"is {capacity} bytes"):
            cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=CHUNK_BYTES)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
        assert all(type(p) is torch.nn.Parameter for p in module.parameters())
        # with the parameters on disk the same capacity is enough: built one chunk at a time into the files
        (tmp_path / "d").mkdir()
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float16, chunk_size=CHUNK_BYTES, offload_param="disk",
                                  nvme_path=str(tmp_path / "d"), buffer_size=PIECE)
        assert model.tier_bytes()["disk"] == {"param": param_bytes} and "param" not in model.tier_bytes()["host"]
        assert torch.equal(model.state_dict()["wte.weight"], before["wte.weight"].half().float())
    finally:
        cm.set_host_memory_capacity(None)


def _two_rank_worker(rank, world, path, dtype, fail_rank, offload_param=None, step_in_backward=False):
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(3, seed=rank)
    disk = os.path.join(path, f"rank{rank}")
    os.makedirs(disk, exist_ok=True)
    a, oa = _build(reference, dtype)
    b, ob = _build(reference, dtype, step_in_backward=step_in_backward, **_on_disk(disk, offload_param=offload_param))
    tier, reads = b.runtime.memory.disk, {"on the fetch thread": 0, "in line": 0}
    for name, key in (("start_read_all", "on the fetch thread"), ("read_all", "in line")):
        def counted(*args, _read=getattr(tier, name), _key=key):
            reads[_key] += 1
            return _read(*args)
        setattr(tier, name, counted)
    _train(a, oa, data[:2])
    _train(b, ob, data[:2])
    out = {"failed": None}
    if fail_rank is not None:
        before = copy.deepcopy(b.state_dict())
        faults = dict(write_errno=errno.EIO, what="chunk1.") if rank == fail_rank else dict(what="nothing")
        with inject_faults(**faults):
            try:
                _step(b, ob, data[2])
            except cm.DiskStepError as exc:
                out["failed"] = (exc.undone, exc.cause is not None)
        out["unchanged"] = all(torch.equal(v, b.state_dict()[k]) for k, v in before.items())
        ob.step()
        ob.zero_grad()
    else:
        _train(b, ob, data[2:])
    _train(a, oa, data[2:])
    out["prefetched"] = b.runtime.executor.prefetched  # (the third iteration follows the plan: it prefetches)
    out["parameter reads"] = dict(reads)  # while training (the state dicts below read every chunk in line)
    sa, sb = a.state_dict(), b.state_dict()
    out["same"] = all(torch.equal(sa[k], sb[k]) for k in sa)
    da, db = oa.state_dict(), ob.state_dict()
    out["same_optim"] = all(torch.equal(v, db["state"][i][n]) for i, e in da["state"].items() for n, v in e.items())
    return out


def _every_case_worker(rank, world, path):
    results = {(str(dtype), offload_param): _two_rank_worker(rank, world, os.path.join(path, f"{dtype}-{offload_param}"),
                                                             dtype, None, offload_param)
               for dtype in DTYPES for offload_param in (None, "disk")}
    results["bf16 step_in_backward"] = _two_rank_worker(rank, world, os.path.join(path, "in-backward"), torch.bfloat16,
                                                        None, step_in_backward=True)
    return results


def test_two_ranks_on_disk_match_cpu_placement(tmp_path):
    # fp32/fp16/bf16, parameters on disk or not; bf16 with the step in the backward
    for results in run_ranks(_every_case_worker, 2, str(tmp_path)):
        assert len(results) == 7
        for case, out in results.items():
            assert out["same"] and out["same_optim"], case
            if case[1] == "disk":  # a rank's shard is read on the fetch thread, ahead of its use when prefetched
                assert out["parameter reads"]["on the fetch thread"] > 0 and out["prefetched"] > 0, case
                assert out["parameter reads"]["in line"] == 0, case


def test_a_failure_on_one_rank_undoes_the_step_on_both(tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tmp_path), torch.float16, 1)
    assert results[0]["failed"] == (True, False) and results[1]["failed"] == (True, True)
    for out in results:
        assert out["unchanged"] and out["same"] and out["same_optim"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_auto_keeps_what_fits_the_host_capacity_on_the_host_and_matches_cpu(tmp_path, dtype):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype)
    probe, _ = _build(reference, dtype, policy="auto", **_on_disk(tmp_path))
    trainable = [c for c in probe.chunks if c.trainable]
    state_bytes = (3 if dtype != torch.float32 else 2) * trainable[0].shard_numel * 4
    grads = len(trainable) * trainable[0].param.shard.nbytes
    io_bytes = 4 * 3 * PIECE
    host_now = probe.tier_bytes()["host"]["param"]
    del probe
    cm.set_host_memory_capacity(host_now + grads + io_bytes + 2 * state_bytes + state_bytes // 2)
    try:
        b, ob = _build(reference, dtype, policy="auto", **_on_disk(tmp_path))
    finally:
        cm.set_host_memory_capacity(None)
    tiers = [ob.runtime.optim_tier(c) for c in b.chunks if c.trainable]
    assert tiers == [cm.Tier.HOST] * 2 + [cm.Tier.DISK] * (len(trainable) - 2)  # the last finished in backward
    # files only for the chunks whose state rests on disk: families x 2 slots (+ the fp32 journal) each
    region = -(-trainable[0].shard_numel * 4 // 4096) * 4096
    families, journal = (3, 0) if dtype != torch.float32 else (2, 1)
    assert b.disk_file_bytes() == (families * 2 + journal) * (len(trainable) - 2) * region
    if dtype != torch.float32:  # (fp32 counts its parameters, the masters, on the host too)
        on_disk = sum(3 * c.shard_numel * 4 for c in trainable[2:])  # the last chunk is trimmed
        assert ob.get_memory_usage(with_disk=True)[1:] == (2 * state_bytes, on_disk)
    _train(a, oa, data)
    _train(b, ob, data)
    _same_state(a, oa, b, ob)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("optimizer", ["disk", None])
def test_parameters_on_disk_train_bitwise_like_cpu_placement(tmp_path, dtype, optimizer):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype)
    b, ob = _build(reference, dtype, offload_param="disk", offload_optimizer=optimizer, nvme_path=str(tmp_path),
                   buffer_size=PIECE)
    shard_bytes = sum(c.param.shard.nbytes for c in b.chunks)
    assert b.tier_bytes()["disk"]["param"] == shard_bytes and "param" not in b.tier_bytes()["host"]
    _train(a, oa, data)
    _train(b, ob, data)
    assert "param" not in b.tier_bytes()["host"] and b.tier_bytes()["disk"]["param"] == shard_bytes
    _same_state(a, oa, b, ob)


def test_parameters_on_disk_are_safe_to_read_and_write_outside_forward(tmp_path):
    reference = _reference()
    model, optim = _build(reference, torch.float32, offload_param="disk", nvme_path=str(tmp_path))
    weight = model.module.head.weight if hasattr(model.module, "head") else next(model.parameters())
    name = next(n for n, p in model.module.named_parameters() if p is weight)
    expected = dict(reference.named_parameters())[name].detach()
    assert torch.equal(weight.detach().clone(), expected) and str(weight).startswith("Parameter containing:\ntensor(")
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(model.state_dict()[name], expected * 2)
    _train(model, optim, batches(1))  # the doubled weight is what trains


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_parameters_on_disk_are_prefetched_from_the_schedule(tmp_path, policy):
    reference, data = _reference(), batches(4)
    a, oa = _build(reference, torch.float16)
    b, ob = _build(reference, torch.float16, policy=policy, offload_param="disk", **_on_disk(tmp_path))
    _train(a, oa, data[:3])
    _train(b, ob, data[:3])
    b.runtime.executor.events = []
    _train(a, oa, data[3:])
    _train(b, ob, data[3:])
    fetches = [e for e in b.runtime.executor.events if e[0] == "fetch"]
    assert any(kind == "prefetch" for _, _, kind in fetches), fetches  # read on the fetch thread ahead of use
    _same_state(a, oa, b, ob)


def test_a_failed_parameter_read_in_forward_is_clear_and_training_goes_on(tmp_path):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, torch.float32)
    b, ob = _build(reference, torch.float32, offload_param="disk", **_on_disk(tmp_path))
    _train(a, oa, data[:2])
    _train(b, ob, data[:2])
    with inject_faults(read_errno=errno.EIO, what="chunk1.param"):
        with pytest.raises(cm.DiskIOError, match=r"chunk1\.param") as info:
            b(data[2])
    assert str(tmp_path) in str(info.value)
    _train(a, oa, data[2:])
    _train(b, ob, data[2:])
    _same_state(a, oa, b, ob)


@pytest.mark.parametrize("buffer_count", [1, 2, 7])
def test_any_buffer_count_gives_the_same_training(tmp_path, buffer_count):
    reference, data = _reference(), batches(2)
    a, oa = _build(reference, torch.float32)
    b, ob = _build(reference, torch.float32, offload_param="disk", **_on_disk(tmp_path, buffer_count=buffer_count))
    _train(a, oa, data)
    _train(b, ob, data)
    _same_state(a, oa, b, ob)


# ---- step_in_backward: the disk chunks are updated while the backward goes on ---------------------------


def _watch_updates_during_backward(model, optim):
    """Record, each time a chunk's gradients become final, how many chunks the backward's step holds; at
    the last one (still inside the backward) wait until the step thread has read from disk since the first
    was handed over (it may have read them all by then: in place, the backward waits for it)."""
    seen, original = [], optim.on_grads_final
    ledger = model.runtime.ledger
    before = []

    def watching(chunk):
        if not before:
            before.append(ledger.read_from_disk)
        original(chunk)
        seen.append(optim.backward_updates)
        if chunk is model.chunks[0]:  # the last chunk the backward finishes (embeddings, first layer)
            start = before[0]
            for _ in range(500):
                if ledger.read_from_disk > start or optim.backward_updates == 0:
                    break
                time.sleep(0.01)
            seen.append(("read during backward", ledger.read_from_disk > start))
    optim.on_grads_final = watching  # the runtime calls its optimizer's listener method
    return seen


@pytest.mark.parametrize("dtype,reuse,atomic,policy", [
    (torch.float32, False, True, "cpu"), (torch.float32, False, False, "cpu"), (torch.bfloat16, False, True, "cpu"),
    (torch.bfloat16, True, False, "cpu"), (torch.bfloat16, True, True, "auto")], ids=str)
def test_step_in_backward_trains_bitwise_like_cpu_placement(tmp_path, dtype, reuse, atomic, policy):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype, reuse=reuse)
    b, ob = _build(reference, dtype, policy=policy, reuse=reuse, step_in_backward=True,
                   **_on_disk(tmp_path, atomic_step=atomic))
    disk_chunks = [c for c in b.chunks if c.trainable and ob.runtime.optim_tier(c) is cm.Tier.DISK]
    assert len(disk_chunks) >= 3
    _train(a, oa, data)
    hand_over = ob.on_grads_final
    for x in data:
        ob.on_grads_final = hand_over
        seen = _watch_updates_during_backward(b, ob)
        ob.backward(lm_loss(b(x), x))
        # every disk chunk went to the step as the backward finished it; the step thread read from disk
        # before the backward ended
        assert [n for n in seen if isinstance(n, int)][-1] == len(disk_chunks)
        assert ("read during backward", True) in seen
        assert ob.step()
        ob.zero_grad()
    _same_state(a, oa, b, ob)


def test_step_in_backward_failure_undoes_the_step_and_it_runs_again(tmp_path):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, torch.bfloat16)
    b, ob = _build(reference, torch.bfloat16, step_in_backward=True, **_on_disk(tmp_path))
    _train(a, oa, data[:2])
    _train(b, ob, data[:2])
    before = copy.deepcopy(b.state_dict()), copy.deepcopy(ob.state_dict())
    with inject_faults(write_errno=errno.ENOSPC, what="chunk2."):
        ob.backward(lm_loss(b(data[2]), data[2]))
        with pytest.raises(cm.DiskStepError, match="optimizer step undone: write of chunk2"):
            ob.step()
    after = b.state_dict(), ob.state_dict()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(v, after[1]["state"][i][n]) for i, e in before[1]["state"].items() for n, v in e.items())
    assert ob.step()  # the kept gradients, stepped after the backward this time
    ob.zero_grad()
    _train(a, oa, data[2:])
    _same_state(a, oa, b, ob)


def test_step_in_backward_zero_grad_before_step(tmp_path):
    reference, data = _reference(), batches(3)
    a, oa = _build(reference, torch.bfloat16)
    b, ob = _build(reference, torch.bfloat16, step_in_backward=True, **_on_disk(tmp_path))
    c, oc = _build(reference, torch.bfloat16, step_in_backward=True, **_on_disk(tmp_path, atomic_step=False))
    for model, optim in ((a, oa), (b, ob), (c, oc)):
        _train(model, optim, data[:1])
    before = copy.deepcopy(b.state_dict()), copy.deepcopy(ob.state_dict())
    # atomic: zero_grad() undoes what the backward's step did, as a skipped step
    ob.backward(lm_loss(b(data[1]), data[1]))
    ob.zero_grad()
    after = b.state_dict(), ob.state_dict()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(v, after[1]["state"][i][n]) for i, e in before[1]["state"].items() for n, v in e.items())
    # in place: refused, nothing changed; step() completes the step
    oc.backward(lm_loss(c(data[1]), data[1]))
    with pytest.raises(cm.UnsupportedOperationError, match="atomic_step=False.*optim.step"):
        oc.zero_grad()
    assert oc.step()
    oc.zero_grad()
    _train(a, oa, data[1:2])  # c stepped on data[1]; b skipped it
    _same_state(a, oa, c, oc)
    _train(b, ob, data[1:2])
    _same_state(a, oa, b, ob)


def test_step_in_backward_refuses_what_it_cannot_do(tmp_path):
    reference, data = _reference(), batches(2)
    model, optim = _build(reference, torch.bfloat16, step_in_backward=True, **_on_disk(tmp_path))
    x = data[0]
    optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.GradientAccumulationError, match="call optim.step.. first"):
        optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.UnsupportedOperationError, match="state_dict.. between a backward and optim.step"):
        optim.state_dict()
    with pytest.raises(cm.UnsupportedOperationError, match="a checkpoint between"):
        cm.save_checkpoint(tmp_path / "ckpt.pt", model, optim)
    assert optim.step()  # none of the refusals changed anything
    optim.zero_grad()
    twin, twin_optim = _build(reference, torch.bfloat16)
    _train(twin, twin_optim, data[:1])
    _same_state(twin, twin_optim, model, optim)


@pytest.mark.parametrize("model_kwargs,dtype,match", [
    ({}, torch.bfloat16, "step_in_backward.*reuse_fp16_shard=True and the optimizer state in memory"),
    ("disk", torch.float16, "step_in_backward.*fp16.*atomic_step=False")], ids=["reuse in memory", "fp16 in place"])
def test_step_in_backward_bad_combinations_are_refused_before_anything_changes(tmp_path, model_kwargs, dtype, match):
    # (fp16, clipping, parameters on disk and state in memory are stepped by speculation:
    # tests/test_speculative_step.py)
    disk = {} if model_kwargs == {} else _on_disk(tmp_path, atomic_step=False)
    model = cm.ShardedModelV2(_reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=CHUNK_BYTES, reuse_fp16_shard=not disk, **disk)
    with pytest.raises(cm.InvalidArgumentError, match=match):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=True)
    with pytest.raises(cm.ArgumentTypeError, match="step_in_backward"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), step_in_backward=1)
    assert not model.optimizer_attached


def _peak_host_grad_bytes(model) -> list[int]:
    """Track the most bytes of the ``grad`` family on the host tier (the ledger's reservations)."""
    ledger, peak = model.runtime.ledger, [0]
    reserve = ledger.reserve

    def counting(tier, family, nbytes, what):
        reserve(tier, family, nbytes, what)
        peak[0] = max(peak[0], ledger.tier_bytes(cm.Tier.HOST, ("grad",)))

    ledger.reserve = counting
    return peak


@pytest.mark.parametrize("offload_param", [None, "disk"], ids=["state-on-disk", "params-on-disk-too"])
def test_step_in_backward_in_place_frees_each_gradient_once_its_update_is_computed(tmp_path, offload_param):
    """atomic_step=False, bf16, no clipping: nothing reads a disk chunk's gradient after its update, so the
    backward frees it and waits for the disk step rather than hold every chunk's gradient: the host holds a
    few chunks' gradients at once, and the results stay bitwise those of the step after the backward."""
    from chunkmem.optim.backward_step import GRADIENTS_AHEAD_OF_THE_DISK_STEP

    reference, data = _reference(), batches(3)
    runs = {}
    for in_backward in (False, True):
        (tmp_path / str(in_backward)).mkdir()
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.bfloat16, chunk_size=8192,  # the largest parameter: many chunks
                                  **_on_disk(tmp_path / str(in_backward), atomic_step=False,
                                             offload_param=offload_param))
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                      step_in_backward=in_backward)
        peak = _peak_host_grad_bytes(model)
        _train(model, optim, data)
        runs[in_backward] = model, optim, peak[0]
    (a, oa, all_grads), (b, ob, bounded) = runs[False], runs[True]
    _same_state(a, oa, b, ob)
    chunks = [c for c in b.chunks if c.trainable]
    grad_bytes = max(c.grad.nbytes for c in chunks)
    assert len(chunks) > GRADIENTS_AHEAD_OF_THE_DISK_STEP + 2
    assert all_grads == sum(c.grad.nbytes for c in chunks)  # the step after the backward: every gradient at once
    assert bounded <= (GRADIENTS_AHEAD_OF_THE_DISK_STEP + 2) * grad_bytes < all_grads
    assert b.tier_bytes()["host"].get("grad", 0) == 0


def test_a_gradient_freed_by_its_update_in_the_backward_is_none_in_p_grad(tmp_path, monkeypatch):
    """atomic_step=False, step_in_backward: the backward frees a disk chunk's gradient once its update is
    computed, and ``safe_get_full_grad`` of its parameters is ``None`` from then on; ``p.grad`` is ``None`` too.
    Before 2026-11-28 it was a stand-in that read zeros (``p.grad.clone()``, norms): a gradient that was never
    there. After the step, the next backward's gradients show again."""
    import chunkmem.optim.backward_step as backward_step
    monkeypatch.setattr(backward_step, "GRADIENTS_AHEAD_OF_THE_DISK_STEP", 0)  # free each as soon as computed
    model = cm.ShardedModelV2(copy.deepcopy(_reference()), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16, chunk_size=CHUNK_BYTES, **_on_disk(tmp_path, atomic_step=False))
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), step_in_backward=True)
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    params = list(model.module.parameters())
    freed = [p for p in params if cm.utils.safe_get_full_grad(p) is None]
    assert freed and all(p.grad is None for p in freed)
    assert all(p.grad is not None for p in params if all(p is not q for q in freed))
    assert optim.step()
    optim.zero_grad()
    with optim.accumulating():  # no update starts: every gradient is kept
        optim.backward(lm_loss(model(x), x))
    assert all(p.grad is not None and cm.utils.safe_get_full_grad(p) is not None for p in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_keeps_the_parameters_that_fit_the_host_capacity_on_the_host(tmp_path, dtype):
    """auto, parameters and optimizer state on disk, a host capacity with room for three chunks' parameters
    besides the gradients and the I/O buffers: those three rest on the host, the rest on disk (the files hold
    regions only for those), and training is bitwise that of cpu placement."""
    from chunkmem.core.disk_tier import DEFAULT_BUFFER_COUNT

    reference, data = _reference(), batches(3)
    a, oa = _build(reference, dtype)
    chunks = [c for c in a.chunks]
    shard = chunks[0].param.shard.nbytes
    grads = sum(c.param.shard.nbytes for c in chunks if c.trainable)
    streamed = 3 if dtype == torch.float32 else 4
    io_bytes = (DEFAULT_BUFFER_COUNT * streamed + 2) * PIECE
    cm.set_host_memory_capacity(grads + io_bytes + 3 * shard + shard // 2)
    try:
        b, ob = _build(reference, dtype, policy="auto", **_on_disk(tmp_path, offload_param="disk"))
    finally:
        cm.set_host_memory_capacity(None)
    assert [c.param.shard.on_disk for c in b.chunks] == [False] * 3 + [True] * (len(chunks) - 3)
    region = -(-shard // 4096) * 4096
    param_files = 2 * region * (len(chunks) - 3)  # two slots (atomic steps) for each chunk resting on disk
    assert b.runtime.memory.disk.file("param").nbytes == param_files
    _train(a, oa, data)
    _train(b, ob, data)
    _same_state(a, oa, b, ob)
    assert [c.param.shard.on_disk for c in b.chunks] == [False] * 3 + [True] * (len(chunks) - 3)
    assert b.tier_bytes()["host"]["param"] == 3 * shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_step_in_backward_updates_parameters_resting_on_disk_from_the_values_the_backward_read(tmp_path, dtype):
    """Parameters on disk that are their own masters (fp32), updated in place in the backward: the update takes
    their values from the copy the backward computed with instead of reading them from disk again, so each step
    reads exactly their bytes less, and trains bitwise as the step after the backward, also under the copy engine
    that completes copies only when waited on. bf16 parameters with fp32 masters read the masters, not the
    parameters: the same bytes either way."""
    from chunkmem.core import copy_engine

    reference, data = _reference(), batches(3)
    runs = {}
    for in_backward in (False, True):
        (tmp_path / str(in_backward)).mkdir()
        copy_engine.set_copy_engine("deferred" if in_backward else "plain")
        try:
            model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                                      tensor_placement_policy="cpu", dtype=dtype,
                                      chunk_size=4096 * dtype.itemsize,  # the largest parameter
                                      **_on_disk(tmp_path / str(in_backward), atomic_step=False,
                                                 offload_param="disk"))
        finally:
            copy_engine.set_copy_engine(None)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                      step_in_backward=in_backward)
        _train(model, optim, data)
        runs[in_backward] = model, optim, model.runtime.ledger.read_from_disk
    (a, oa, reads_after), (b, ob, reads_in_backward) = runs[False], runs[True]
    _same_state(a, oa, b, ob)
    param_bytes = sum(c.param.shard.nbytes for c in b.chunks if c.trainable)
    saved = len(data) * param_bytes if dtype == torch.float32 else 0
    assert reads_after - reads_in_backward == saved
    assert b.tier_bytes()["host"].get("resting", 0) == 0  # every copy given back
