"""chunkmem.deepspeed, DeepSpeed's face, against independent references:

* the engine's gradient accumulation, clipping and schedule equal plain PyTorch (AdamW, the loss divided
  by the accumulation steps, ``clip_grad_norm_``, the schedule's learning rates set by hand);
* the same DeepSpeed script (``deepspeed_script.py``) gives DeepSpeed 0.19.8's learning rates, losses,
  weights, resume and client state at stages 1, 2 and 3 with the optimizer on the CPU (the config's Adam,
  and torch's SGD): against DeepSpeed's
  recorded output always, and against a live DeepSpeed when ``CHUNKMEM_DEEPSPEED_PYTHON`` names an
  interpreter that has it (``../shared/tools/setup_peers.sh`` builds one);
* the four schedules equal DeepSpeed's, step by step;
* checkpoints resume bitwise; ``save_16bit_model`` loads into the plain module; the accessors read ZeRO-1/2
  parameters; bad input raises naming the argument.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.core.param_guard import slot_of
import chunkmem.deepspeed as deepspeed
from chunkmem.deepspeed.lr_schedules import WarmupLR
from models import TinyGPT, batches, lm_loss

HERE = os.path.dirname(__file__)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """deepspeed.initialize forms a process group of one, as DeepSpeed does; later tests start without it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
REFERENCE = os.path.join(HERE, "data", "deepspeed_reference.json")
LR, WD = 1e-2, 0.01


def _config(stage: int, **extra) -> dict:
    offload = {"device": "cpu"}
    zero = {"stage": stage, "offload_optimizer": offload}
    if stage == 3:
        zero["offload_param"] = offload
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": zero,
            **extra}


def _engine(reference: nn.Module, config: dict, **kwargs):
    module = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    engine, optim, _, schedule = deepspeed.initialize(model=module, optimizer=optimizer, config=config, **kwargs)
    return engine, optim, schedule


def _weights(engine) -> list[torch.Tensor]:
    return [deepspeed.utils.safe_get_full_fp32_param(p) for p in engine.module.parameters()]


# ---- the engine against plain PyTorch -------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_clipping_and_schedule_equal_plain_adamw(stage):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(8, seed=3)
    clip, schedule = 0.05, {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 3,
                                                            "warmup_type": "linear"}}
    engine, _, _ = _engine(reference, _config(stage, gradient_clipping=clip, scheduler=schedule))
    for x in data:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    assert engine.global_steps == 4 and engine.micro_steps == 8 and engine.skipped_steps == 0

    plain = copy.deepcopy(reference)
    optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    for step in range(4):
        # WarmupLR, linear over 3 steps, stepped after each optimizer step: step k runs at t = k - 1 (-1: min)
        optim.param_groups[0]["lr"] = LR * max(0, step - 1) / 3
        for x in data[2 * step:2 * step + 2]:
            (lm_loss(plain(x), x) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        optim.step()
        optim.zero_grad()
    assert engine.get_lr() == [LR]
    assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-5)  # before clipping, as DeepSpeed
    assert engine.was_step_applied() and not engine.fp16_enabled() and not engine.bfloat16_enabled()
    for got, want in zip(_weights(engine), plain.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_config_without_gradient_clipping_clips_at_one_as_deepspeed():
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(2, seed=5)
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    engine, optim, _ = _engine(reference, config)
    assert optim.max_norm == 1.0
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    for x in data:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
        lm_loss(plain(x), x).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        assert norm > 1.0  # the clipping changes this step
        plain_optim.step()
        plain_optim.zero_grad()
    for got, want in zip(_weights(engine), plain.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resumes_bitwise_with_client_state_and_latest(tmp_path, stage):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(8, seed=4)
    schedule = {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_max_lr": LR, "warmup_num_steps": 2}}
    config = _config(stage, scheduler=schedule)
    engine, _, _ = _engine(reference, config)

    def train(e, part):
        for x in part:
            e.backward(lm_loss(e(x), x))
            e.step()
    train(engine, data[:4])
    assert engine.save_checkpoint(tmp_path, client_state={"epoch": 3})
    assert (tmp_path / "latest").read_text() == "global_step2"
    train(engine, data[4:])
    resumed, _, resumed_schedule = _engine(reference, config)
    path, client = resumed.load_checkpoint(tmp_path)
    assert path == os.path.join(tmp_path, "global_step2") and client == {"epoch": 3}
    assert (resumed.global_steps, resumed.micro_steps, resumed_schedule.last_batch_iteration) == (2, 4, 1)
    train(resumed, data[4:])
    assert resumed.get_lr() == engine.get_lr()
    for got, want in zip(_weights(resumed), _weights(engine)):
        assert torch.equal(got, want)


def _saved_then_trained_on(directory, config):
    """An engine trained 2 steps, saved under tag "fixed" (client_state {"epoch": 1}), then trained 2 more:
    ``(reference, engine, the saved weights, the saved global_steps)``."""
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=4)
    engine, _, _ = _engine(reference, config)
    for x in data[:2]:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    engine.save_checkpoint(directory, tag="fixed", client_state={"epoch": 1})
    saved, saved_steps = [w.clone() for w in _weights(engine)], engine.global_steps
    for x in data[2:]:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    return reference, engine, saved, saved_steps


@pytest.mark.parametrize("stage", [1, 3])
def test_a_failed_save_leaves_the_tag_whole_and_a_corrupt_engine_state_is_refused(tmp_path, stage):
    """Before 2026-11-27 a save whose engine state could not be written (a client_state that does not pickle)
    left the tag with the new weights and the old counters, schedule and client state; and engine_state.pt had no
    checksum (a flipped bit loaded changed counters)."""
    schedule = {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_max_lr": LR, "warmup_num_steps": 2}}
    config = _config(stage, scheduler=schedule)
    reference, engine, saved, saved_steps = _saved_then_trained_on(tmp_path, config)
    with pytest.raises(cm.InvalidArgumentError, match="client_state.*nothing was saved"):
        engine.save_checkpoint(tmp_path, tag="fixed", client_state={"callback": lambda: None})
    resumed, _, _ = _engine(reference, config)
    _, client = resumed.load_checkpoint(tmp_path, tag="fixed")
    assert client == {"epoch": 1} and resumed.global_steps == saved_steps < engine.global_steps
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed), saved))  # the weights of the same save
    state_file = tmp_path / "fixed" / "engine_state.pt"
    envelope = torch.load(state_file, weights_only=False)
    payload = bytearray(envelope["payload"])
    payload[len(payload) // 2] ^= 0x01
    torch.save(dict(envelope, payload=bytes(payload)), state_file)
    with pytest.raises(cm.CheckpointError, match="engine_state.pt.*corrupt.*SHA-256"):
        _engine(reference, config)[0].load_checkpoint(tmp_path, tag="fixed")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"", b"../elsewhere", b"tag\x00"])
