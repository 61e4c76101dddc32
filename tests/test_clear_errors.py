"""Errors found by fault injection and bad input: each names the argument (or config key path, or file),
the value and what is allowed, and changes nothing (training goes on as if the call had not been made)."""
from __future__ import annotations

import copy
import errno
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.faces import config as config_module
from chunkmem.storage import atomic_file, disk_io
from chunkmem.storage.disk_io import ScratchSpace
from models import TinyGPT, batches, build_sharded, lm_loss, train
from stand_ins import RecordingLowLevelZero

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def weights(model: cm.ShardedModelV2) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: cm.ShardedModelV2, b: cm.ShardedModelV2) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


# ---- defect 6: ZeroInitContext's model_numel_tensor ------------------------------------------------------

def zero_init(**kwargs):
    return cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.bool, torch.complex64],
                         ids=str)
def test_model_numel_tensor_of_a_dtype_that_cannot_count_is_refused_at_construction(dtype):
    numel = torch.zeros(1, dtype=dtype)
    init_before = nn.Linear.__init__
    with pytest.raises(cm.InvalidArgumentError) as info:
        zero_init(model_numel_tensor=numel)
    error = info.value
    assert not isinstance(error, TypeError) and error.argument == "model_numel_tensor"
    assert str(dtype) in str(error) and "torch.int64" in error.allowed and "torch.float64" in error.allowed
    assert nn.Linear.__init__ is init_before and torch.equal(numel, torch.zeros(1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64], ids=str)
def test_model_numel_tensor_of_an_exact_dtype_receives_the_count(dtype):
    numel = torch.zeros(1, dtype=dtype)
    with zero_init(model_numel_tensor=numel):
        module = nn.Linear(300, 300)
    assert numel.item() == sum(p.numel() for p in module.parameters()) == 90300


def test_model_numel_tensor_too_small_for_the_count_is_refused_at_exit():
    numel = torch.full((1,), 7, dtype=torch.int8)
    init_before = nn.Linear.__init__
    with pytest.raises(cm.InvalidArgumentError) as info:
        with zero_init(model_numel_tensor=numel):
            nn.Linear(16, 16)
    error = info.value
    assert error.argument == "model_numel_tensor" and "272" in str(error) and "torch.int8" in str(error)
    assert numel.item() == 7  # not written with a wrapped-around value
    assert nn.Linear.__init__ is init_before  # the context still closed


# ---- defect 13: initialize's key paths and error types ---------------------------------------------------

def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def stage3(**extra):
    return {"zero_optimization": {"stage": 3, **extra}}


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_nvme_path_errors_name_the_offload_section_that_set_it(tmp_path, section):
    missing = str(tmp_path / "missing")
    config = stage3(**{section: {"device": "nvme", "nvme_path": missing}})
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(make_model(), config=config)
    assert info.value.argument == f"zero_optimization.{section}.nvme_path"
    assert str(info.value).startswith(f"zero_optimization.{section}.nvme_path={missing!r}")


def test_min_loss_scale_above_the_initial_scale_names_what_the_user_wrote():
    config = dict(stage3(), fp16={"enabled": True, "initial_scale_power": 10, "min_loss_scale": 2048})
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(make_model(), config=config)
    message = str(info.value)
    assert info.value.argument == "fp16.initial_scale_power" and info.value.value == 10
    assert message.startswith("fp16.initial_scale_power=10 ")
    assert "1024" in message and "fp16.min_loss_scale" in message and "2048" in message


@pytest.mark.parametrize("config, path", [
    (stage3(offload_optimizer={"device": "cpu", "buffer_count": "4"}), "zero_optimization.offload_optimizer.buffer_count"),
    (stage3(offload_param={"device": "cpu", "buffer_count": True}), "zero_optimization.offload_param.buffer_count"),
    (dict(stage3(), gradient_clipping="1.0"), "gradient_clipping"),
    (dict(stage3(), gradient_clipping=True), "gradient_clipping"),
    (dict(stage3(), optimizer={"type": 5}), "optimizer.type"),
    (stage3(reduce_bucket_size="5e8"), "zero_optimization.reduce_bucket_size"),
    (stage3(reduce_bucket_size=True), "zero_optimization.reduce_bucket_size"),
    (stage3(offload_optimizer={"device": "cpu", "ratio": "0.5"}), "zero_optimization.offload_optimizer.ratio"),
    (stage3(offload_optimizer={"device": 1}), "zero_optimization.offload_optimizer.device"),
    (stage3(offload_param={"device": "nvme", "nvme_path": 5}), "zero_optimization.offload_param.nvme_path"),
    (stage3(zero_quantized_weights="false"), "zero_optimization.zero_quantized_weights"),
    (stage3(mics_shard_size="-1"), "zero_optimization.mics_shard_size"),
    (stage3(zero_hpz_partition_size=True), "zero_optimization.zero_hpz_partition_size"),
    (dict(stage3(), fp16={"enabled": True, "initial_scale_power": "16"}), "fp16.initial_scale_power"),
    (dict(stage3(), fp16={"enabled": True, "loss_scale": "0"}), "fp16.loss_scale"),
    (dict(stage3(), fp16={"enabled": True, "loss_scale": False}), "fp16.loss_scale"),
    (dict(stage3(), fp16={"enabled": True, "min_loss_scale": "1"}), "fp16.min_loss_scale"),
    (dict(stage3(), fp16={"enabled": True, "loss_scale_window": 10.5}), "fp16.loss_scale_window"),
    (dict(stage3(), optimizer={"type": "Adam", "params": {"lr": "0.1"}}), "optimizer.params.lr"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 3, "overlap_comm": 1}}, "zero_optimization.overlap_comm"),
])
def test_a_value_of_the_wrong_type_raises_argument_type_error(config, path):
    model = make_model()
    with pytest.raises(cm.ArgumentTypeError) as info:
        cm.initialize(model, config=config)
    assert info.value.argument == path and str(info.value).startswith(path + "=")
    assert all(p.dtype == torch.float32 and not hasattr(p, "_chunkmem_slot") for p in model.parameters())


