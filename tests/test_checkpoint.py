"""Checkpoints: model and optimizer state dicts, the full and sharded checkpoint files, atomic saves,
consolidation, loading into and from plain PyTorch, and bad input.

The references: training 2k steps straight (resuming must be bitwise identical), a plain module's
forward, and ``torch.optim.AdamW`` stepping from the same state (1e-6 relative).
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from distributed import run_ranks
from models import TinyGPT, batches, build_sharded, lm_loss, train

K = 3  # steps before and after the checkpoint


class GPTWithBuffers(TinyGPT):
    """TinyGPT with a persistent buffer the forward changes, and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)
        return super().forward(idx)


def reference(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPTWithBuffers()


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["loss_scaler"] == b["loss_scaler"]
    assert sorted(a["state"]) == sorted(b["state"])
    for index, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


def checkpoint_path(tmp_path, sharded: bool) -> str:
    return str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))


# ---- resuming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
@pytest.mark.parametrize("dtype,reuse,before,after", [(torch.float32, False, "cpu", "cuda"),
                                                      (torch.float16, True, "cuda", "auto")],
                         ids=["fp32-cpu-to-cuda", "fp16-reuse-cuda-to-auto"])
def test_resume_is_bitwise_identical_to_training_straight(tmp_path, dtype, reuse, before, after, sharded):
    data = batches(2 * K, seed=1)
    straight, straight_optim = build_sharded(reference(), before, dtype, reuse=reuse)
    straight_losses = train(straight, straight_optim, data)

    first, first_optim = build_sharded(reference(), before, dtype, reuse=reuse)
    losses = train(first, first_optim, data[:K])
    path = checkpoint_path(tmp_path, sharded)
    cm.save_checkpoint(path, first, first_optim, sharded=sharded)
    # another initialisation, other hyper-parameters and loss scale: the checkpoint sets them all
    resumed, resumed_optim = build_sharded(reference(seed=5), after, dtype, reuse=reuse, lr=0.5, weight_decay=0.3,
                                           initial_scale=2.0)
    cm.load_checkpoint(path, resumed, resumed_optim)
    losses += train(resumed, resumed_optim, data[K:])

    assert losses == straight_losses
    assert_same_state(resumed.state_dict(), straight.state_dict())
    assert_same_optimizer_state(resumed_optim.state_dict(), straight_optim.state_dict())
    if dtype == torch.float16:
        assert resumed_optim.loss_scale == straight_optim.loss_scale


# ---- plain PyTorch interoperability --------------------------------------------------------------


def test_full_model_state_loads_into_plain_module_and_back(tmp_path):
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    train(model, optim, batches(K))
    path = checkpoint_path(tmp_path, sharded=False)
    cm.save_checkpoint(path, model, optim)
    plain = reference(seed=9)
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))

    other = reference(seed=11)  # a plain module's state dict (both keys of the tied weight) into the model
    result = model.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    assert_same_state(model.state_dict(), other.state_dict())


def plain_step(plain: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    lm_loss(plain(x), x).backward()
    optim.step()
    optim.zero_grad()


def assert_close_to_plain(model, plain: nn.Module) -> None:
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6 * value.abs().max().item())


def test_optimizer_state_loads_into_torch_adamw(tmp_path):
    data = batches(K + 1, seed=2)
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    train(model, optim, data[:K])
    path = checkpoint_path(tmp_path, sharded=False)
    cm.save_checkpoint(path, model, optim)
    saved = torch.load(path, weights_only=True)
    plain = reference(seed=3)
    plain.load_state_dict(saved["model"])
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=0.5, weight_decay=0.5)
    plain_optim.load_state_dict(saved["optimizer"])  # the extra "loss_scaler" key is ignored
    group = plain_optim.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["decoupled_weight_decay"]) == (1e-2, 0.01, True)
    assert all(plain_optim.state[p]["step"].item() == K for p in plain.parameters())

    plain_step(plain, plain_optim, data[K])
    train(model, optim, data[K:])
    assert_close_to_plain(model, plain)