def test_a_corrupt_latest_file_is_named(tmp_path, content):
    """Before 2026-11-27 a bare UnicodeDecodeError, or an error about a ``tag`` argument never passed."""
    engine, _, _ = _engine(TinyGPT(), _config(3))
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(cm.CheckpointError, match="latest.*does not name a checkpoint tag"):
        engine.load_checkpoint(tmp_path)


def test_save_where_no_directory_can_be_written_is_a_checkpoint_error(tmp_path):
    """Before 2026-11-27 a raw OSError (a file where the directory goes, a read-only directory, /proc)."""
    engine, _, _ = _engine(TinyGPT(), _config(3))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        targets = [a_file, "/proc"] + ([] if os.geteuid() == 0 else [read_only])  # (root writes anywhere)
        for target in targets:
            with pytest.raises(cm.CheckpointError, match="cannot write the checkpoint directory.*nothing was saved"):
                engine.save_checkpoint(target, tag="t")
    finally:
        read_only.chmod(0o700)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["load_module_only", "load_optimizer_states"])
def test_loading_the_module_only_works_at_every_stage(tmp_path, stage, how):
    """Before 2026-11-27 stages 1 and 2 asked for a ShardedModelV2. The module's weights (and at stages 1/2 the
    masters, which are them) come from the checkpoint; the optimizer's state stays."""
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=4)
    engine, _, _ = _engine(reference, _config(stage))
    for x in data[:2]:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    saved = [w.clone() for w in _weights(engine)]
    fresh, _, _ = _engine(reference, _config(stage))
    fresh.load_checkpoint(tmp_path, tag="t", **{how: how == "load_module_only"})
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), saved))
    for x in data[2:]:  # and it trains on from there
        fresh.backward(lm_loss(fresh(x), x))
        fresh.step()