@pytest.mark.parametrize("config, path", [
    (stage3(offload_optimizer={"device": "cpu", "buffer_count": 0}), "zero_optimization.offload_optimizer.buffer_count"),
    (dict(stage3(), gradient_clipping=-1.0), "gradient_clipping"),
    (dict(stage3(), gradient_clipping=float("nan")), "gradient_clipping"),
    (dict(stage3(), optimizer={"type": "Lion"}), "optimizer.type"),
    (stage3(reduce_bucket_size=0), "zero_optimization.reduce_bucket_size"),
    (stage3(reduce_bucket_size=5.5), "zero_optimization.reduce_bucket_size"),
    (stage3(reduce_bucket_size=float("inf")), "zero_optimization.reduce_bucket_size"),
    (stage3(offload_optimizer={"device": "cpu", "ratio": 1.5}), "zero_optimization.offload_optimizer.ratio"),
    (stage3(offload_optimizer={"device": "disk"}), "zero_optimization.offload_optimizer.device"),
    (stage3(offload_param={"device": "nvme"}), "zero_optimization.offload_param.nvme_path"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    (stage3(mics_shard_size=8), "zero_optimization.mics_shard_size"),
    (dict(stage3(), fp16={"enabled": True, "initial_scale_power": 40}), "fp16.initial_scale_power"),
    (dict(stage3(), fp16={"enabled": True, "loss_scale": 128}), "fp16.loss_scale"),
    (dict(stage3(), fp16={"enabled": True, "min_loss_scale": -1}), "fp16.min_loss_scale"),
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage"),
])
def test_a_value_of_the_right_type_that_is_not_allowed_raises_invalid_argument_error(config, path):
    model = make_model()
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, config=config)
    assert not isinstance(info.value, cm.ArgumentTypeError), str(info.value)
    assert info.value.argument == path and str(info.value).startswith(path + "=")
    assert all(p.dtype == torch.float32 and not hasattr(p, "_chunkmem_slot") for p in model.parameters())


@pytest.mark.parametrize("value", [5e8, 5e8 + 0.0, 4096.0])
def test_reduce_bucket_size_written_as_an_integral_float_is_accepted(monkeypatch, value):
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), stage3(reduce_bucket_size=value))
    assert m.settings.reduction.reduce_scatter_bucket_size_mb == int(value) * 4 / 2**20  # fp32 elements
    monkeypatch.setattr(config_module, "LowLevelZeroOptimizer", RecordingLowLevelZero)
    model = make_model()
    _, recorder = cm.initialize(model, cm.HybridAdam(model.parameters()),
                                {"zero_optimization": {"stage": 2, "reduce_bucket_size": value}})
    bucket = recorder.kwargs["reduce_bucket_size"]
    assert type(bucket) is int and bucket == int(value)


def test_reduce_bucket_size_that_is_not_integral_says_so():
    with pytest.raises(cm.InvalidArgumentError, match=r"reduce_bucket_size=5\.5 .*integer.*5e8"):
        cm.initialize(make_model(), config=stage3(reduce_bucket_size=5.5))


@pytest.mark.parametrize("fp16", [False, True])
def test_stage3_optimizer_errors_name_optimizer_not_fp16_optimizer(fp16):
    model = make_model()
    config = dict(stage3(), fp16={"enabled": fp16})
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, torch.optim.LBFGS(model.parameters()), config)
    assert info.value.argument == "optimizer" and str(info.value).startswith("optimizer=")
    assert "fp16.optimizer" not in str(info.value)