def test_torch_adamw_state_loads_into_sharded_optimizer():
    data = batches(K + 1, seed=4)
    plain = reference()
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    for x in data[:K]:
        plain_step(plain, plain_optim, x)
    model, optim = build_sharded(reference(seed=6), "cuda", torch.float32, lr=0.5, weight_decay=0.5)
    model.load_state_dict(plain.state_dict())
    optim.load_state_dict(plain_optim.state_dict())
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["adamw_mode"] is True
    assert all(set(chunk.steps.values()) == {K} for chunk in model.chunks if chunk.trainable)

    plain_step(plain, plain_optim, data[K])
    train(model, optim, data[K:])
    assert_close_to_plain(model, plain)


def test_torch_adam_state_switches_to_l2_weight_decay():
    plain = reference()
    plain_optim = torch.optim.Adam(plain.parameters(), lr=1e-2, weight_decay=0.01)
    plain_step(plain, plain_optim, batches(1)[0])
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    optim.load_state_dict(plain_optim.state_dict())
    assert optim.param_groups[0]["adamw_mode"] is False


# ---- interrupted saves ---------------------------------------------------------------------------


def killing_torch_save(monkeypatch):
    """Make torch.save write a few bytes and die, as a process killed mid-write would."""
    def save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt("killed while writing")
    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch, sharded):
    data = batches(K + 1, seed=5)
    model, optim = build_sharded(reference(), "cpu", torch.float16)
    train(model, optim, data[:K])
    path = checkpoint_path(tmp_path, sharded)
    cm.save_checkpoint(path, model, optim, sharded=sharded)
    expected, expected_optim = model.state_dict(), optim.state_dict()
    files = sorted(os.listdir(path if sharded else tmp_path))
    train(model, optim, data[K:])

    with monkeypatch.context() as patch:
        killing_torch_save(patch)
        with pytest.raises(KeyboardInterrupt):
            cm.save_checkpoint(path, model, optim, sharded=sharded)
    assert sorted(os.listdir(path if sharded else tmp_path)) == files
    if sharded:  # all rank files written, killed before the manifest is replaced
        real_replace = os.replace

        def replace(src, dst):
            if os.path.basename(dst) == "manifest.json":
                raise KeyboardInterrupt("killed before the commit")
            real_replace(src, dst)
        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", replace)
            with pytest.raises(KeyboardInterrupt):
                cm.save_checkpoint(path, model, optim, sharded=True)
        # what a SIGKILL at that point would leave: the new rank file and a temporary manifest
        (tmp_path / "ckpt" / "shard-00ff-rank0-of-1.pt").write_bytes(b"complete but uncommitted")
        (tmp_path / "ckpt" / ".manifest.json.0a1b2c.tmp").write_bytes(b"{")
    else:
        (tmp_path / ".ckpt.pt.0a1b2c.tmp").write_bytes(b"partial")

    restored, restored_optim = build_sharded(reference(seed=8), "cpu", torch.float16)
    cm.load_checkpoint(path, restored, restored_optim)
    assert_same_state(restored.state_dict(), expected)
    assert_same_optimizer_state(restored_optim.state_dict(), expected_optim)
    if sharded:  # the next complete save removes what interrupted ones left
        cm.save_checkpoint(path, restored, restored_optim, sharded=True)
        names = os.listdir(path)
        assert len(names) == 2 and "manifest.json" in names, names


# ---- consolidation -------------------------------------------------------------------------------


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_consolidated_sharded_checkpoint_equals_full_checkpoint(tmp_path, with_optimizer):
    model, optim = build_sharded(reference(), "cpu", torch.float16, reuse=True)
    train(model, optim, batches(K, seed=6))
    saved_optim = optim if with_optimizer else None
    cm.save_checkpoint(tmp_path / "full.pt", model, saved_optim)
    cm.save_checkpoint(tmp_path / "sharded", model, saved_optim, sharded=True)
    full = cm.consolidate_checkpoint(tmp_path / "full.pt")
    consolidated = cm.consolidate_checkpoint(tmp_path / "sharded")
    assert_same_state(consolidated["model"], full["model"])
    assert_same_state(full["model"], model.state_dict())
    assert "calls" in full["model"] and "scratch" not in full["model"]
    if with_optimizer:
        assert_same_optimizer_state(consolidated["optimizer"], full["optimizer"])
        assert full["optimizer"]["loss_scaler"] == optim.grad_scaler.state_dict()
    else:
        assert consolidated["optimizer"] is None and full["optimizer"] is None