@pytest.mark.parametrize("where", ["model files", "between the renames"])
def test_a_save_that_dies_part_way_leaves_the_previous_tag_whole(tmp_path, monkeypatch, where):
    """The tag is one unit: a save that fails while writing the model's files, or dies between the two renames
    that swap the new tag in, leaves the previous save of that tag loadable whole (weights, counters, client
    state), and the next load puts a tag left aside back."""
    import chunkmem.faces.engine as engine_module

    reference, engine, saved, saved_steps = _saved_then_trained_on(tmp_path, _config(3))

    class Died(Exception):
        pass

    if where == "model files":
        def dies(*args, **kwargs):
            raise Died()
        monkeypatch.setattr(engine_module, "save_checkpoint", dies)
    else:
        real_rename = os.rename

        def dies(src, dst):
            if ".pending-" in os.fspath(src):  # the second rename: the old tag is aside already
                raise Died()
            real_rename(src, dst)
        monkeypatch.setattr(os, "rename", dies)
    with pytest.raises(Died):
        engine.save_checkpoint(tmp_path, tag="fixed", client_state={"epoch": 2})
    monkeypatch.undo()
    assert not [p for p in os.listdir(tmp_path) if ".pending-" in p]  # the half-written save is removed
    resumed, _, _ = _engine(reference, _config(3))
    _, client = resumed.load_checkpoint(tmp_path)
    assert client == {"epoch": 1} and resumed.global_steps == saved_steps
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed), saved))


def test_load_without_latest_warns_and_returns_none(tmp_path):
    engine, _, _ = _engine(TinyGPT(), _config(3))
    with pytest.warns(UserWarning, match="latest"):
        assert engine.load_checkpoint(tmp_path) == (None, None)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_loads_into_the_plain_module(tmp_path, stage):
    torch.manual_seed(0)
    reference = TinyGPT()
    config = dict(_config(stage), bf16={"enabled": True})
    engine, _, _ = _engine(reference, config)
    x = batches(2, seed=1)
    for batch in x:
        engine.backward(lm_loss(engine(batch), batch))
        engine.step()
    assert engine.save_16bit_model(tmp_path, "model.bin")
    state = torch.load(tmp_path / "model.bin")
    plain = copy.deepcopy(reference)
    plain.load_state_dict(state)
    for (name, p), got in zip(reference.named_parameters(), _weights(engine)):
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], got.to(torch.bfloat16)), name


# ---- DeepSpeed itself -------------------------------------------------------------------------------