# ---- defect 14: checkpoints on a full disk, and after the scratch directory went --------------------------

def _fsync_full(real_fsync):
    def fsync(fd):
        if os.path.isfile(f"/proc/self/fd/{fd}"):  # a file, not the directory fsynced after the rename
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)
    return fsync


def _write_to_dev_full(real_open):
    def open_(path, mode="r", *args, **kwargs):
        if mode == "xb":  # the temporary file of write_atomically: every write fails as on a full disk
            return real_open("/dev/full", "wb")
        return real_open(path, mode, *args, **kwargs)
    return open_


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("fault", ["fsync", "write"])
def test_a_checkpoint_on_a_full_disk_names_the_file_and_loses_nothing(tmp_path, monkeypatch, sharded, fault):
    if fault == "write" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    model, optim = build_sharded(reference(), "cpu", torch.float16)
    ref_model, ref_optim = build_sharded(reference(), "cpu", torch.float16)
    data = batches(4, seed=3)
    train(model, optim, data[:2])
    train(ref_model, ref_optim, data[:2])
    target = str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))
    with monkeypatch.context() as patch:
        if fault == "fsync":
            patch.setattr(os, "fsync", _fsync_full(os.fsync))
        else:
            patch.setattr(atomic_file, "open", _write_to_dev_full(open), raising=False)
        with pytest.raises(cm.CheckpointError) as info:
            cm.save_checkpoint(target, model, optim, sharded=sharded)
    error = info.value
    assert target in str(error) and "No space left on device" in str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    assert not os.path.exists(target) or os.listdir(target) == []  # nothing half-written left
    good = str(tmp_path / ("good" if sharded else "good.pt"))
    cm.save_checkpoint(good, model, optim, sharded=sharded)  # nothing lost: a later save works
    loaded_model, loaded_optim = build_sharded(reference(), "cpu", torch.float16)
    cm.load_checkpoint(good, loaded_model, loaded_optim)
    for m, o in ((model, optim), (ref_model, ref_optim), (loaded_model, loaded_optim)):
        train(m, o, data[2:])
    assert_same_weights(model, ref_model)
    assert_same_weights(loaded_model, ref_model)


def test_a_sharded_checkpoint_after_the_scratch_directory_was_removed_names_it(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    model = cm.ShardedModelV2(reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=16384, offload_optimizer="disk", offload_param="disk",
                              nvme_path=str(nvme), buffer_size=8192)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10)
    data = batches(3, seed=5)
    train(model, optim, data[:1])
    scratch = model.disk_path
    shutil.rmtree(scratch)
    target = str(tmp_path / "ckpt")
    with pytest.raises(cm.CheckpointError) as info:
        cm.save_checkpoint(target, model, optim, sharded=True)
    message = str(info.value)
    assert target in message and scratch in message and "model.disk_path" in message and "removed" in message
    assert "sharded=False" in message and isinstance(info.value.__cause__, FileNotFoundError)
    assert os.listdir(target) == []
    full = str(tmp_path / "full.pt")
    cm.save_checkpoint(full, model, optim)  # nothing lost: the full format reads the open files
    ref_model, ref_optim = build_sharded(reference(), "cpu", torch.float16)
    cm.load_checkpoint(full, ref_model, ref_optim)
    train(model, optim, data[1:])
    train(ref_model, ref_optim, data[1:])
    assert_same_weights(model, ref_model)


# ---- defect 15: a scratch directory that cannot be removed is reported ------------------------------------

def _failing_rmtree(real_rmtree):
    def rmtree(path, ignore_errors=False, onerror=None, **kwargs):
        if os.path.basename(str(path)).startswith("chunkmem-"):
            if ignore_errors:
                return
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        real_rmtree(path, ignore_errors=ignore_errors, onerror=onerror, **kwargs)
    return rmtree