def test_state_dict_rank0_only_on_one_rank_is_the_full_dict():
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    train(model, optim, batches(1))
    assert_same_optimizer_state(optim.state_dict(rank0_only=True), optim.state_dict())


def test_never_stepped_optimizer_has_no_state_like_torch():
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    state = optim.state_dict()
    assert state["state"] == {} and state["loss_scaler"] is None
    assert state["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))


# ---- model.load_state_dict -----------------------------------------------------------------------


def test_load_state_dict_keys_strict_and_not():
    model, _ = build_sharded(reference(), "cpu", torch.float32)
    before = model.state_dict()
    source = reference(seed=4).state_dict()
    without_bias = {k: v for k, v in source.items() if k != "ln_f.bias"}
    with pytest.raises(cm.InvalidArgumentError, match=r"missing keys \['ln_f.bias'\]"):
        model.load_state_dict(without_bias)
    with pytest.raises(cm.InvalidArgumentError, match=r"unexpected keys \['extra'\]"):
        model.load_state_dict({**source, "extra": torch.zeros(1)})
    assert_same_state(model.state_dict(), before)  # nothing changed

    result = model.load_state_dict({**without_bias, "extra": torch.zeros(1)}, strict=False)
    assert result.missing_keys == ["ln_f.bias"] and result.unexpected_keys == ["extra"]
    after = model.state_dict()
    assert torch.equal(after["ln_f.bias"], before["ln_f.bias"])
    assert torch.equal(after["blocks.0.fc1.weight"], source["blocks.0.fc1.weight"])

    # one key of the tied pair is enough without strict
    only_head = {k: v for k, v in source.items() if k != "wte.weight"}
    assert model.load_state_dict(only_head, strict=False).missing_keys == ["wte.weight"]


@pytest.mark.parametrize("change,match", [
    (lambda s: s.update({"blocks.1.fc2.weight": torch.zeros(3, 3)}), r"state_dict\['blocks.1.fc2.weight'\].*shape"),
    (lambda s: s.update({"side.weight": torch.zeros(32, 32, dtype=torch.int64)}), r"side.weight.*floating"),
    (lambda s: s.update({"ln_f.weight": [1.0] * 32}), r"ln_f.weight.*a tensor"),
    (lambda s: s.update({"lm_head.weight": s["wte.weight"] + 1}), r"lm_head.weight.*tied"),
    (lambda s: s.update({"calls": torch.zeros(4)}), r"calls.*shape"),
])
def test_load_state_dict_bad_values_change_nothing(change, match):
    model, _ = build_sharded(reference(), "cpu", torch.float32)
    before = model.state_dict()
    source = reference(seed=4).state_dict()
    change(source)
    with pytest.raises(cm.InvalidArgumentError, match=match):
        model.load_state_dict(source)
    assert_same_state(model.state_dict(), before)


def test_fp32_values_survive_in_the_masters_of_a_16bit_model():
    source = reference(seed=4).state_dict()
    model, _ = build_sharded(reference(), "cpu", torch.float16)
    model.load_state_dict(source)
    assert_same_state(model.state_dict(), {k: v if k != "calls" else v.half() for k, v in source.items()})

    no_optimizer = cm.ShardedModelV2(reference(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                     dtype=torch.float16, chunk_size=16384)
    with pytest.warns(UserWarning, match="build the optimizer first"):
        no_optimizer.load_state_dict(source)


def test_loading_or_saving_while_parameters_hold_gradients_is_refused(tmp_path):
    model, optim = build_sharded(reference(), "cpu", torch.float16, reuse=True)
    cm.save_checkpoint(tmp_path / "before.pt", model, optim)
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.CheckpointError, match="reuse_fp16_shard.*optim.step"):
        cm.save_checkpoint(tmp_path / "ckpt.pt", model, optim)
    with pytest.raises(cm.CheckpointError, match="load_checkpoint.*holds the gradients"):
        cm.load_checkpoint(tmp_path / "before.pt", model, optim)
    with pytest.raises(cm.CheckpointError, match="load_state_dict.*holds the gradients"):
        model.load_state_dict(model.state_dict())
    assert os.listdir(tmp_path) == ["before.pt"]
    optim.step()
    cm.save_checkpoint(tmp_path / "ckpt.pt", model, optim)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.fixture
def trained(tmp_path):
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    train(model, optim, batches(1))
    return model, optim


def test_bad_save_arguments(tmp_path, trained):
    model, optim = trained
    other_model, other_optim = build_sharded(reference(), "cpu", torch.float32)
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(cm.InvalidArgumentError, match="path=3 .*str or os.PathLike"):
        cm.save_checkpoint(3, model)
    with pytest.raises(cm.InvalidArgumentError, match="model=.Linear.*ShardedModelV2"):
        cm.save_checkpoint(tmp_path / "x.pt", nn.Linear(2, 2))
    with pytest.raises(cm.InvalidArgumentError, match="optimizer=.*another model"):
        cm.save_checkpoint(tmp_path / "x.pt", model, other_optim)
    with pytest.raises(cm.InvalidArgumentError, match="optimizer=.HybridAdam.*ShardedOptimizerV2"):
        cm.save_checkpoint(tmp_path / "x.pt", model, optim.optim)
    with pytest.raises(cm.InvalidArgumentError, match="sharded='yes'"):
        cm.save_checkpoint(tmp_path / "x.pt", model, optim, sharded="yes")
    with pytest.raises(cm.InvalidArgumentError, match="not a directory"):
        cm.save_checkpoint(tmp_path, model, optim)
    with pytest.raises(cm.InvalidArgumentError, match="not a file"):
        cm.save_checkpoint(tmp_path / "a_file", model, optim, sharded=True)
    with pytest.raises(cm.InvalidArgumentError, match="existing directory"):
        cm.save_checkpoint(tmp_path / "no" / "x.pt", model, optim)
    with pytest.raises(cm.InvalidArgumentError, match="rank0_only"):
        optim.state_dict(rank0_only=1)
    with pytest.raises(cm.InvalidArgumentError, match="assign"):
        model.load_state_dict(model.state_dict(), assign=True)


def test_bad_load_arguments(tmp_path, trained):
    model, optim = trained
    with pytest.raises(cm.InvalidArgumentError, match="nothing is there"):
        cm.load_checkpoint(tmp_path / "missing.pt", model, optim)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(cm.InvalidArgumentError, match="chunkmem.checkpoint.full/1"):
        cm.load_checkpoint(tmp_path / "plain.pt", model)
    with pytest.raises(cm.InvalidArgumentError, match="manifest.json"):
        cm.load_checkpoint(tmp_path, model)
    cm.save_checkpoint(tmp_path / "model_only.pt", model)
    cm.save_checkpoint(tmp_path / "model_only", model, sharded=True)
    for path in ("model_only.pt", "model_only"):
        with pytest.raises(cm.InvalidArgumentError, match="optimizer=.*saved without optimizer state"):
            cm.load_checkpoint(tmp_path / path, model, optim)
        cm.load_checkpoint(tmp_path / path, model)


def test_sharded_load_into_another_layout_or_world_size(tmp_path, trained):
    model, optim = trained
    path = tmp_path / "ckpt"
    cm.save_checkpoint(path, model, optim, sharded=True)
    other_layout, other_optim = build_sharded(reference(seed=3), "cpu", torch.float32, chunk_size=32768)
    with pytest.raises(cm.InvalidArgumentError, match="chunk layout.*elastic=False.*another chunk size"):
        cm.load_checkpoint(path, other_layout, other_optim, elastic=False)
    cm.load_checkpoint(path, other_layout, other_optim)
    assert_same_state(other_layout.state_dict(), model.state_dict())
    assert_same_optimizer_state(other_optim.state_dict(), optim.state_dict())
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "world": 2}))
    with pytest.raises(cm.InvalidArgumentError, match="saved by 1 ranks.*saved by 2; elastic=False"):
        cm.load_checkpoint(path, model, optim, elastic=False)
    with pytest.raises(cm.InvalidArgumentError, match="rank 0's file .*rank0-of-2.pt"):
        cm.load_checkpoint(path, model, optim)
    with pytest.raises(cm.InvalidArgumentError, match="rank 0's file .*rank0-of-2.pt"):
        cm.consolidate_checkpoint(path)