def _run_script(python: str, backend: str, stage: int, tmp_path, optimizer: str = "Adam") -> dict:
    out = tmp_path / f"{backend}{stage}{optimizer}.json"
    port = 29600 + stage + (10 if backend == "deepspeed" else 0) + (20 if optimizer != "Adam" else 0)
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="localhost",
               MASTER_PORT=str(port))
    done = subprocess.run([python, os.path.join(HERE, "deepspeed_script.py"), backend, str(stage), str(out),
                           str(tmp_path / f"work-{backend}{stage}{optimizer}"), optimizer], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def _assert_same_training(got: dict, want: dict) -> None:
    for key in ("lrs", "resumed_lrs"):
        assert [lr for row in got[key] for lr in row] == pytest.approx([lr for row in want[key] for lr in row],
                                                                        abs=1e-12), key
    for key in ("losses", "resumed_losses"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key
    for key in ("weights", "resumed_weights"):
        for g, w in zip(got[key], want[key]):
            g, w = torch.tensor(g), torch.tensor(w)
            assert ((g - w).abs() <= 1e-4 * w.abs().clamp(min=1e-2)).all(), key
    for key in ("global_steps", "resumed_global_steps", "loaded", "client_state"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_the_deepspeed_script_trains_as_deepspeed_recorded(tmp_path, stage, optimizer):
    with open(REFERENCE) as f:
        want = json.load(f)["engine" if optimizer == "Adam" else "engine_sgd"][str(stage)]
    _assert_same_training(_run_script(sys.executable, "chunkmem", stage, tmp_path, optimizer), want)


@pytest.mark.skipif(not os.environ.get("CHUNKMEM_DEEPSPEED_PYTHON"),
                    reason="CHUNKMEM_DEEPSPEED_PYTHON does not name an interpreter with DeepSpeed")
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_the_deepspeed_script_trains_as_live_deepspeed(tmp_path, stage, optimizer):
    want = _run_script(os.environ["CHUNKMEM_DEEPSPEED_PYTHON"], "deepspeed", stage, tmp_path, optimizer)
    _assert_same_training(_run_script(sys.executable, "chunkmem", stage, tmp_path, optimizer), want)


def test_schedules_equal_deepspeeds_step_by_step():
    sys.path.insert(0, HERE)
    import deepspeed_schedules_script as cases
    from chunkmem.deepspeed import lr_schedules
    with open(REFERENCE) as f:
        want = json.load(f)["schedules"]
    got = cases.run(lr_schedules)
    assert [c["type"] for c in got] == [c["type"] for c in want]
    for g, w in zip(got, want):
        assert g["state"] == w["state"]
        for row_g, row_w in zip(g["rows"], w["rows"]):
            for (lr_g, betas_g), (lr_w, betas_w) in zip(row_g, row_w):
                assert lr_g == pytest.approx(lr_w, abs=1e-15), g["type"]
                assert betas_g == pytest.approx(betas_w, abs=1e-15), g["type"]


# ---- ZeRO-1/2 accessors -------------------------------------------------------------------------------

def test_accessors_read_zero12_parameters_like_plain_adamw():
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(1, seed=2)[0]
    engine, optim, _ = _engine(reference, {"train_batch_size": 2, "gradient_clipping": 0.0,
                                           "zero_optimization": {"stage": 2}})
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    engine.backward(lm_loss(engine(x), x))
    lm_loss(plain(x), x).backward()
    for p, want in zip(engine.module.parameters(), plain.parameters()):
        torch.testing.assert_close(deepspeed.utils.safe_get_full_grad(p), want.grad, rtol=1e-5, atol=1e-7)
        assert torch.equal(deepspeed.utils.safe_get_local_grad(p), deepspeed.utils.safe_get_full_grad(p).flatten())
        assert deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg") is None  # before the first step
    engine.step()
    plain_optim.step()
    for p, want in zip(engine.module.parameters(), plain.parameters()):
        torch.testing.assert_close(deepspeed.utils.safe_get_full_fp32_param(p), want.detach(), rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(deepspeed.utils.safe_get_full_optimizer_state(p, key),
                                       plain_optim.state[want][key], rtol=1e-5, atol=1e-9)
        assert deepspeed.utils.safe_get_full_grad(p) is None  # the step released it
    with pytest.raises(cm.UnsupportedOperationError, match="LowLevelZeroOptimizer"):
        deepspeed.utils.safe_set_full_fp32_param(next(engine.module.parameters()), torch.zeros(1))


# ---- engine.module: the user's module, as DeepSpeed's -------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_module_is_the_module_passed_in_with_its_own_names(stage):
    """Before 2026-11-27 engine.module was the ShardedModelV2 at stage 3: its names carried a 'module.'
    prefix. engine.parameters() yields each parameter once (the wrapper is no submodule of the engine)."""
    reference = TinyGPT()
    module = copy.deepcopy(reference)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=LR),
                                           config=_config(stage))
    assert engine.module is module
    names = [name for name, _ in reference.named_parameters()]
    assert [name for name, _ in engine.module.named_parameters()] == names
    assert [name for name, _ in engine.named_parameters()] == ["module." + name for name in names]
    assert len({id(p) for p in engine.parameters()}) == len(list(engine.parameters())) == len(names)
    assert list(engine.module.state_dict()) == list(reference.state_dict())
    assert list(engine.state_dict()) == ["module." + key for key in reference.state_dict()]
    if stage == 3:
        assert isinstance(engine.sharded_model, cm.ShardedModelV2) and engine.sharded_model.module is module
        assert all(isinstance(p, cm.ChunkParameter) for p in engine.module.parameters())
    else:
        assert engine.sharded_model is None
    engine.eval()
    assert not module.training and (stage != 3 or not engine.sharded_model.training)
    engine.train()
    assert module.training and (stage != 3 or engine.sharded_model.training)


def test_engine_module_state_dict_at_stage_3_equals_plain_adamw():
    """fp32, one process: engine.module.state_dict() (the module's own state_dict over chunk-managed
    parameters) holds the trained values under the module's keys, as plain PyTorch trained them."""
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=8)
    engine, _, _ = _engine(reference, _config(3, gradient_clipping=0.0))
    for x in data:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    plain = copy.deepcopy(reference)
    optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        for x in data[2 * step:2 * step + 2]:
            (lm_loss(plain(x), x) / 2).backward()
        optim.step()
        optim.zero_grad()
    assert type(engine.module) is TinyGPT
    state, want = engine.module.state_dict(), plain.state_dict()
    assert list(state) == list(want)
    for name, p in engine.module.named_parameters():  # a read outside the forward: a copy of the values
        torch.testing.assert_close(p.detach(), want[name], rtol=0, atol=1e-6, msg=name)
    for key, value in want.items():
        assert type(state[key]) is torch.Tensor and state[key].dtype == torch.float32, key  # copies, not chunk views
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)
    assert not torch.equal(state["wte.weight"], reference.state_dict()["wte.weight"])  # it trained
    for key, value in engine.state_dict().items():
        assert torch.equal(value, state[key[len("module."):]]), key


