"""Reads of a model's and an optimizer's public state at random moments of training, under the deferred copy
engine, bit for bit as under the plain one.

The deferred engine (chunkmem/core/copy_engine.py) completes a copy between the tiers only when its handle is
waited on: until then the destination is NaN, and a freed source is poisoned. tests/test_copy_engine.py checks
that *training* waits for every copy it reads; this file checks the *readers* a user calls between the steps of
a loop: a parameter read (``p.detach().clone()`` under ``no_grad``), ``model.state_dict()``,
``optimizer.state_dict()``, ``p.grad``, the accessors (``safe_get_*``), ``torch.nn.utils.clip_grad_norm_`` (its
norm), ``optim.clip_grad_norm``, ``memory_stats()`` (which must change nothing) and a checkpoint saved and loaded
back. A seeded generator draws a sequence of operations (forward and backward, an accumulating second backward,
step, zero_grad, and reads anywhere between them); the sequence runs twice, each time in a fresh model built from
the same reference, once per engine. Every read, every loss, every step's result and every error raised must be
the same (``torch.equal``), no read may hold a NaN, and the final parameters and optimizer state must be equal.

Writes are drawn too: ``safe_set_full_fp32_param`` and ``safe_set_full_optimizer_state`` (through
``chunkmem.accessors`` and ``chunkmem.utils``), and ``model.load_state_dict`` of the last state dict read.

Configurations (:data:`CONFIGS`): ``cpu`` and ``auto`` placement (a device tier small enough that chunks move), fp32
and bf16, ``step_in_backward`` off and on, ``max_norm`` 0 and 0.05; the disk tier (``offload_optimizer="disk"``)
under ``cpu`` bf16 with ``step_in_backward`` and clipping, and under ``auto`` fp32; ``cuda`` (every chunk resident:
steady iterations) and ``static`` with ``offload_optim_frac=1.0``; fp16 with its loss scaler, with and without an
overflowing backward; parameters on disk (``offload_param="disk"``); ``atomic_step=False``. :data:`SEQUENCES`
sequences of :data:`LENGTH` operations each, seeded by the configuration and the sequence. Parameter values are not
read between a backward and ``step()`` where ``step_in_backward`` streams the disk chunks' updates
(:data:`PARAMETER_READS`), nor gradients and state dicts where those updates are written in place
(:data:`GRADIENT_READS`).
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

import chunkmem as cm
from chunkmem import accessors
from chunkmem.core import copy_engine
from tests.models import TinyGPT, batches, lm_loss

CHUNK_BYTES = 16384
AUTO_DEVICE_BYTES = 800 * 1024  # under "auto", chunks move between the device and the host tier
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

PARAMETER_READS = ("params", "accessors", "local_accessors")
"""Reads of the parameters' values. docs/guides/disk-tier.md: with ``step_in_backward``, between the backward and
``step()`` the parameters of the chunks whose state is on disk are being overwritten by the backward's update
(reading them shows values part-way through it), so the fuzz does not read them there."""

GRADIENT_READS = ("grads", "accessors", "local_accessors", "torch_clip", "optim_clip")
"""Reads of the gradients. After an overflowing backward (fp16) they hold inf and NaN under both engines, so
there they are compared NaN for NaN and not checked free of NaN. docs/guides/disk-tier.md: with
``atomic_step=False`` and ``step_in_backward`` the backward frees each disk chunk's gradient once its update is
computed, at the disk step's pace, so which gradients are still there between the backward and ``step()``
depends on timing: the fuzz does not read them there."""

TRAINING_OPS = ("backward", "backward", "accumulate", "step", "step", "zero_grad")
READ_OPS = ("params", "model_state_dict", "optim_state_dict", "grads", "accessors", "local_accessors",
            "torch_clip", "optim_clip", "memory_stats", "checkpoint", "set_param", "set_state", "load_earlier")
OVERFLOW_OP = "overflow"
"""A backward whose loss is multiplied by inf (fp16 configurations only): the loss scaler skips that step."""


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: both engines' runs compute alike either way, and on a shared machine with few cores
    torch's thread pool waiting for busy cores made this file six times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def _build(engine: str, config: dict, disk_dir=None):
    copy_engine.set_copy_engine(engine)
    placement = config["placement"]
    if placement == "auto":
        cm.set_device_memory_capacity(AUTO_DEVICE_BYTES)
    extra = {}
    if config.get("disk") or config.get("param_disk"):
        extra = {"nvme_path": str(disk_dir), "buffer_size": 8192, "atomic_step": config.get("atomic", True)}
        if config.get("disk"):
            extra["offload_optimizer"] = "disk"
        if config.get("param_disk"):
            extra["offload_param"] = "disk"
    if placement == "static":
        extra["offload_optim_frac"] = config.get("optim_frac", 1.0)
    try:
        model = cm.ShardedModelV2(copy.deepcopy(_reference()), cm.TensorShardStrategy(),
                                  tensor_placement_policy=placement, dtype=DTYPES[config["dtype"]],
                                  chunk_size=CHUNK_BYTES, **extra)
    finally:
        copy_engine.set_copy_engine(None)
        cm.set_device_memory_capacity(None)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10, max_norm=config["max_norm"],
                                  step_in_backward=config["step_in_backward"],
                                  gpu_margin_mem_ratio=0.5 if placement == "auto" else 0.0)
    assert model.runtime.memory.copies.name == engine
    return model, optim


def _sequence(seed: int, length: int, overflow: bool = False) -> list[str]:
    """``length`` operations drawn with ``seed``: about half of them reads (and writes), the rest training;
    with ``overflow``, one backward is an overflowing one."""
    rng = random.Random(seed)
    ops = [rng.choice(READ_OPS) if rng.random() < 0.5 else rng.choice(TRAINING_OPS) for _ in range(length)] + ["step"]
    if overflow:
        backwards = [i for i, op in enumerate(ops) if op == "backward"] or [0]
        ops[rng.choice(backwards)] = OVERFLOW_OP
    return ops


def _clone(value):
    """A detached copy of a read (tensors, nested dicts, lists, tuples)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _named_params(model):
    return [(name, p) for name, p in model.module.named_parameters()]