def test_bad_optimizer_state_dicts_change_nothing(trained):
    model, optim = trained
    good = optim.state_dict()
    chunk = next(c for c in model.chunks if c.trainable and len(c.slots) > 1)
    index_of = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
    first, second = (index_of[id(s.param)] for s in chunk.slots[:2])

    def edited(edit):
        state = copy.deepcopy(good)
        edit(state)
        return state

    cases = [
        ({"state": {}}, "without 'param_groups'"),
        (edited(lambda s: s["param_groups"].append(dict(s["param_groups"][0]))), "2 groups.*1 groups"),
        (edited(lambda s: s["param_groups"][0]["params"].pop()), "group of 16 parameters"),
        (edited(lambda s: s["param_groups"][0].update(amsgrad=True)), "amsgrad.*not supported"),
        (edited(lambda s: s["param_groups"][0].pop("betas")), "without 'betas'"),
        (edited(lambda s: s["param_groups"][0].update(betas=0.9)), "unreadable hyper-parameter"),
        (edited(lambda s: s["state"].update({99: s["state"][0]})), "index 99"),
        (edited(lambda s: s["state"][first].update(exp_avg=torch.zeros(2))), r"\['exp_avg'\].*shape"),
        (edited(lambda s: s["state"][first].update(step=torch.tensor(-1.0))), "non-negative whole number"),
        (edited(lambda s: s.update(loss_scaler={"scale": 2.0})), "loss_scaler.*overflows_since_growth"),
    ]
    for bad, match in cases:
        with pytest.raises(cm.InvalidArgumentError, match=match):
            optim.load_state_dict(bad)
        assert_same_optimizer_state(optim.state_dict(), good)
    # parameters of one chunk with different steps, or without state, load as torch keeps them (before 2026-11-27
    # refused: one step a chunk)
    optim.load_state_dict(edited(lambda s: (s["state"][second].update(step=torch.tensor(7.0)), s["state"].pop(first))))
    loaded = optim.state_dict()["state"]
    assert first not in loaded and int(loaded[second]["step"]) == 7