def test_engine_module_save_pretrained_at_stage_3(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=LR),
                                           config=_config(3))
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        engine.backward(engine(x, labels=x)["loss"])
        engine.step()
    assert engine.module is module
    engine.module.save_pretrained(tmp_path)
    loaded = type(module).from_pretrained(tmp_path)
    state = engine.sharded_model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_data_types_grad_accum_dtype_reaches_the_engines_model():
    config = dict(_config(3), bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"})
    engine, _, _ = _engine(TinyGPT(), config)
    assert engine.sharded_model.settings.grad_accum_dtype == torch.bfloat16
    with pytest.raises(cm.InvalidArgumentError) as caught:
        _engine(TinyGPT(), dict(config, data_types={"grad_accum_dtype": "fp8"}))
    assert caught.value.argument == "data_types.grad_accum_dtype"


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, argument", [
    ({"zero_optimization": {"stage": 3}}, "train_batch_size"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}},
     "train_batch_size"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
      "zero_optimization": {"stage": 3}}, "train_batch_size"),
    ({"train_batch_size": 0, "zero_optimization": {"stage": 3}}, "train_batch_size"),
    ({"train_batch_size": 2, "steps_per_print": 0, "zero_optimization": {"stage": 3}}, "steps_per_print"),
    ({"train_batch_size": 2, "scheduler": {"type": "Cosine"}, "zero_optimization": {"stage": 3}}, "scheduler.type"),
    ({"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}},
      "zero_optimization": {"stage": 3}}, "scheduler.params.warmup_steps"),
    ({"train_batch_size": 2, "scheduler": {"type": "WarmupDecayLR", "params": {}},
      "zero_optimization": {"stage": 3}}, "scheduler.params"),
])
def test_bad_config_names_the_key_and_changes_nothing(config, argument):
    module = TinyGPT()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(cm.InvalidArgumentError) as caught:
        deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters()), config=config)
    assert caught.value.argument == argument
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert all(type(p) is nn.Parameter for p in module.parameters())


def test_batch_sizes_are_derived_as_deepspeed_derives_them():
    for given, want in [({"train_batch_size": 8}, (8, 8, 1)),
                        ({"train_micro_batch_size_per_gpu": 3}, (3, 3, 1)),
                        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, (12, 3, 4)),
                        ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, (12, 6, 2)),
                        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}, (10, 2, 5))]:
        engine, _, _ = _engine(TinyGPT(), dict(given, zero_optimization={"stage": 3}))
        got = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
        assert got == want, given


def test_engine_refuses_what_it_cannot_do():
    engine, _, _ = _engine(TinyGPT(), _config(3))
    x = batches(1)[0]
    with engine.no_sync():
        with pytest.raises(cm.UnsupportedOperationError, match="no_sync"):
            engine.step()
    with pytest.raises(cm.InvalidArgumentError) as caught:
        engine.backward(lm_loss(engine(x), x), retain_graph=True)
    assert caught.value.argument == "retain_graph"
    for tag in ("", "a/b", ".."):
        with pytest.raises(cm.InvalidArgumentError) as caught:
            engine.save_checkpoint("/tmp", tag=tag)
        assert caught.value.argument == "tag"
    bare, optim, _, _ = deepspeed.initialize(model=TinyGPT(), config={"train_batch_size": 1,
                                                                      "zero_optimization": {"stage": 3}})
    assert optim is None
    with pytest.raises(cm.UnsupportedOperationError, match="optimizer"):
        bare.step()