def _bytes_in(path):
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def _left_behind_warning(caught, path):
    found = [w for w in caught if issubclass(w.category, RuntimeWarning) and path in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    return str(found[0].message)


@pytest.mark.parametrize("ending", ["close", "garbage collection"])
def test_a_scratch_directory_that_cannot_be_removed_is_reported_with_its_size(tmp_path, monkeypatch, ending):
    space = ScratchSpace(tmp_path)
    space.file("exp_avg", 3 * disk_io.ALIGNMENT)
    path = space.path
    expected = _bytes_in(path)  # the file and the owner marker
    monkeypatch.setattr(shutil, "rmtree", _failing_rmtree(shutil.rmtree))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ending == "close":
            space.close()
        else:
            del space
            gc.collect()
    monkeypatch.undo()
    message = _left_behind_warning(caught, path)
    assert f"{expected} bytes" in message and "Permission denied" in message
    assert os.path.isdir(path)
    shutil.rmtree(path)


def test_a_read_only_scratch_directory_is_reported(tmp_path):
    space = ScratchSpace(tmp_path)
    space.file("exp_avg", disk_io.ALIGNMENT)
    path = space.path
    os.chmod(path, 0o500)
    try:
        if os.access(path, os.W_OK):
            space.close()
            pytest.skip("this user (root) may write into a 0o500 directory: see the monkeypatched test")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            space.close()
        message = _left_behind_warning(caught, path)
        assert f"{_bytes_in(path)} bytes" in message and _bytes_in(path) > disk_io.ALIGNMENT
    finally:
        if os.path.isdir(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path)


def test_a_scratch_directory_left_at_exit_is_reported(tmp_path):
    script = textwrap.dedent(f"""
        import os, shutil, errno
        from chunkmem.storage.disk_io import ScratchSpace
        space = ScratchSpace({str(tmp_path)!r})
        space.file("exp_avg", 8192)
        print(space.path, flush=True)
        def rmtree(path, ignore_errors=False, **kwargs):
            if not ignore_errors:
                raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), path)
        shutil.rmtree = rmtree
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    try:
        assert os.path.isdir(path)
        assert "RuntimeWarning" in done.stderr and path in done.stderr and f"{_bytes_in(path)} bytes" in done.stderr
        assert _bytes_in(path) > 8192  # the file and the owner marker
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_scratch_directory_that_cannot_be_created_is_refused_naming_nvme_path(tmp_path, monkeypatch):
    def mkdir(path, mode=0o777, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(cm.InvalidArgumentError) as info:
        ScratchSpace(str(tmp_path))
    assert info.value.argument == "nvme_path" and info.value.value == str(tmp_path)
    assert "Permission denied" in str(info.value)
    assert os.listdir(tmp_path) == []


# ---- defect 17: errors that did not name the argument -----------------------------------------------------

def test_bad_arguments_name_the_argument_and_change_nothing(tmp_path):
    model, optim = build_sharded(reference(), "cpu", torch.float16)
    ref_model, ref_optim = build_sharded(reference(), "cpu", torch.float16)
    data = batches(3, seed=7)
    train(model, optim, data[:1])
    train(ref_model, ref_optim, data[:1])

    with pytest.raises(cm.ArgumentTypeError, match=r"^param='wte.weight' .*get_parameter") as info:
        model.full_parameter("wte.weight")
    assert info.value.argument == "param"
    assert torch.equal(model.full_parameter(model.module.get_parameter("wte.weight")),
                       ref_model.full_parameter(ref_model.module.get_parameter("wte.weight")))

    with pytest.raises(cm.ArgumentTypeError, match=r"^filename=None .*str or os.PathLike") as info:
        model.dump_memory_stats(None)
    assert info.value.argument == "filename"
    assert os.path.exists(model.dump_memory_stats(tmp_path / "stats.json"))  # a PathLike is fine

    x = data[1]
    loss = lm_loss(model(x), x)
    with pytest.raises(cm.ArgumentTypeError, match=r"^loss='loss' .*scalar torch.Tensor") as info:
        optim.backward("loss")
    assert info.value.argument == "loss"
    with pytest.raises(cm.ArgumentTypeError, match=r"^tensor='loss' ") as info:
        optim.backward_by_grad("loss", torch.tensor(optim.loss_scale))
    assert info.value.argument == "tensor"
    with pytest.raises(cm.ArgumentTypeError, match=r"^grad=1024.0 ") as info:
        optim.backward_by_grad(loss, optim.loss_scale)
    assert info.value.argument == "grad"
    optim.backward(loss)  # the forward's graph is still there: the step goes on as if nothing happened
    optim.step()
    optim.zero_grad()
    train(ref_model, ref_optim, data[1:2])
    train(model, optim, data[2:])
    train(ref_model, ref_optim, data[2:])
    assert_same_weights(model, ref_model)


def test_low_level_zero_and_sharded_optimizer_backward_refuse_alike():
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    plain = copy.deepcopy(reference())
    low = cm.LowLevelZeroOptimizer(cm.HybridAdam(plain.parameters()))
    errors = []
    for opt in (optim, low):
        with pytest.raises(cm.ArgumentTypeError) as info:
            opt.backward(2.0)
        errors.append(str(info.value))
    assert errors[0] == errors[1] == "loss=2.0 is not allowed: expected a scalar torch.Tensor"


def test_a_long_value_is_named_by_its_type_not_pages_of_repr():
    """clip_grad_norm(model, 1.0) (torch.nn.utils' order) used to print the whole model's repr."""
    model = cm.ShardedModelV2(reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    with pytest.raises(cm.ArgumentTypeError) as error:
        optim.clip_grad_norm(model, 1.0)
    message = str(error.value)
    assert message.startswith("max_norm=<ShardedModelV2: ShardedModelV2(...> is not allowed") and len(message) < 300