# ---- two ranks -----------------------------------------------------------------------------------


def _two_rank_worker(rank: int, world: int, directory: str) -> dict:
    """Train a 16-bit model sharded over the ranks (each rank its own rows), save both formats (the
    sharded one twice, the second replacing the first) and load each back into a fresh model."""
    model, optim = build_sharded(reference(), "cpu", torch.float16, reuse=True)
    train(model, optim, [x[rank:rank + 1] for x in batches(K, seed=7)])
    full, sharded = os.path.join(directory, "full.pt"), os.path.join(directory, "sharded")
    cm.save_checkpoint(full, model, optim)
    cm.save_checkpoint(sharded, model, optim, sharded=True)
    cm.save_checkpoint(sharded, model, optim, sharded=True)
    files = sorted(os.listdir(sharded))
    failures = [_failure_on_one_rank(rank, 1, sharded, model, optim, True),
                _failure_on_one_rank(rank, 0, full, model, optim, False)]
    assert sorted(os.listdir(sharded)) == files
    restored, continued = {}, {}
    more = [x[rank:rank + 1] for x in batches(K, seed=8)]
    for path in (full, sharded):
        fresh, fresh_optim = build_sharded(reference(seed=5), "cuda", torch.float16, reuse=True, lr=0.5)
        cm.load_checkpoint(path, fresh, fresh_optim)
        restored[os.path.basename(path)] = (fresh.state_dict(), fresh_optim.state_dict())
        train(fresh, fresh_optim, more)
        continued[os.path.basename(path)] = fresh.state_dict()
    saved_model, saved_optimizer = model.state_dict(), optim.state_dict()
    train(model, optim, more)  # the run that never stopped
    return {"model": saved_model, "optimizer": saved_optimizer, "restored": restored, "files": files,
            "continued": continued, "straight": model.state_dict(),
            "failures": failures, "shard_numel": model.chunks[0].shard_numel, "numel": model.chunks[0].numel,
            "straddling": [s.name for c in model.chunks for s in c.slots
                           if s.offset < c.shard_numel < s.offset + s.numel]}