def test_a_module_passed_first_is_the_model_and_a_client_schedule_is_stepped():
    module = TinyGPT()
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    engine, optim, loader, schedule = deepspeed.initialize(
        module, optimizer=optimizer, lr_scheduler=lambda o: WarmupLR(o, warmup_max_lr=LR, warmup_num_steps=2),
        training_data=torch.utils.data.TensorDataset(torch.zeros(6, 16, dtype=torch.long)),
        config={"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}})
    assert engine.module is module and isinstance(engine.sharded_model, cm.ShardedModelV2)
    assert isinstance(schedule, WarmupLR)
    assert [len(b[0]) for b in loader] == [3, 3]
    for (x,) in loader:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    assert schedule.last_batch_iteration == 1 and engine.get_lr() == [LR]  # log warm-up over 2 steps: done


def test_a_schedule_argument_only_its_step_reads_is_refused_before_anything_is_wrapped():
    """Before 2026-11-27 StepLR's step_size="3" raised a TypeError at the first step, after the weights were
    updated."""
    module = TinyGPT()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "scheduler": {"type": "StepLR", "params": {"step_size": "3"}}}
    with pytest.raises(cm.InvalidArgumentError, match="scheduler.params.*StepLR"):
        deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    cm.ShardedModelV2(module, cm.TensorShardStrategy(), dtype=torch.float32)  # not wrapped: free to wrap


@pytest.mark.parametrize("stage", [1, 3])
def test_a_callable_schedule_gets_the_clients_optimizer_as_in_deepspeed(stage):
    """Before 2026-11-27 it got chunkmem's wrapper (LowLevelZeroOptimizer at stages 1 and 2)."""
    module = TinyGPT()
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    given = []

    def make(o):
        given.append(o)
        return WarmupLR(o, warmup_max_lr=LR, warmup_num_steps=2)
    engine, optim, _, _ = deepspeed.initialize(module, optimizer=optimizer, lr_scheduler=make,
                                               config={"train_micro_batch_size_per_gpu": 2,
                                                       "zero_optimization": {"stage": stage}})
    assert given == [optimizer] and optim is not optimizer
    x = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no false "lr_scheduler.step() before optimizer.step()"
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    assert engine.get_lr() == [optim.param_groups[0]["lr"]]


def test_accelerator_and_comm_describe_one_cpu_process():
    accelerator = deepspeed.accelerator.get_accelerator()
    if not torch.cuda.is_available():
        assert accelerator.device_name() == "cpu" and accelerator.communication_backend_name() == "gloo"
    assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    assert torch.equal(t, torch.ones(3))


def test_the_deepspeed_example_trains_and_resumes_identically(tmp_path):
    config = json.load(open(os.path.join(HERE, "..", "examples", "ds_config.json")))
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, MASTER_PORT="29631")
    done = subprocess.run([sys.executable, os.path.join(HERE, "..", "examples", "deepspeed_engine.py"), "--steps", "6",
                           "--deepspeed_config", str(tmp_path / "config.json"), "--checkpoint-dir", str(tmp_path / "ck")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "last steps identical" in done.stdout and "'disk': {'exp_avg'" in done.stdout


# ---- two ranks ------------------------------------------------------------------------------------

def _two_rank_worker(rank: int, world: int, stage: int, workdir: str) -> dict:
    torch.manual_seed(0)
    data = batches(8, batch=4, seed=12)  # the global batches; each rank takes its half of every one
    config = dict(_config(stage), train_batch_size=8, gradient_clipping=0.05,
                  scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 2}})
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu"):
            module = TinyGPT()
    else:
        module = TinyGPT()
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=dict(config, optimizer={"type": "AdamW", "params": {"lr": LR}}))
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (2, 2)
    for x in data[:4]:
        part = x[2 * rank:2 * rank + 2]
        engine.backward(lm_loss(engine(part), part))
        engine.step()
    engine.save_checkpoint(workdir, client_state={"rank_sees": "the same"})
    for x in data[4:]:
        part = x[2 * rank:2 * rank + 2]
        engine.backward(lm_loss(engine(part), part))
        engine.step()
    _, client = engine.load_checkpoint(workdir)  # back to the middle, in the same engine
    back = _weights(engine)
    refused, gathered = None, None
    if stage == 3:  # each rank holds a shard: the module's state_dict is refused, naming the ways (DeepSpeed's
        try:        # returns empty tensors); gathered, it holds the whole values
            engine.module.state_dict()
        except cm.ParameterAccessError as e:
            refused = str(e)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            state = engine.module.state_dict()  # read after the block: it keeps the gathered values
        gathered = [state[name] for name, _ in engine.module.named_parameters()]
    return {"weights_after_load": back, "client": client, "global_steps": engine.global_steps,
            "lr": engine.get_lr(), "refused": refused, "gathered": gathered}


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_equal_one_process_with_the_double_batch(tmp_path, stage):
    from distributed import run_ranks
    ranks = run_ranks(_two_rank_worker, 2, stage, str(tmp_path))
    torch.manual_seed(0)
    data = batches(8, batch=4, seed=12)
    config = dict(_config(stage), train_micro_batch_size_per_gpu=4, gradient_clipping=0.05,
                  scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 2}})
    module = TinyGPT()
    one, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                        config=dict(config, optimizer={"type": "AdamW", "params": {"lr": LR}}))
    for x in data[:4]:
        one.backward(lm_loss(one(x), x))
        one.step()
    want = _weights(one)
    for result in ranks:
        assert result["client"] == {"rank_sees": "the same"} and result["global_steps"] == 2
        for got, w in zip(result["weights_after_load"], want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
        if stage == 3:
            assert all(way in result["refused"] for way in ("sharded over 2 ranks", "engine.save_16bit_model",
                                                            "GatheredParameters", "engine.sharded_model.state_dict"))
            assert len(result["gathered"]) == len(result["weights_after_load"])
            for got, w in zip(result["gathered"], result["weights_after_load"]):
                assert torch.equal(got, w)
    # what 2 ranks saved loads into one process: resharded (stage 3) or the full file (stage 2), bit for bit
    _, client = one.load_checkpoint(tmp_path)
    assert client == {"rank_sees": "the same"} and one.global_steps == 2
    for got, w in zip(_weights(one), ranks[0]["weights_after_load"]):
        assert torch.equal(got, w)
    rigid_config = dict(config, zero_optimization=dict(config["zero_optimization"], elastic_checkpoint=False))
    module = TinyGPT()
    rigid, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                          config=dict(rigid_config, optimizer={"type": "AdamW", "params": {"lr": LR}}))
    if stage == 3:
        with pytest.raises(cm.InvalidArgumentError, match="saved by 2; elastic=False"):
            rigid.load_checkpoint(tmp_path)
    else:  # a full checkpoint: any world size whatever the key
        rigid.load_checkpoint(tmp_path)