def _write(op: str, model, index: int):
    """``set_param``: give a third of the parameters (chosen by ``index``) a new fp32 value; ``set_state``: a new
    ``exp_avg`` or ``exp_avg_sq``; through ``chunkmem.accessors`` or its DeepSpeed names in ``chunkmem.utils``
    (alternately). The new value is the current one halved plus a little seeded noise; what the getter then
    reads is returned."""
    from chunkmem import utils
    api = accessors if index % 2 == 0 else utils
    gen = torch.Generator().manual_seed(index)
    key = ("exp_avg", "exp_avg_sq")[index // 2 % 2]
    out = {}
    for n, (name, p) in enumerate(_named_params(model)):
        if n % 3 != index % 3:
            continue
        if op == "set_param":
            value = api.safe_get_full_fp32_param(p)
            value = value * 0.5 + 0.01 * torch.randn(value.shape, generator=gen)
            api.safe_set_full_fp32_param(p, value)
            out[name] = (api.safe_get_full_fp32_param(p), p.detach().clone())
        else:
            value = api.safe_get_full_optimizer_state(p, key)
            value = torch.zeros(p.shape) if value is None else value * 0.5 + 1e-4 * torch.rand(value.shape, generator=gen)
            api.safe_set_full_optimizer_state(p, value, key)
            out[name] = api.safe_get_full_optimizer_state(p, key)
    return out


def _read(op: str, model, optim, ckpt_path, index: int, earlier: list):
    """Run the read (or write) ``op`` and return what it gave (copies). ``index``: the operation's place in
    the sequence; ``earlier``: the state dict ``load_earlier`` loads (the last ``model_state_dict`` read)."""
    params = _named_params(model)
    if op == "params":
        with torch.no_grad():
            return {name: p.detach().clone() for name, p in params}
    if op == "model_state_dict":
        earlier[0] = _clone(model.state_dict())
        return earlier[0]
    if op == "optim_state_dict":
        return _clone(optim.state_dict())
    if op == "grads":
        return {name: None if p.grad is None else p.grad.clone() for name, p in params}
    if op == "accessors":
        return {name: (accessors.safe_get_full_fp32_param(p), accessors.safe_get_full_grad(p),
                       accessors.safe_get_full_optimizer_state(p, "exp_avg"),
                       accessors.safe_get_full_optimizer_state(p, "exp_avg_sq")) for name, p in params}
    if op == "local_accessors":
        from chunkmem import utils  # DeepSpeed's names
        return {name: (utils.safe_get_local_fp32_param(p), utils.safe_get_local_grad(p),
                       utils.safe_get_local_optimizer_state(p, "exp_avg"),
                       utils.safe_get_local_optimizer_state(p, "exp_avg_sq")) for name, p in params}
    if op == "torch_clip":  # a large bound: the norm is read, the clipping (if any) applied by the step
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0).clone()
    if op == "optim_clip":
        return optim.clip_grad_norm(10.0)
    if op == "memory_stats":
        model.memory_stats()
        return None
    if op in ("set_param", "set_state"):
        return _write(op, model, index)
    if op == "load_earlier":
        model.load_state_dict(earlier[0])
        return None
    if op == "checkpoint":
        cm.save_checkpoint(ckpt_path, model, optim)
        saved = torch.load(ckpt_path, weights_only=False)
        cm.load_checkpoint(ckpt_path, model, optim)
        return _clone({k: saved[k] for k in ("model", "optimizer")})
    raise AssertionError(op)