def _failure_on_one_rank(rank: int, failing: int, path: str, model, optim, sharded: bool) -> str:
    """Save with torch.save failing on rank ``failing``; the name of the error this rank raised (with
    ``(OSError)`` when it was raised from one: the failing rank's own error)."""
    real_save = torch.save

    def disk_full(*args, **kwargs):
        raise OSError("disk full")
    torch.save = disk_full if rank == failing else real_save
    try:
        cm.save_checkpoint(path, model, optim, sharded=sharded)
    except (OSError, cm.CheckpointError) as exc:
        return type(exc).__name__ + ("(OSError)" if isinstance(exc.__cause__, OSError) else "")
    finally:
        torch.save = real_save
    return "no error"


@pytest.mark.slow
def test_two_ranks_save_consolidate_and_load_into_one_process(tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tmp_path))
    expected = results[0]
    assert expected["shard_numel"] * 2 == expected["numel"] and expected["straddling"], "parameters on both ranks"
    assert len(expected["files"]) == 3 and "manifest.json" in expected["files"]
    # a rank that fails its part fails the save on every rank; the last checkpoint stays (loaded below)
    assert [r["failures"] for r in results] == [["CheckpointError", "CheckpointError(OSError)"],
                                                ["CheckpointError(OSError)", "CheckpointError"]]
    for result in results:
        assert_same_state(result["model"], expected["model"])
        for model_state, optimizer_state in result["restored"].values():
            assert_same_state(model_state, expected["model"])
            assert_same_optimizer_state(optimizer_state, expected["optimizer"])
        for state in result["continued"].values():  # resumed (under another placement) = trained straight
            assert_same_state(state, result["straight"])

    full = cm.consolidate_checkpoint(tmp_path / "full.pt")
    consolidated = cm.consolidate_checkpoint(tmp_path / "sharded")
    assert_same_state(full["model"], expected["model"])
    assert_same_state(consolidated["model"], full["model"])
    assert_same_optimizer_state(consolidated["optimizer"], full["optimizer"])

    one, one_optim = build_sharded(reference(seed=5), "cpu", torch.float16, reuse=True)
    cm.load_checkpoint(tmp_path / "full.pt", one, one_optim)
    assert_same_state(one.state_dict(), expected["model"])
    assert_same_optimizer_state(one_optim.state_dict(), expected["optimizer"])
    with pytest.raises(cm.InvalidArgumentError, match="saved by 2"):
        cm.load_checkpoint(tmp_path / "sharded", one, one_optim, elastic=False)
    resharded, resharded_optim = build_sharded(reference(seed=6), "cpu", torch.float16, reuse=True)
    cm.load_checkpoint(tmp_path / "sharded", resharded, resharded_optim)  # at 1 rank: test_elastic_checkpoint.py
    assert_same_state(resharded.state_dict(), expected["model"])
    assert_same_optimizer_state(resharded_optim.state_dict(), expected["optimizer"])