# ---- the rest of the engine's surface ---------------------------------------------------------------

def test_zero_init_builds_into_chunks_with_the_configs_dtype():
    config = {"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        module = TinyGPT()
    assert all(p.dtype == torch.bfloat16 and isinstance(p, cm.ChunkParameter) for p in module.parameters())
    assert deepspeed.zero.Init(dtype=torch.float32).dtype == torch.float32
    assert deepspeed.zero.Init().dtype == torch.float16  # DeepSpeed's default without a config
    with deepspeed.zero.Init(enabled=False):
        plain = TinyGPT()
    assert all(type(p) is nn.Parameter for p in plain.parameters())
    for kwargs, argument in [(dict(remote_device="nvme"), "remote_device"), (dict(module=TinyGPT()), "module"),
                             (dict(enabled="yes"), "enabled"), (dict(flavour=1), "flavour")]:
        with pytest.raises(cm.InvalidArgumentError) as caught:
            deepspeed.zero.Init(**kwargs)
        assert caught.value.argument == argument
    with pytest.warns(cm.NoEffectWarning, match="pin_memory"):
        deepspeed.zero.Init(pin_memory=True)


def test_zero_init_on_nvme_builds_onto_the_disk_tier_and_trains_like_a_cpu_build(tmp_path):
    """remote_device="nvme" (DeepSpeed's name) builds the chunks into the config's offload_param.nvme_path;
    the engine then trains exactly as from a model built on "cpu"."""
    (tmp_path / "nvme").mkdir()
    offload = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    weights = {}
    for remote in ("cpu", "nvme"):
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote, dtype=torch.float32):
            module = TinyGPT()
        chunks = {slot_of(p).chunk for p in module.parameters()}
        assert all(c.param.shard.on_disk for c in chunks) == (remote == "nvme")
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
        for x in batches(3, seed=5):
            engine.backward(lm_loss(engine(x), x))
            engine.step()
        weights[remote] = _weights(engine)
    assert all(torch.equal(a, b) for a, b in zip(weights["cpu"], weights["nvme"]))
    with pytest.raises(cm.InvalidArgumentError, match="offload_param.nvme_path"):
        deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}, remote_device="nvme")


def test_progress_lines_breakdown_and_partial_loads(tmp_path, capsys):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=8)
    engine, _, schedule = _engine(reference, _config(3, steps_per_print=1, wall_clock_breakdown=True,
                                                     scheduler={"type": "OneCycle", "params": {
                                                         "cycle_min_lr": 1e-3, "cycle_max_lr": LR,
                                                         "cycle_first_step_size": 2}}))
    for x in data:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[chunkmem] step=")]
    assert len(lines) == 2 and "forward" in lines[0] and "backward" in lines[0] and "step" in lines[1]
    assert engine.get_mom() == [schedule.get_mom()[0]]
    engine.save_checkpoint(tmp_path, tag="mid")
    before = _weights(engine)
    x = data[0]
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    steps = engine.global_steps
    path, _ = engine.load_checkpoint(tmp_path, tag="mid", load_module_only=True)
    assert path.endswith("mid") and engine.global_steps == steps  # the counters stay with load_module_only
    for got, want in zip(_weights(engine), before):
        assert torch.equal(got, want)
    engine.load_checkpoint(tmp_path, tag="mid", load_optimizer_states=False)
    assert engine.global_steps == 2
    engine.empty_partition_cache()
    assert engine.sharded_model.cached_bytes() == 0


