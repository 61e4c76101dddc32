"""Sharded checkpoints of 8-bit Adam state in another layout (chunkmem.io.low_bit_resharding): consolidated, they
are the full checkpoint the same run saved, bit for bit; loaded at another world size or chunk size, training goes
on bit for bit as torchao's eager step on the unsharded model that never stopped; damaged or old files are refused
naming what is wrong, with nothing changed.

Saved on 2 ranks whose shard boundaries cut blocks of quantized parameters (test_low_bit_ranks.CHUNK_ELEMENTS), and
in one process (no block cut); loaded on 3 ranks (other cut blocks) and in one process with another chunk size."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import chunkmem as cm
from chunkmem.optim.blockwise import BLOCK_SIZE, quantizes
from chunkmem.optim.low_bit_param import CODES, PLAIN, SCALES
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from test_low_bit_ranks import CHUNK_ELEMENTS, _cut_blocks, _seeded_step, _train  # noqa: E402
from torchao_reference import eager_step  # noqa: E402

FIRST, THEN = batches(2, seed=20), batches(2, seed=21)  # before the save, after the load

# name -> (the optimizer over some parameters, the model's dtype)
CASES = {
    "adamw8bit": (lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, weight_decay=0.05), torch.float32),
    "adamw8bit-bf16-stochastic": (lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True),
                                  torch.bfloat16),
    "hybridadam-8bit": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.05, adamw_mode=False, state_dtype="8bit"),
                        torch.float32),
}
# the torchao optimizer that steps as HybridAdam's case does (torchao's cases: their own)
TORCHAO = {"hybridadam-8bit": lambda p: torchao_optim.Adam8bit(p, lr=1e-2, weight_decay=0.05)}


def _reference(dtype):
    torch.manual_seed(0)
    return TinyGPT(d=64).to(dtype)


def _wrapped(case, chunk_elements, **model_options):
    make, dtype = CASES[case]
    module = _reference(dtype)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=chunk_elements * dtype.itemsize, **model_options)
    return model, cm.ShardedOptimizerV2(model, make(module.parameters()))


def _save(case, directory, world, chunk_elements):
    """``case`` trained on FIRST, saved sharded (``directory``) and full (``directory`` + ``.pt``)."""
    model, optim = _wrapped(case, chunk_elements)
    _train(model, optim, FIRST)
    cm.save_checkpoint(directory, model, optim, sharded=True)
    cm.save_checkpoint(directory + ".pt", model, optim)
    return _cut_blocks(model)


def _save_worker(rank, world, directory):
    return {case: _save(case, os.path.join(directory, f"{case}-2"), world, CHUNK_ELEMENTS[world]) for case in CASES}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved on 2 ranks, and adamw8bit in one process (a chunk of every parameter: no block cut)."""
    directory = str(tmp_path_factory.mktemp("low-bit-checkpoints"))
    cuts = run_ranks(_save_worker, 2, directory)[0]
    assert all(count >= 1 for count in cuts.values()), cuts  # not vacuous: the boundaries cut blocks
    with _one_thread():
        _save("adamw8bit", os.path.join(directory, "adamw8bit-1"), 1, 1 << 17)
    return directory