def _run(engine: str, ops: list[str], config: dict, tmp_path, data_seed: int):
    """Run ``ops`` in a fresh model under ``engine``; every result (or error) of every operation, in order."""
    work = tmp_path / engine
    work.mkdir(parents=True, exist_ok=True)
    disk_dir = None
    if config.get("disk") or config.get("param_disk"):
        disk_dir = work / "nvme"
        disk_dir.mkdir(exist_ok=True)
    model, optim = _build(engine, config, disk_dir)
    data = batches(len(ops) + 2, seed=data_seed)
    earlier = [_clone(model.state_dict())]
    results = []
    streaming = False  # a disk step started by the backward may still be writing the parameters
    overflowed = False  # the gradients of an overflowing backward are pending
    for i, op in enumerate(ops):
        if streaming and (op in PARAMETER_READS or config.get("atomic") is False
                          and (op in GRADIENT_READS or op == "model_state_dict")):  # in place: masters too
            results.append((op, "not read: documented as part-way through the backward's disk update", False))
            continue
        try:
            if op in ("backward", "accumulate", OVERFLOW_OP):
                losses = []
                for m in range(2 if op == "accumulate" else 1):
                    x = data[i].roll(m, 1)
                    loss = lm_loss(model(x), x)
                    optim.backward(loss * float("inf") if op == OVERFLOW_OP else loss)
                    losses.append(loss.item())
                value = losses
            elif op == "step":
                value = optim.step()
            elif op == "zero_grad":
                value = optim.zero_grad()
            else:
                value = _read(op, model, optim, str(work / "ckpt.pt"), i, earlier)
        except Exception as exc:  # noqa: BLE001 - the same refusal must come from both engines
            value = ("raised", type(exc).__name__, str(exc))
        if (config.get("disk") or config.get("param_disk")) and config["step_in_backward"]:
            streaming = optim.backward_updates > 0 if op in ("backward", "accumulate", OVERFLOW_OP, "step", "zero_grad") \
                else streaming
        if op == OVERFLOW_OP and not (isinstance(value, tuple) and value[0] == "raised"):
            overflowed = True
        elif op in ("step", "zero_grad") and not (isinstance(value, tuple) and value[0] == "raised"):
            overflowed = False
        results.append((op, value, overflowed and op in GRADIENT_READS))
    final = (_clone(model.state_dict()), _clone(optim.state_dict()))
    return results, final


