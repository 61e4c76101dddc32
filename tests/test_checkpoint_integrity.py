"""Checkpoint integrity and all-or-nothing loads: checksums of every checkpoint file, named fields,
values checked before anything is written, autograd versions bumped by a load, stale temporary files.

The references: plain PyTorch in the same situation (a load between forward and backward), the
state as it was before a refused load (compared byte for byte, chunk buffers included), and
SHA-256 computed here by hashlib over the files' bytes.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re

import pytest
import torch

import chunkmem as cm
from chunkmem.storage.checksums import content_checksum
from models import batches, build_sharded, lm_loss, train
from test_checkpoint import assert_same_optimizer_state, assert_same_state, reference

FULL, SHARDED = "full", "sharded"


def snapshot(model, optim) -> dict:
    """Everything a load may write, as copies: each chunk's parameter shard, fp32 master, moments and
    step, the module buffers, the param groups and the loss scaler."""
    chunks = []
    for chunk in model.chunks:
        families = {name: buf.tensor.clone() for name, buf in chunk.optim.items() if buf.allocated}
        chunks.append((chunk.param.local().clone(), families, dict(chunk.steps)))
    buffers = {k: v.clone() for k, v in model.module.named_buffers()}
    scaler = optim.grad_scaler.state_dict() if optim.grad_scaler is not None else None
    groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optim.param_groups]
    return {"chunks": chunks, "buffers": buffers, "groups": groups, "scaler": scaler,
            "versions": [p._version for p in model.parameters()]}


def assert_unchanged(before: dict, after: dict) -> None:
    assert len(before["chunks"]) == len(after["chunks"])
    for n, ((param, families, step), (param2, families2, step2)) in enumerate(zip(before["chunks"], after["chunks"])):
        assert param.dtype == param2.dtype and torch.equal(param.view(torch.uint8), param2.view(torch.uint8)), n
        assert sorted(families) == sorted(families2) and step == step2, n
        for name, value in families.items():
            assert torch.equal(value.view(torch.uint8), families2[name].view(torch.uint8)), (n, name)
    assert sorted(before["buffers"]) == sorted(after["buffers"])
    for key, value in before["buffers"].items():
        assert torch.equal(value, after["buffers"][key]), key
    assert before["groups"] == after["groups"] and before["scaler"] == after["scaler"]
    assert before["versions"] == after["versions"]


def trained(dtype=torch.float16):
    model, optim = build_sharded(reference(), "cpu", dtype)
    train(model, optim, batches(2, seed=21))
    return model, optim


def saved(tmp_path, kind: str, model, optim) -> str:
    path = str(tmp_path / ("ckpt.pt" if kind == FULL else "ckpt"))
    cm.save_checkpoint(path, model, optim, sharded=kind == SHARDED)
    return path


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def rank_file(path: str) -> str:
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    return os.path.join(path, manifest["files"][0])


def reseal(path: str) -> None:
    """Record the current bytes of every rank file in the manifest (so that an edit made on purpose
    passes the checksum and reaches the later checks)."""
    name = os.path.join(path, "manifest.json")
    manifest = json.loads(open(name).read())
    manifest["checksums"] = {f: sha256_of(os.path.join(path, f)) for f in manifest["files"]}
    open(name, "w").write(json.dumps(manifest))


def edit_rank_file(path: str, edit) -> None:
    name = rank_file(path)
    payload = torch.load(name, weights_only=True)
    edit(payload)
    torch.save(payload, name)
    reseal(path)


def edit_full_file(path: str, edit) -> None:
    payload = torch.load(path, weights_only=True)
    edit(payload)
    payload.pop("checksum")
    payload["checksum"] = content_checksum(payload)
    torch.save(payload, path)


# ---- item 6: a load between a forward and its backward -------------------------------------------


def plain_backward_after_load(x, source) -> str:
    plain = reference()
    loss = lm_loss(plain(x), x)
    plain.load_state_dict(source)
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("how", ["load_state_dict", FULL, SHARDED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_backward_of_a_forward_before_a_load_raises_like_plain_pytorch(tmp_path, dtype, how):
    data = batches(3, seed=22)
    source = reference(seed=4).state_dict()
    plain_error = plain_backward_after_load(data[0], source)
    assert "modified by an inplace operation" in plain_error

    loaded, loaded_optim = build_sharded(reference(), "cpu", dtype)  # loads before any forward
    loaded.load_state_dict(source)
    path = saved(tmp_path, how, loaded, loaded_optim) if how != "load_state_dict" else None

    model, optim = build_sharded(reference(), "cpu", dtype)
    loss = lm_loss(model(data[0]), data[0])
    if path is None:
        model.load_state_dict(source)
    else:
        cm.load_checkpoint(path, model, optim)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        optim.backward(loss)
    optim.zero_grad()
    # a fresh forward after the load trains exactly as the model that loaded before any forward
    assert train(model, optim, data) == train(loaded, loaded_optim, data)
    assert_same_state(model.state_dict(), loaded.state_dict())
    assert_same_optimizer_state(optim.state_dict(), loaded_optim.state_dict())


def test_fresh_forward_after_a_load_trains_like_plain_pytorch():
    data = batches(3, seed=23)
    source = reference(seed=4).state_dict()
    plain = reference()
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    model, optim = build_sharded(reference(), "cpu", torch.float32)
    for net, backward in ((plain, lambda loss: loss.backward()), (model, optim.backward)):
        loss = lm_loss(net(data[0]), data[0])
        net.load_state_dict(source)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            backward(loss)
    plain_optim.zero_grad()
    optim.zero_grad()
    for x in data:
        lm_loss(plain(x), x).backward()
        plain_optim.step()
        plain_optim.zero_grad()
    train(model, optim, data)
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())


def test_load_while_a_backward_is_unfinished_is_refused_clearly():
    model, optim = trained(torch.float32)
    x = batches(1, seed=24)[0]
    loss = lm_loss(model(x), x)
    model.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()  # dies part-way: some chunks stay held for that backward
    before = snapshot(model, optim)
    with pytest.raises(cm.CheckpointError, match="load_state_dict: .*backward that started and did not finish"):
        model.load_state_dict(reference(seed=4).state_dict())
    assert_unchanged(before, snapshot(model, optim))
    optim.zero_grad()
    train(model, optim, [x])  # a complete iteration ends it
    model.load_state_dict(reference(seed=4).state_dict())
    assert_same_state(model.state_dict(), reference(seed=4).state_dict())


def test_load_after_the_optimizers_backward_raised_loads():
    """The optimizer's backward releases what a failed backward held (issue #20, item 11): a load right
    after it needs no complete iteration first."""
    model, optim = trained(torch.float32)
    x = batches(1, seed=24)[0]
    loss = lm_loss(model(x), x)
    model.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="inplace"):
        optim.backward(loss)
    model.load_state_dict(reference(seed=4).state_dict())
    assert_same_state(model.state_dict(), reference(seed=4).state_dict())


# ---- item 7: checksums ---------------------------------------------------------------------------


def flip(path: str, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x01]))


def test_files_record_sha256_checksums(tmp_path):
    model, optim = trained()
    full = saved(tmp_path, FULL, model, optim)
    payload = torch.load(full, weights_only=True)
    assert payload["format"] == "chunkmem.checkpoint.full/2"
    assert payload["checksum"] == content_checksum({k: payload[k] for k in ("format", "model", "optimizer")})
    sharded = saved(tmp_path, SHARDED, model, optim)
    manifest = json.loads(open(os.path.join(sharded, "manifest.json")).read())
    assert manifest["format"] == "chunkmem.checkpoint.sharded/2"
    assert manifest["checksums"] == {name: sha256_of(os.path.join(sharded, name)) for name in manifest["files"]}


def test_content_checksum_sees_every_part():
    base = {"a": torch.arange(4, dtype=torch.float32), "b": [1, 2.0, None, "x"], "c": (True,)}
    variants = [{**base, "a": torch.arange(4, dtype=torch.float64)}, {**base, "a": torch.arange(4.0).view(2, 2)},
                {**base, "b": [1, 2, None, "x"]}, {**base, "c": [True]}, {"b": base["b"], "a": base["a"], "c": (True,)},
                {**base, "a": torch.tensor([0.0, 1.0, 2.0, 3.0000002])}]
    checksum = content_checksum(base)
    assert checksum == content_checksum(copy.deepcopy(base)) and checksum.startswith("sha256:")
    assert len({checksum, *(content_checksum(v) for v in variants)}) == len(variants) + 1


def tensor_position(path: str, tensor: torch.Tensor) -> int:
    position = open(path, "rb").read().find(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert position > 0
    return position


@pytest.mark.parametrize("kind", [FULL, SHARDED])
def test_one_flipped_byte_of_tensor_data_raises_and_changes_nothing(tmp_path, kind):
    model, optim = trained()
    path = saved(tmp_path, kind, model, optim)
    target = path if kind == FULL else rank_file(path)
    value = (model.state_dict()["blocks.1.fc2.weight"] if kind == FULL
             else torch.load(target, weights_only=True)["model"]["chunks"][-1]["master"])
    flip(target, tensor_position(target, value) + 7)
    fresh, fresh_optim = build_sharded(reference(seed=3), "cpu", torch.float16)
    before = snapshot(fresh, fresh_optim)
    name = os.path.basename(target)
    with pytest.raises(cm.CheckpointError, match=f"{name}: the .*damaged: its.* checksum is sha256:"):
        cm.load_checkpoint(path, fresh, fresh_optim)
    assert_unchanged(before, snapshot(fresh, fresh_optim))
    with pytest.raises(cm.CheckpointError, match=f"{name}: the .*damaged"):
        cm.consolidate_checkpoint(path)


@pytest.mark.parametrize("which", ["full file", "rank file", "manifest"])
def test_any_flipped_byte_raises_or_loads_exactly_what_was_saved(tmp_path, which):
    """Every sampled byte: the load raises a chunkmem error and changes nothing, or (a byte torch.load
    does not read, e.g. zip padding) it loads exactly the saved state; never other values."""
    model, optim = trained()
    path = saved(tmp_path, FULL if which == "full file" else SHARDED, model, optim)
    target = {"full file": path, "manifest": os.path.join(path, "manifest.json")}.get(which) or rank_file(path)
    expected, expected_optim = model.state_dict(), optim.state_dict()
    original = open(target, "rb").read()
    fresh, fresh_optim = build_sharded(reference(seed=3), "cpu", torch.float16)
    before = snapshot(fresh, fresh_optim)
    step = 3 if which == "manifest" else max(1, len(original) // 40)
    raised = 0
    for position in range(0, len(original), step):
        open(target, "wb").write(original)
        flip(target, position)
        try:
            cm.load_checkpoint(path, fresh, fresh_optim)
        except cm.ChunkmemError:
            raised += 1
            assert_unchanged(before, snapshot(fresh, fresh_optim))
            continue
        assert_same_state(fresh.state_dict(), expected)
        assert_same_optimizer_state(fresh_optim.state_dict(), expected_optim)
        fresh, fresh_optim = build_sharded(reference(seed=3), "cpu", torch.float16)
        before = snapshot(fresh, fresh_optim)
    assert raised > (0.9 if which == "manifest" else 0.5) * len(range(0, len(original), step))


def test_format_1_checkpoints_without_checksums_still_load(tmp_path):
    model, optim = trained()
    expected, expected_optim = model.state_dict(), optim.state_dict()
    full = saved(tmp_path, FULL, model, optim)
    payload = torch.load(full, weights_only=True)
    del payload["checksum"]
    torch.save({**payload, "format": "chunkmem.checkpoint.full/1"}, full)
    sharded = saved(tmp_path, SHARDED, model, optim)
    edit_rank_file(sharded, lambda p: p.update(format="chunkmem.checkpoint.sharded/1"))
    name = os.path.join(sharded, "manifest.json")
    manifest = json.loads(open(name).read())
    del manifest["checksums"]
    open(name, "w").write(json.dumps({**manifest, "format": "chunkmem.checkpoint.sharded/1"}))
    for path in (full, sharded):
        fresh, fresh_optim = build_sharded(reference(seed=3), "cpu", torch.float16)
        cm.load_checkpoint(path, fresh, fresh_optim)
        assert_same_state(fresh.state_dict(), expected)
        assert_same_optimizer_state(fresh_optim.state_dict(), expected_optim)
        assert_same_state(cm.consolidate_checkpoint(path)["model"], expected)
    # a format 2 file must carry its checksum
    torch.save({**payload, "format": "chunkmem.checkpoint.full/2"}, full)
    with pytest.raises(cm.CheckpointError, match="ckpt.pt: field 'checksum' is missing"):
        cm.load_checkpoint(full, model, optim)


# ---- item 13: fields of the manifest and of the rank files ---------------------------------------


@pytest.mark.parametrize("field", ["token", "world", "files", "checksums"])
def test_manifest_without_a_field_names_the_file_and_the_field(tmp_path, field):
    model, optim = trained()
    path = saved(tmp_path, SHARDED, model, optim)
    name = os.path.join(path, "manifest.json")
    manifest = json.loads(open(name).read())
    before = snapshot(model, optim)
    wrong_type = {"token": 12, "world": "1", "files": "x", "checksums": ["a"]}[field]
    for broken, problem in (({k: v for k, v in manifest.items() if k != field}, "is missing"),
                            ({**manifest, field: wrong_type}, f"is a {type(wrong_type).__name__}, expected")):
        open(name, "w").write(json.dumps(broken))
        for load in (lambda: cm.load_checkpoint(path, model, optim), lambda: cm.consolidate_checkpoint(path)):
            with pytest.raises(cm.CheckpointError, match=f"manifest.json: field '{field}' {problem}"):
                load()
        assert_unchanged(before, snapshot(model, optim))


@pytest.mark.parametrize("field,edit", [
    ("model", lambda p: p.pop("model")),
    ("model.chunks", lambda p: p["model"].pop("chunks")),
    ("model.chunks[1].step", lambda p: p["model"]["chunks"][1].pop("step")),
    ("model.chunks[1].exp_avg", lambda p: p["model"]["chunks"][1].update(exp_avg="zeros")),
    ("model.chunks[0].slots[2].offset", lambda p: p["model"]["chunks"][0]["slots"][2].pop("offset")),
    ("model.buffers", lambda p: p["model"].pop("buffers")),
    ("optimizer.loss_scaler", lambda p: p["optimizer"].pop("loss_scaler")),
])
def test_rank_file_without_a_field_names_the_file_and_the_field(tmp_path, field, edit):
    model, optim = trained()
    path = saved(tmp_path, SHARDED, model, optim)
    edit_rank_file(path, edit)
    fresh, fresh_optim = build_sharded(reference(seed=3), "cpu", torch.float16)
    before = snapshot(fresh, fresh_optim)
    pattern = re.escape(f"{os.path.basename(rank_file(path))}: field '{field}' is")
    with pytest.raises(cm.CheckpointError, match=pattern):
        cm.load_checkpoint(path, fresh, fresh_optim)
    assert_unchanged(before, snapshot(fresh, fresh_optim))


# ---- item 10: values that pass the shape checks but could not be written -------------------------


@pytest.mark.parametrize("key,value,match", [
    ("ln_f.bias", torch.empty(32, device="meta"), "meta device"),
    ("ln_f.bias", torch.zeros(32, dtype=torch.complex64), "floating-point"),
    ("ln_f.bias", torch.zeros(32, dtype=torch.int32), "floating-point"),
    ("ln_f.bias", torch.zeros(32).to_sparse(), "dense"),
    ("calls", torch.empty(3, device="meta"), "meta device"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_model_load_checks_every_value_before_writing(dtype, key, value, match):
    model, optim = trained(dtype)
    source = reference(seed=4).state_dict()  # every key before the bad one would be written first
    source[key] = value
    before = snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError, match=rf"state_dict\['{key}'\].*{match}"):
        model.load_state_dict(source)
    assert_unchanged(before, snapshot(model, optim))


def last_index_state(state: dict) -> dict:
    return state["state"][max(state["state"])]


@pytest.mark.parametrize("edit,match", [
    (lambda s: last_index_state(s).update(exp_avg=torch.empty_like(last_index_state(s)["exp_avg"], device="meta")),
     r"\['exp_avg'\].*meta device"),
    (lambda s: last_index_state(s).update(exp_avg_sq=last_index_state(s)["exp_avg_sq"].to(torch.complex64)),
     r"\['exp_avg_sq'\].*floating-point"),
    (lambda s: last_index_state(s).update(step=torch.empty((), device="meta")), r"\['step'\].*meta device"),
    (lambda s: s["loss_scaler"].update(scale=float("nan")), r"\['loss_scaler'\]\['scale'\]=nan.*finite number > 0"),
    (lambda s: s["loss_scaler"].update(scale=float("inf")), r"\['scale'\]=inf.*finite number > 0"),
    (lambda s: s["loss_scaler"].update(scale=-4.0), r"\['scale'\]=-4.0.*finite number > 0"),
    (lambda s: s["loss_scaler"].update(scale=0), r"\['scale'\]=0 .*finite number > 0"),
    (lambda s: s["loss_scaler"].update(scale="1024"), r"\['scale'\]='1024'.*finite number > 0"),
    (lambda s: s["loss_scaler"].update(clean_steps=-1), r"\['clean_steps'\]=-1.*integer >= 0"),
    (lambda s: s["loss_scaler"].update(overflows_since_growth=1.5), r"\['overflows_since_growth'\]=1.5.*integer"),
])
def test_optimizer_load_checks_every_value_before_writing(edit, match):
    model, optim = trained()
    state = reference_optimizer_state()
    edit(state)
    before = snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError, match=match):
        optim.load_state_dict(state)
    assert_unchanged(before, snapshot(model, optim))


def reference_optimizer_state() -> dict:
    """Another run's optimizer state (other moments, steps and scale than ``trained()``'s)."""
    model, optim = build_sharded(reference(seed=2), "cpu", torch.float16, initial_scale=2**6)
    train(model, optim, batches(3, seed=25))
    return optim.state_dict()


def test_full_checkpoint_with_an_impossible_loss_scale_changes_nothing(tmp_path):
    other, other_optim = build_sharded(reference(seed=2), "cpu", torch.float16)
    train(other, other_optim, batches(1, seed=26))
    path = saved(tmp_path, FULL, other, other_optim)
    edit_full_file(path, lambda p: p["optimizer"]["loss_scaler"].update(scale=float("nan")))
    model, optim = trained()
    before = snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError, match=r"\['loss_scaler'\]\['scale'\]=nan"):
        cm.load_checkpoint(path, model, optim)
    assert_unchanged(before, snapshot(model, optim))


@pytest.mark.parametrize("field,edit,match", [
    ("model.chunks[-1]['exp_avg']", lambda c: c.update(exp_avg=c["exp_avg"][:5]), "5 elements"),
    ("model.chunks[-1]['master']", lambda c: c.update(master=c["master"].to(torch.int32)), "floating-point"),
    ("model.chunks[-1]['param']", lambda c: c.update(param=torch.empty_like(c["param"], device="meta")), "meta"),
    ("model.chunks[-1]['step']", lambda c: c.update(step=-2), "integer >= 0"),
])
def test_sharded_load_of_a_damaged_rank_file_changes_nothing(tmp_path, field, edit, match):
    other, other_optim = build_sharded(reference(seed=2), "cpu", torch.float16)
    train(other, other_optim, batches(1, seed=27))
    path = saved(tmp_path, SHARDED, other, other_optim)
    last = len(other.chunks) - 1
    edit_rank_file(path, lambda p: edit(p["model"]["chunks"][-1]))  # consistent checksum: only the values are bad
    model, optim = trained()
    before = snapshot(model, optim)
    where = re.escape(f"{os.path.basename(rank_file(path))}: {field.replace('[-1]', f'[{last}]')}")
    with pytest.raises(cm.InvalidArgumentError, match=f"{where}.*{match}"):
        cm.load_checkpoint(path, model, optim)
    assert_unchanged(before, snapshot(model, optim))


# ---- item 17: temporaries of killed saves --------------------------------------------------------


def test_full_save_removes_its_own_stale_temporaries_only(tmp_path):
    model, optim = trained()
    mine = [".ckpt.pt.0a1b2c3d4e5f.tmp", ".ckpt.pt.ff.tmp"]
    others = [".other.pt.0a1b2c3d4e5f.tmp", "ckpt.pt.0a1b2c.tmp", ".ckpt.pt.xyz.tmp", ".ckpt.pt.0a1b.tmp.keep",
              ".ckpt.pt.tmp", "notes.txt", ".ckpt.pt.ab.cd.tmp"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"partial")
    saved(tmp_path, FULL, model, optim)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt"] + others)
    assert all((tmp_path / name).read_bytes() == b"partial" for name in others)