class _one_thread:
    """As each rank computes (the matmuls' roundings depend on the threads)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


# ---- consolidation: the full checkpoint's bytes --------------------------------------------------------------


def _assert_identical(ours, theirs, where="checkpoint"):
    """The same structure, types, dtypes, shapes and bits (NaN and -0.0 included)."""
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (where, list(ours), list(theirs))
        for key in theirs:
            _assert_identical(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for n, (a, b) in enumerate(zip(ours, theirs)):
            _assert_identical(a, b, f"{where}[{n}]")
    elif isinstance(theirs, OptimState8bit):
        assert (ours.signed, ours.block_size, ours.dtype, ours.shape) == \
               (theirs.signed, theirs.block_size, theirs.dtype, theirs.shape), where
        for field in ("codes", "scale", "qmap"):
            _assert_identical(getattr(ours, field), getattr(theirs, field), f"{where}.{field}")
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)), where
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("case", [*CASES, "adamw8bit-1"])
def test_consolidated_equals_the_full_checkpoint_of_the_same_run(saved, case):
    directory = os.path.join(saved, case if case.endswith("-1") else f"{case}-2")
    full = torch.load(directory + ".pt", weights_only=False)
    consolidated = cm.consolidate_checkpoint(directory)
    _assert_identical(consolidated, {"model": full["model"], "optimizer": full["optimizer"]})
    entries = list(full["optimizer"]["state"].values())
    quantized = [e for e in entries if isinstance(e.get("exp_avg"), OptimState8bit) or CODES[0] in e]
    assert quantized and len(quantized) < len(entries)  # not vacuous: quantized and plain state both there


# ---- loading into another layout: training goes on as torchao's eager step that never stopped -------------------


def _torchao_reference(case, world):
    """torchao's eager step on the unsharded model over FIRST and THEN, each gradient what the run that saved
    (every rank the same data: its mean is each rank's gradient, exactly at 1 and 2 ranks) and the run that loaded
    (the ranks' mean as torch.distributed gives it, on ``world`` ranks) step with."""
    make, dtype = CASES[case]
    plain = _reference(dtype)
    make = TORCHAO.get(case, make)
    optimizer = make(plain.parameters())
    for n, x in enumerate(FIRST + THEN):
        lm_loss(plain(x), x).backward()
        if n >= len(FIRST) and world > 1:
            for p in plain.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        _seeded_step(lambda: eager_step(optimizer), n)
        optimizer.zero_grad()
    return plain, optimizer


def _moments(entry):
    """An entry's moments as tensors, whatever its form (torchao's OptimState8bit or HybridAdam's plain tensors)."""
    if CODES[0] in entry:
        return [entry[key] for key in CODES + SCALES]
    if isinstance(entry["exp_avg"], OptimState8bit):
        return [entry[key].codes for key in PLAIN] + [entry[key].scale for key in PLAIN]
    return [entry[key] for key in PLAIN]


def _differences(model, optim, plain, plain_optim):
    """What differs between the loaded run and torchao's: parameter names and optimizer state entries."""
    state = model.state_dict()
    differ = [key for key, p in plain.named_parameters() if not torch.equal(state[key], p.detach().float())]
    ours, theirs = optim.state_dict()["state"], plain_optim.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        pairs = zip(_moments(ours[index]), _moments(entry))
        if not torch.equal(ours[index]["step"], entry["step"]) or \
                not all(a.dtype == b.dtype and torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in pairs):
            differ.append(index)
    return differ


def _resume(case, directory, world, chunk_elements, **model_options):
    model, optim = _wrapped(case, chunk_elements, **model_options)
    _train(model, optim, batches(1, seed=30))  # other state: the load replaces all of it
    cm.load_checkpoint(directory, model, optim)
    _train(model, optim, THEN, first=len(FIRST))
    return {"cut": _cut_blocks(model), "differ": _differences(model, optim, *_torchao_reference(case, world))}


def _resume_worker(rank, world, directory):
    return {saved_on: _resume("adamw8bit", os.path.join(directory, f"adamw8bit-{saved_on}"), world,
                              CHUNK_ELEMENTS[world]) for saved_on in (1, 2)}


def test_saved_on_one_and_two_ranks_resumes_on_three_bit_for_bit(saved):
    for rank in run_ranks(_resume_worker, 3, saved):
        for saved_on, result in rank.items():
            assert result["cut"] >= 2 and result["differ"] == [], (saved_on, result)


@pytest.mark.parametrize("case,saved_on", [(case, 2) for case in CASES] + [("adamw8bit", 1)])
def test_resumes_in_one_process_with_another_chunk_size_bit_for_bit(saved, case, saved_on):
    """Saved on 2 ranks (another world size too), or in one process (the same world size)."""
    with _one_thread():
        result = _resume(case, os.path.join(saved, f"{case}-{saved_on}"), 1, 20000)
    assert result["differ"] == []


def test_resumes_in_one_process_with_the_codes_on_disk_bit_for_bit(saved, tmp_path):
    """The loading model keeps the codes on the disk tier (the scales and small moments in host memory)."""
    with _one_thread():
        result = _resume("adamw8bit", os.path.join(saved, "adamw8bit-2"), 1, 20000, offload_optimizer="disk",
                         nvme_path=str(tmp_path))
    assert result["differ"] == []


# ---- what is refused, with nothing changed -----------------------------------------------------------------------


def _rewritten(saved_dir, tmp_path, rank, change):
    """A copy of the sharded checkpoint ``saved_dir`` whose rank ``rank`` file ``change`` rewrote (its checksum
    recorded anew: a file that is well formed and consistent but for what ``change`` did)."""
    import json
    import shutil

    from chunkmem.storage.checksums import file_checksum

    directory = str(tmp_path / "changed")
    shutil.copytree(saved_dir, directory)
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    name = manifest["files"][rank]
    payload = torch.load(os.path.join(directory, name), weights_only=True)
    change(payload)
    torch.save(payload, os.path.join(directory, name))
    manifest["checksums"][name] = file_checksum(os.path.join(directory, name))
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return directory


def _damage_a_cut_blocks_scale(payload):
    """Rank 1's copy of the scale of a block that its shard's start cuts (the first scale its shard keeps)."""
    for entry in payload["model"]["chunks"]:
        start = entry["shard_offset"]
        if any(quantizes(s["numel"]) and s["offset"] < start < s["offset"] + s["numel"] and
               (start - s["offset"]) % BLOCK_SIZE for s in entry["slots"]):
            entry["state"]["exp_avg_sq_scales"][0] *= 2
            return
    raise AssertionError("no cut block at the start of rank 1's shards")


def _refused_by_load_and_consolidation(directory, match):
    """Both readers of a sharded checkpoint refuse ``directory`` with a :class:`~chunkmem.CheckpointError` matching
    ``match``, and loading it changes nothing."""
    _refused_with_nothing_changed(directory, cm.CheckpointError, match)
    with pytest.raises(cm.CheckpointError, match=match):
        cm.consolidate_checkpoint(directory)


def _refused_with_nothing_changed(directory, error, match):
    model, optim = _wrapped("adamw8bit", 20000)
    _train(model, optim, batches(1, seed=30))
    before, before_optim = copy.deepcopy(model.state_dict()), optim.state_dict()
    with pytest.raises(error, match=match):
        cm.load_checkpoint(directory, model, optim)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    ours, theirs = optim.state_dict()["state"], before_optim["state"]
    assert sorted(ours) == sorted(theirs)
    for index in theirs:
        assert torch.equal(ours[index]["step"], theirs[index]["step"]), index
        assert all(torch.equal(a, b) for a, b in zip(_moments(ours[index]), _moments(theirs[index]))), index


def test_a_cut_blocks_scales_that_differ_between_ranks_are_refused(saved, tmp_path):
    directory = _rewritten(os.path.join(saved, "adamw8bit-2"), tmp_path, 1, _damage_a_cut_blocks_scale)
    match = r"rank1-of-2\.pt: model\.chunks\[\d+\]\['state'\]: the scales of block \d+ of '.*', cut by a shard " \
            r"boundary, differ from those in .*rank0-of-2\.pt"
    _refused_by_load_and_consolidation(directory, match)


def test_a_family_of_the_wrong_dtype_is_refused_naming_it(saved, tmp_path):
    def change(payload):
        state = payload["model"]["chunks"][0]["state"]
        state["exp_avg_codes"] = state["exp_avg_codes"].float()
    directory = _rewritten(os.path.join(saved, "adamw8bit-2"), tmp_path, 0, change)
    match = r"rank0-of-2\.pt: model\.chunks\[0\]\['state'\]\['exp_avg_codes'\] is a torch\.float32 tensor of \d+ " \
            r"elements, expected a torch\.uint8 tensor"
    _refused_by_load_and_consolidation(directory, match)


def test_a_checkpoint_without_its_state_dicts_form_loads_but_does_not_consolidate(saved, tmp_path):
    """Saved before the form was recorded: which of torchao's or HybridAdam's state dict it had is unknown."""
    directory = _rewritten(os.path.join(saved, "adamw8bit-2"), tmp_path, 0,
                           lambda payload: payload["optimizer"].pop("state_dict_form"))
    with pytest.raises(cm.InvalidArgumentError, match=r"state_dict_form: one of \['plain-8bit', 'torchao-8bit'\]; "
                                                      r"found None"):
        cm.consolidate_checkpoint(directory)
    with _one_thread():
        result = _resume("adamw8bit", directory, 1, 20000)
    assert result["differ"] == []


# ---- shards smaller than a block ------------------------------------------------------------------------------


def _shard_state(whole, slots, start, end):
    """A rank's families of the shard [start, end) of a chunk of ``slots`` ((name, offset, numel)), written here
    from the guide's description, not by chunkmem's layout: the codes by element (padding 0), the scale of every
    block of a quantized parameter the shard touches, the plain moments of its elements of the others."""
    state = {"exp_avg_codes": torch.zeros(end - start, dtype=torch.uint8)}
    scales, plain = [], []
    for name, offset, numel in slots:
        a, b = max(start, offset) - offset, min(end, offset + numel) - offset
        if a >= b:
            continue
        if quantizes(numel):
            state["exp_avg_codes"][offset + a - start:offset + b - start] = whole[name][0][a:b]
            scales.append(whole[name][1][a // BLOCK_SIZE:-(-b // BLOCK_SIZE)])
        else:
            plain.append(whole[name][a:b])
    state["exp_avg_sq_codes"] = state["exp_avg_codes"] + 1
    state["exp_avg_scales"] = torch.cat(scales) if scales else torch.zeros(1)
    state["exp_avg_sq_scales"] = state["exp_avg_scales"] * 3
    state["exp_avg_fp32"] = torch.cat(plain) if plain else torch.zeros(1)
    state["exp_avg_sq_fp32"] = state["exp_avg_fp32"] * 5
    return state


def test_blocks_cut_by_several_shard_boundaries_are_read_whole():
    """40 shards of 230 elements: some blocks lie under two boundaries (a rank holds a part inside one block), every
    rank keeps a copy of their scales; a second chunk is whole on every rank (persistent parameters)."""
    from chunkmem.io.low_bit_resharding import SavedLowBitState
    from chunkmem.io.saved_shards import SavedLayout

    g = torch.Generator().manual_seed(0)
    sizes = {"a": 4096, "b": 100, "c": 4352, "d": 512}  # d: in whole blocks but under 4096 elements: plain
    whole = {name: (torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g), torch.rand(n // BLOCK_SIZE,
                                                                                          generator=g))
             if quantizes(n) else torch.randn(n, generator=g) for name, n in sizes.items()}
    slots, offset = [], 0
    for name, numel in sizes.items():
        slots.append((name, offset, numel))
        offset += numel
    world, shard = 40, -(-offset // 40)
    table = [{"name": name, "offset": o, "numel": n, "shape": [n]} for name, o, n in slots]
    parts = []
    for rank in range(world):
        chunk = {"numel": shard * world, "dtype": "float32", "trainable": True, "slots": table,
                 "shard_offset": rank * shard, "shard_numel": shard,
                 "state": _shard_state(whole, slots, rank * shard, (rank + 1) * shard)}
        replicated = {"numel": 4096, "dtype": "float32", "trainable": True, "shard_offset": 0, "shard_numel": 4096,
                      "slots": [{"name": "e", "offset": 0, "numel": 4096, "shape": [4096]}],
                      "state": _shard_state(whole | {"e": whole["a"]}, [("e", 0, 4096)], 0, 4096)}
        parts.append({"model": {"chunks": [chunk, replicated]}})
    assert shard < BLOCK_SIZE
    reader = SavedLowBitState(SavedLayout(parts, [f"rank{r}.pt" for r in range(world)]))
    reader.check()
    for name in [*sizes, "e"]:
        m, v = reader.moments(name)
        expected = whole["a" if name == "e" else name]
        if quantizes(sizes.get(name, 4096)):
            assert torch.equal(m[0], expected[0]) and torch.equal(m[1], expected[1]), name
            assert torch.equal(v[0], expected[0] + 1) and torch.equal(v[1], expected[1] * 3), name
        else:
            assert torch.equal(m, expected) and torch.equal(v, expected * 5), name