def _assert_equal(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.is_floating_point() and torch.isnan(a).any():  # an overflow's gradients: NaN where plain has NaN
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
        else:
            assert torch.equal(a, b), f"{where}: differs by {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_no_nan(value, where: str) -> None:
    if torch.is_tensor(value):
        assert not (value.is_floating_point() and torch.isnan(value).any()), f"NaN in {where}"
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_no_nan(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _assert_no_nan(v, f"{where}[{i}]")
    elif isinstance(value, float):
        assert not math.isnan(value), f"NaN in {where}"


CONFIGS = [
    dict(placement=placement, dtype=dtype, step_in_backward=sib, max_norm=max_norm)
    for placement in ("cpu", "auto") for dtype in ("fp32", "bf16") for sib in (False, True)
    for max_norm in (0.0, 0.05)
] + [dict(placement="cpu", dtype="bf16", step_in_backward=True, max_norm=0.05, disk=True),
     dict(placement="auto", dtype="fp32", step_in_backward=False, max_norm=0.0, disk=True),
     # every chunk resident: steady iterations skip the modules' hooks
     dict(placement="cuda", dtype="fp32", step_in_backward=False, max_norm=0.0),
     dict(placement="cuda", dtype="bf16", step_in_backward=True, max_norm=0.05),
     dict(placement="cuda", dtype="fp16", step_in_backward=False, max_norm=0.05, overflow=True),
     # parameters resting on the device, Adam on the host
     dict(placement="static", dtype="fp32", step_in_backward=True, max_norm=0.0),
     dict(placement="static", dtype="bf16", step_in_backward=False, max_norm=0.05),
     # fp16 and its loss scaler, with and without an overflow
     dict(placement="cpu", dtype="fp16", step_in_backward=True, max_norm=0.05),
     dict(placement="auto", dtype="fp16", step_in_backward=False, max_norm=0.0, overflow=True),
     dict(placement="cpu", dtype="fp16", step_in_backward=True, max_norm=0.0, overflow=True, disk=True),
     # parameters on disk
     dict(placement="cpu", dtype="bf16", step_in_backward=False, max_norm=0.0, disk=True, param_disk=True),
     dict(placement="cpu", dtype="fp32", step_in_backward=True, max_norm=0.05, disk=True, param_disk=True),
     # in-place disk steps
     dict(placement="cpu", dtype="bf16", step_in_backward=True, max_norm=0.0, disk=True, atomic=False),
     dict(placement="auto", dtype="fp32", step_in_backward=False, max_norm=0.05, disk=True, atomic=False,
          param_disk=True)]


def _config_id(config: dict) -> str:
    return "-".join([config["placement"], config["dtype"], "sib" if config["step_in_backward"] else "after",
                     f"clip{config['max_norm']}"] + [flag for flag in ("disk", "param_disk", "overflow")
                                                     if config.get(flag)]
                    + (["inplace"] if config.get("atomic") is False else []))


SEQUENCES = 4
LENGTH = 20


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_reads_at_random_moments_are_bitwise_the_plain_engine_s(config, tmp_path):
    for sequence in range(SEQUENCES):
        _compare_sequence(config, 1000 * CONFIGS.index(config) + sequence, tmp_path / f"s{sequence}")


def _compare_sequence(config: dict, seed: int, tmp_path) -> None:
    """Run the sequence drawn with ``seed`` under both engines and compare every result and the final state."""
    ops = _sequence(seed, LENGTH, config.get("overflow", False))
    plain, plain_final = _run("plain", ops, config, tmp_path, seed)
    deferred, deferred_final = _run("deferred", ops, config, tmp_path, seed)
    for i, ((op, a, overflowed), (_, b, _)) in enumerate(zip(plain, deferred)):
        if not overflowed:
            _assert_no_nan(b, f"seed {seed}, ops {ops}: deferred op {i} {op}")
        _assert_equal(a, b, f"seed {seed}, ops {ops}: op {i} {op}")
    _assert_equal(plain_final, deferred_final, f"seed {seed}, ops {ops}: final state")
    _assert_no_nan(deferred_final, f"seed {seed}: final state")


def test_a_missing_wait_fails_the_fuzz(monkeypatch, tmp_path):
    """The control: a gradient store that reads its gradients without waiting for their copies makes the
    comparison fail (NaN under the deferred engine), so the comparisons above can fail."""
    from chunkmem.runtime.gradients import StagedGradients
    monkeypatch.setattr(StagedGradients, "_landed", lambda self, chunk: self._landing.pop(chunk, None))
    with pytest.raises(AssertionError):
        _compare_sequence(CONFIGS[0], 0, tmp_path)