def test_add_config_arguments_and_init_distributed_in_one_process(tmp_path):
    import argparse
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "c.json")])
    assert args.deepspeed and args.deepspeed_config.endswith("c.json")
    (tmp_path / "c.json").write_text(json.dumps({"train_batch_size": 1, "zero_optimization": {"stage": 3}}))
    engine, _, _, _ = deepspeed.initialize(args=args, model=TinyGPT())
    assert engine.train_batch_size() == 1
    code = ("import chunkmem.deepspeed as ds, torch.distributed as dist; ds.init_distributed(); "
            "print(dist.get_rank(), dist.get_world_size(), dist.get_backend())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["0", "1", "gloo" if not torch.cuda.is_available() else "nccl"]


def test_an_overflowing_step_is_skipped_counted_and_leaves_the_schedule():
    torch.manual_seed(0)
    config = {"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 4}},
              "zero_optimization": {"stage": 3}}
    engine, optim, schedule = _engine(TinyGPT(), config)
    x = batches(1, seed=3)[0]
    before = _weights(engine)
    engine.backward(lm_loss(engine(x), x) * float("inf"))
    engine.step()
    assert (engine.global_steps, engine.skipped_steps, schedule.last_batch_iteration) == (1, 1, -1)
    assert not engine.was_step_applied() and engine.fp16_enabled()
    assert not math.isfinite(engine.get_global_grad_norm())
    assert optim.loss_scale == 2.0 ** 8  # DeepSpeed's hysteresis 2: the first overflow does not back off yet
    for got, want in zip(_weights(engine), before):
        assert torch.equal(got, want)
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    assert (engine.global_steps, engine.skipped_steps, schedule.last_batch_iteration) == (2, 1, 0)
    assert engine.was_step_applied() and math.isfinite(engine.get_global_grad_norm())


def test_the_engine_steps_any_optimizer_and_resumes_it(tmp_path):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(8, seed=13)
    config = dict(_config(3), gradient_clipping=0.0)
    module = copy.deepcopy(reference)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1,
                                                                                   momentum=0.9), config=config)
    for x in data[:4]:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    engine.save_checkpoint(tmp_path)
    assert (tmp_path / "global_step2" / "zero").is_dir()  # the sharded format holds SGD's state too
    for x in data[4:]:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    plain = copy.deepcopy(reference)
    optim = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        for x in data[2 * step:2 * step + 2]:
            (lm_loss(plain(x), x) / 2).backward()
        optim.step()
        optim.zero_grad()
    for got, want in zip(_weights(engine), plain.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    module = copy.deepcopy(reference)
    resumed, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1,
                                                                                    momentum=0.9), config=config)
    resumed.load_checkpoint(tmp_path)
    for x in data[4:]:
        resumed.backward(lm_loss(resumed(x), x))
        resumed.step()
    for got, want in zip(_weights(resumed), _weights(engine)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("stage", [2, 3])
def test_torch_optimizer_and_scheduler_names_in_the_config_as_deepspeed_builds_them(stage):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(8, seed=14)
    kind, options = ("SGD", {"lr": 0.1, "momentum": 0.9}) if stage == 3 else ("AdamW", {"lr": LR, "weight_decay": WD})
    config = dict(_config(stage), gradient_clipping=0.0, optimizer={"type": kind, "params": options},
                  scheduler={"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}})
    module = copy.deepcopy(reference)
    engine, optim, _, schedule = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                      config=config)
    assert isinstance(schedule, torch.optim.lr_scheduler.StepLR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would be false here
        for x in data:
            engine.backward(lm_loss(engine(x), x))
            engine.step()
    plain = copy.deepcopy(reference)
    plain_optim = getattr(torch.optim, kind)(plain.parameters(), **options)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain_optim, step_size=2, gamma=0.5)
    for step in range(4):
        for x in data[2 * step:2 * step + 2]:
            (lm_loss(plain(x), x) / 2).backward()
        plain_optim.step()
        plain_optim.zero_grad()
        plain_schedule.step()
    assert engine.get_lr() == plain_schedule.get_last_lr()
    for got, want in zip(_weights(engine), plain.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(cm.InvalidArgumentError) as caught:
        deepspeed.initialize(model=TinyGPT(), config=dict(config, optimizer={"type": "SGD", "params": {"lrr": 1}}))
    assert caught.value.argument == "optimizer.params.lrr"
