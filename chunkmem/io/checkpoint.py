"""Checkpoint files: save a model (and its optimizer) and load them back, atomically.

Two formats:

* **full** (``sharded=False``): one file, written by rank 0 of the model's data-parallel group with
  ``torch.save``: ``{"format": "chunkmem.checkpoint.full/2", "model": model.state_dict(),
  "optimizer": optimizer.state_dict() or None, "checksum": "sha256:<hex>"}``, the checksum being
  :func:`~chunkmem.storage.checksums.content_checksum` of the dict without it. Every rank calls the save (the
  state dicts gather the shards). It loads at any world size, under any placement policy, and its two
  dicts load into a plain module and ``torch.optim.AdamW``. Version 1 files (no checksum) still load.
* **sharded** (``sharded=True``): a directory in which every rank writes only what it holds, with no
  gather: ``shard-{token}-rank{r}-of-{N}.pt`` has, per chunk, this rank's parameter shard (chunk dtype),
  fp32 master / exp_avg / exp_avg_sq shards and step (another optimizer: ``"state"``, its per-element
  families' shards by key, ``"slot_scalars"``, each stepped parameter's scalar state, and ``"whole"``, its
  whole-parameter state, both by position in the chunk; files written before 2026-11-27 hold ``"scalars"``,
  one per param group, instead, and still load), with the layout (world size, rank, chunk numel and
  dtype, per parameter its name, offset and numel in elements, shape), plus the module buffers, the
  optimizer's param groups and the loss-scaler state. ``manifest.json`` names the token of the last
  complete save and holds the SHA-256 checksum of every rank file's bytes. At the world size and
  layout that saved it each rank reads its own file; at any other world size (or chunk size) each rank
  reads, memory-mapped, the byte ranges of its new shards from the files that hold them
  (:mod:`chunkmem.io.resharding`). :func:`consolidate_checkpoint` turns it into the full state dicts
  offline. Version 1 directories (no checksums) still load.

Integrity: every load verifies the checksums (:class:`CheckpointError` naming the file when one
differs) and every field it reads (present, of the right type and size), then writes nothing until all
of it is checked, so a damaged or inconsistent checkpoint changes nothing.

Atomicity: every file is written to a temporary file in its directory, flushed, fsynced and renamed
over its name (``os.replace``). A sharded save writes the rank files under a fresh token, waits for
every rank, then rank 0 replaces the manifest (the commit point) and removes the files of older tokens.
A save that dies part-way leaves the previous checkpoint loadable; the next
successful save removes the temporary files it left (only names of chunkmem's temporary pattern). Ranks agree on success after each
phase (an all-reduce of a flag, which is also the barrier), so a failing rank fails the save on every
rank. Collectives run only when ``torch.distributed`` is initialised and the group has several ranks.
A write that fails with a system error (a full disk) raises :class:`CheckpointError` naming the
checkpoint, the file and the cause, chained from the ``OSError``.
Sharded checkpoints need a directory every rank sees (a shared file system).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..storage.atomic_file import remove_stale_temporaries, temporary_target, write_atomically, write_json_atomically
from ..storage.checksums import HashingWriter, content_checksum, file_checksum
from ..core.chunk import MASTER
from ..distributed.collectives import SINGLE_PROCESS, ShardGroup, all_reduce_over, distributed_ready
from ..errors import ArgumentTypeError, InvalidArgumentError, check_type
from ..core.param_guard import slot_of
from ..model.sharded_model import ShardedModelV2
from ..optim.sharded_optimizer import ShardedOptimizerV2
from ..errors import ChunkmemError, CheckpointError
from .low_bit_resharding import consolidated_state, holds_low_bit_state
from .resharding import plan_resharded_load
from .saved_shards import SavedLayout, entry_fits_rule, saved_slot_scalars, saved_slot_steps, saved_state
from ..optim.state_dict import (adam_entry, any_entry, export_param_groups, prepare_hyper_load, prepare_optimizer_load,
                                scalar_copy)
from ..state_dicts import (bump_versions, check_tensor_data, first_few, plan_model_load, refuse_chunks_in_use,
                           refuse_grads_in_param_memory, warn_if_masters_lose_precision)

FULL_FORMAT = "chunkmem.checkpoint.full/2"
"""The ``"format"`` of a full checkpoint file this version writes (with a ``"checksum"``)."""
FULL_FORMAT_V1 = "chunkmem.checkpoint.full/1"
"""The full format before checksums; still loaded."""
SHARDED_FORMAT = "chunkmem.checkpoint.sharded/2"
"""The ``"format"`` of a sharded checkpoint's manifest and rank files this version writes (the
manifest has the rank files' checksums)."""
SHARDED_FORMAT_V1 = "chunkmem.checkpoint.sharded/1"
"""The sharded format before checksums; still loaded."""
MANIFEST = "manifest.json"
"""The file of a sharded checkpoint directory that names its committed token (JSON: format, token,
world, files, and ``checksums``: each file's ``"sha256:<hex>"`` under its name)."""
_SHARD_FILE = re.compile(r"^shard-(?P<token>[0-9a-f]+)-rank(?P<rank>\d+)-of-(?P<world>\d+)\.pt$")
_TOKEN = re.compile(r"^[0-9a-f]+$")

__all__ = ["CheckpointError", "consolidate_checkpoint", "load_checkpoint", "save_checkpoint"]


# ---- the API -------------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None = None,
                    *, sharded: bool = False) -> None:
    """Save ``model`` (and ``optimizer``) to ``path``: a file (full format) or, with ``sharded=True``, a
    directory (created if needed) of per-rank files and a manifest. Every rank of the model's group
    must call it. Atomic: a save that fails or is killed leaves the previous checkpoint at ``path``.

    Refused (:class:`CheckpointError`) between a backward and the step with ``reuse_fp16_shard``,
    while the parameters' memory holds gradients instead of values. Both formats hold any optimizer's
    state (:mod:`chunkmem.optim.any_optimizer`).

    With a :class:`~chunkmem.LowLevelZeroOptimizer`, ``model`` is the plain module it trains (any other
    module is refused, naming ``model``) and only the full format is written (``sharded=False``); its ``"model"`` holds the fp32 masters, so it loads
    into a ShardedModelV2 + ShardedOptimizerV2, a plain module + ``torch.optim.AdamW`` and back.
    """
    if _is_low_level_zero(optimizer):
        _save_low_level_zero(_check_low_level_zero_args(path, model, optimizer, sharded), model, optimizer)
        return
    path = _check_save_args(path, model, optimizer, sharded)
    refuse_grads_in_param_memory(model, "save_checkpoint")
    if sharded:
        _save_sharded(path, model, optimizer)
    else:
        _save_full(path, model, optimizer)


def load_checkpoint(path: str | os.PathLike, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None = None,
                    *, elastic: bool = True, model_only: bool = False) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``, which
    needs a checkpoint saved with one). The format is read from ``path``: a file is a full checkpoint,
    a directory a sharded one; both load at any world size, chunk size and placement policy, every fp32
    master and optimizer moment bit for bit. A sharded checkpoint of another world size or chunk
    layout is resharded as it loads (:mod:`chunkmem.io.resharding`: each rank reads only the byte
    ranges of its new shards); ``elastic=False`` (DeepSpeed's ``elastic_checkpoint: false``) refuses it
    instead. Everything is read and checked before anything changes; ranks agree before writing, so
    every rank must call it. Build the optimizer before loading a 16-bit model, so that the fp32
    masters are restored exactly. Refused (:class:`CheckpointError`) while the parameters' memory
    holds gradients (``reuse_fp16_shard`` between backward and step) and while a forward runs or a
    backward started and did not finish. A file whose checksum or fields are wrong raises
    :class:`CheckpointError` naming it. Like ``param.copy_`` in plain PyTorch, the load marks the
    parameters modified: a backward of a forward run before it raises. With a
    :class:`~chunkmem.LowLevelZeroOptimizer` (required then), ``model`` is the plain module it trains (any
    other module is refused, naming ``model``) and ``path`` a full checkpoint file; ``model_only`` loads the
    module's values (and the optimizer's fp32 masters, which are its values) and leaves the optimizer's state
    (with a ``ShardedOptimizerV2``, pass ``optimizer=None`` for that).
    """
    check_type("model_only", model_only, bool, "True or False")
    if _is_low_level_zero(optimizer):
        path = _check_low_level_zero_args(_check_existing_path(path), model, optimizer, False)
        error, apply = None, None
        try:
            apply = _prepare_low_level_zero(path, model, optimizer, model_only)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = exc
        _agree(optimizer.shards, error, f"loading {path!r}")
        apply()
        return
    path = _check_load_args(path, model, optimizer)
    check_type("elastic", elastic, bool, "True or False")
    refuse_grads_in_param_memory(model, "load_checkpoint")
    refuse_chunks_in_use(model, "load_checkpoint")
    error: Exception | None = None
    apply: Callable[[], None] | None = None
    try:
        apply = _prepare_sharded(path, model, optimizer, elastic) if os.path.isdir(path) else _prepare_full(path, model, optimizer)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
        error = exc
    _agree(model.data_parallel, error, f"loading {path!r}")
    apply()


def consolidate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The full state dicts of a checkpoint: ``{"model": state dict, "optimizer": optimizer state dict
    or None}``, equal to what ``model.state_dict()`` and ``optimizer.state_dict()`` gave when it was
    saved. A sharded directory is assembled from all rank files (offline: no process group needed);
    a full file is just read. An 8-bit Adam's state comes out in its ``state_dict()``'s form, as a full
    checkpoint of it holds it (torchao's ``OptimState8bit``, which needs torchao, or ``HybridAdam``'s plain
    tensors: :mod:`chunkmem.io.low_bit_resharding`).
    """
    path = _check_existing_path(path)
    if not os.path.isdir(path):
        payload = _read_full(path)
        return {"model": payload["model"], "optimizer": payload["optimizer"]}
    manifest = _read_manifest(path)
    parts = [_read_rank_file(path, manifest, rank) for rank in range(manifest["world"])]
    files = [os.path.join(path, _shard_name(manifest["token"], rank, manifest["world"]))
             for rank in range(manifest["world"])]
    return _consolidate(path, parts, files)


# ---- arguments -----------------------------------------------------------------------------------


def _check_path(path: Any) -> str:
    check_type("path", path, (str, os.PathLike), "a file or directory path (str or os.PathLike)")
    return os.path.abspath(os.fspath(path))


def _check_existing_path(path: Any) -> str:
    path = _check_path(path)
    if not os.path.exists(path):
        raise InvalidArgumentError("path", path, "an existing checkpoint file or directory (nothing is there)")
    return path


def _check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, ShardedModelV2):
        raise ArgumentTypeError("model", type(model).__name__, "a chunkmem.ShardedModelV2")
    if optimizer is not None:
        if not isinstance(optimizer, ShardedOptimizerV2):
            raise ArgumentTypeError("optimizer", type(optimizer).__name__, "None or a chunkmem.ShardedOptimizerV2")
        if optimizer.model is not model:
            raise InvalidArgumentError("optimizer", "a ShardedOptimizerV2 of another model",
                                       "None or the ShardedOptimizerV2 built over this model")
        optimizer.check_no_step_in_flight("a checkpoint")


def _check_save_args(path: Any, model: Any, optimizer: Any, sharded: Any) -> str:
    path = _check_path(path)
    _check_model_and_optimizer(model, optimizer)
    check_type("sharded", sharded, bool, "True or False")
    if sharded and os.path.isfile(path):
        raise InvalidArgumentError("path", path, "a directory (or a new name) for a sharded checkpoint, not a file")
    if not sharded:
        if os.path.isdir(path):
            raise InvalidArgumentError("path", path, "a file name for a full checkpoint, not a directory")
        if not os.path.isdir(os.path.dirname(path)):
            raise InvalidArgumentError("path", path, "a file in an existing directory")
    return path


def _check_load_args(path: Any, model: Any, optimizer: Any) -> str:
    path = _check_existing_path(path)
    _check_model_and_optimizer(model, optimizer)
    return path


# ---- the full format -----------------------------------------------------------------------------


def _save_full(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None) -> None:
    model_state = model.state_dict(rank0_only=True)
    optimizer_state = optimizer.state_dict(rank0_only=True) if optimizer is not None else None
    _write_full(path, model.data_parallel, model_state, optimizer_state)


def _write_full(path: str, group: ShardGroup, model_state: Any, optimizer_state: Any) -> None:
    """Rank 0 writes the full-format file atomically; every rank learns whether it succeeded."""
    error = None
    if group.rank == 0:
        payload = {"format": FULL_FORMAT, "model": model_state, "optimizer": optimizer_state}
        payload["checksum"] = content_checksum(payload)
        try:
            write_atomically(path, lambda f: torch.save(payload, f))
        except Exception as exc:  # noqa: BLE001 - re-raised by _agree
            error = _save_error(path, path, exc)
        else:
            remove_stale_temporaries(path)
    _agree(group, error, f"saving {path!r}")


def _read_full(path: str) -> dict[str, Any]:
    """The envelope of a full checkpoint file, its checksum (version 2) and fields checked."""
    allowed = (f"a checkpoint written by chunkmem.save_checkpoint (format {FULL_FORMAT!r} or {FULL_FORMAT_V1!r}, "
               f"or a sharded directory)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file or not a torch.save file at all
        raise CheckpointError(f"{path}: cannot be read as a checkpoint ({allowed}); the file is damaged or of "
                              f"another kind: {exc}") from exc
    if not isinstance(payload, dict):
        raise InvalidArgumentError("path", path, f"{allowed}; found a {type(payload).__name__}")
    if "checksum" in payload or payload.get("format") == FULL_FORMAT:
        _verify_content(path, payload)
    if payload.get("format") not in (FULL_FORMAT, FULL_FORMAT_V1):
        raise InvalidArgumentError("path", path, f"{allowed}; found format {payload.get('format')!r}")
    _field(payload, "model", dict, path, "the model state dict")
    _field(payload, "optimizer", (dict, type(None)), path, "the optimizer state dict or None")
    return payload


def _verify_content(path: str, payload: dict[str, Any]) -> None:
    saved = _field(payload, "checksum", str, path, "the checksum of the other fields ('sha256:<hex>')")
    found = content_checksum({k: v for k, v in payload.items() if k != "checksum"})
    if saved != found:
        raise CheckpointError(f"{path}: the checkpoint is damaged: its content's checksum is {found}, the file "
                              f"records {saved}; nothing was loaded")


def _prepare_full(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None) -> Callable[[], None]:
    payload = _read_full(path)
    if optimizer is not None and payload["optimizer"] is None:
        raise InvalidArgumentError("optimizer", "a ShardedOptimizerV2",
                                   f"None: the checkpoint {path!r} was saved without optimizer state")
    model_load = plan_model_load(model, payload["model"], strict=True)
    optimizer_load = prepare_optimizer_load(optimizer, payload["optimizer"]) if optimizer is not None else None

    def apply() -> None:
        model_load.apply()
        if optimizer_load is not None:
            optimizer_load.apply()
    return apply


# ---- LowLevelZeroOptimizer (a plain module; full format) -----------------------------------------


def _is_low_level_zero(optimizer: Any) -> bool:
    from ..optim.low_level_zero import LowLevelZeroOptimizer

    return isinstance(optimizer, LowLevelZeroOptimizer)


def _check_low_level_zero_args(path: Any, model: Any, optimizer: Any, sharded: Any) -> str:
    """With a :class:`~chunkmem.LowLevelZeroOptimizer`: ``model`` is the plain module it trains (its
    trainable parameters exactly the optimizer's) and only the full format is written (the module's state
    dict holds the fp32 masters)."""
    path = _check_path(path)
    check_type("model", model, torch.nn.Module, "the torch.nn.Module the LowLevelZeroOptimizer trains")
    if isinstance(model, ShardedModelV2):
        raise ArgumentTypeError("model", type(model).__name__, "the plain torch.nn.Module the LowLevelZeroOptimizer "
                                                               "trains")
    optimizer.check_module(model, "model")
    check_type("sharded", sharded, bool, "True or False")
    if sharded:
        raise InvalidArgumentError("sharded", True, "False with a LowLevelZeroOptimizer (full format only)")
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(path)):
        raise InvalidArgumentError("path", path, "a file in an existing directory (full format)")
    return path


def _save_low_level_zero(path: str, model: torch.nn.Module, optimizer: Any) -> None:
    """The full format, from rank 0: the module's state with the fp32 masters, the optimizer's state."""
    _write_full(path, optimizer.shards, optimizer.model_state_dict(model, rank0_only=True),
                optimizer.state_dict(rank0_only=True))


def _prepare_low_level_zero(path: str, model: torch.nn.Module, optimizer: Any, model_only: bool) -> Callable[[], None]:
    payload = _read_full(path)
    if payload["optimizer"] is None and not model_only:
        raise InvalidArgumentError("optimizer", "a LowLevelZeroOptimizer",
                                   f"None: the checkpoint {path!r} was saved without optimizer state")
    load_model = optimizer.prepare_load_model_state_dict(model, payload["model"])
    load_optimizer = (lambda: None) if model_only else optimizer.prepare_load_state_dict(payload["optimizer"])

    def apply() -> None:
        load_model()
        load_optimizer()
    return apply


# ---- the sharded format --------------------------------------------------------------------------


def _save_sharded(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None) -> None:
    """Every shard group holds the same shards: the first one writes them, and all ranks agree on the
    outcome (without shard groups, the one group does both)."""
    if model.replicas is None:
        _save_shards(path, model, optimizer)
        return
    error = None
    if model.replicas.rank == 0:
        try:
            _save_shards(path, model, optimizer)
        except Exception as exc:  # noqa: BLE001 - re-raised by _agree
            error = exc
    _agree(model.data_parallel, error, f"saving {path!r}")


def _save_shards(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None) -> None:
    group = _group_of(model)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _save_error(path, path, exc) from exc
    token = _new_token(group)
    own = os.path.join(path, _shard_name(token, group.rank, group.world))
    error = None
    checksum = ""
    try:
        payload = _rank_payload(model, optimizer, group, token)
        checksum = _save_hashed(own, payload)
    except Exception as exc:  # noqa: BLE001 - re-raised by _agree
        error = _save_error(path, own, exc, model.disk_path)
    try:
        _agree(group, error, f"saving {path!r}")  # every rank file is complete
        checksums = _gather_strings(group, checksum)
        if group.rank == 0:
            files = [_shard_name(token, r, group.world) for r in range(group.world)]
            manifest = {"format": SHARDED_FORMAT, "token": token, "world": group.world, "files": files,
                        "checksums": dict(zip(files, checksums))}
            try:
                write_json_atomically(manifest, os.path.join(path, MANIFEST))
            except Exception as exc:  # noqa: BLE001 - re-raised by _agree
                error = _save_error(path, os.path.join(path, MANIFEST), exc)
            else:
                _remove_stale(path, token)
        _agree(group, error, f"committing {path!r}")  # the manifest names this token
    except Exception:  # not committed: this save's file goes (files of an interrupted save go at the next one)
        with contextlib.suppress(OSError):
            os.remove(own)
        raise


def _save_hashed(path: str, payload: Any) -> str:
    """``torch.save`` ``payload`` to ``path`` atomically; the checksum of the bytes written."""
    writers: list[HashingWriter] = []

    def write(f: Any) -> None:
        writers.append(HashingWriter(f))
        torch.save(payload, writers[-1])
    write_atomically(path, write)
    return writers[-1].checksum()


def _rank_payload(model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None, group: ShardGroup,
                  token: str) -> dict[str, Any]:
    """What one rank writes: its shards, the layout, the buffers, and the optimizer's small state."""
    chunks = []
    for chunk in model.chunks:
        master = chunk.optim[MASTER]
        entry = {"index": chunk.index, "numel": chunk.numel, "shard_numel": chunk.shard_numel,
                 "shard_offset": chunk.shard_offset, "dtype": _dtype_name(chunk.dtype), "trainable": chunk.trainable,
                 "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                           for s in chunk.slots],
                 "param": _saved(chunk.param.shard) if chunk.param.shard.on_disk else _cpu_copy(chunk.param.local()),
                 "master": _saved(master) if chunk.has_master and master.allocated else None,
                 "step": 0, "exp_avg": None, "exp_avg_sq": None}
        if optimizer is not None and chunk.trainable:
            entry["slot_steps"] = [chunk.step_of(s) for s in chunk.slots]
            entry["step"] = max(entry["slot_steps"], default=0)  # 0: the chunk has no optimizer state yet
            entry.update(optimizer.update_rule.saved_state(chunk, _saved))
        chunks.append(entry)
    keys, buffers = [], {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        slot = slot_of(value) if isinstance(value, torch.nn.Parameter) else None
        keys.append([key, slot.name if slot is not None else None])
        if slot is None:
            buffers[key] = _cpu_copy(value)
    optimizer_part = _optimizer_small_state(optimizer) if optimizer is not None else None
    return {"format": SHARDED_FORMAT, "token": token, "rank": group.rank, "world": group.world,
            "model": {"dtype": _dtype_name(model.dtype), "keys": keys, "buffers": buffers, "chunks": chunks},
            "optimizer": optimizer_part}


def _optimizer_small_state(optimizer: ShardedOptimizerV2) -> dict[str, Any]:
    """The optimizer state every rank shares: the param groups as the full format packs them, the
    name of the parameter behind each index, and the loss scaler."""
    groups, params = export_param_groups(optimizer)
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
    return {"param_groups": groups, "param_names": [optimizer.model.parameter_name(p) for p in params],
            "loss_scaler": scaler, "per_group": optimizer.update_rule.per_group_keys(),
            "state_dict_form": optimizer.update_rule.state_dict_form}


def _prepare_sharded(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None,
                  elastic: bool) -> Callable[[], None]:
    group = _group_of(model)
    manifest = _read_manifest(path)
    if manifest["world"] == group.world:
        payload = _read_rank_file(path, manifest, group.rank)
        if _chunk_table(model) == _saved_chunk_table(payload["model"]):
            return _prepare_own_shards(path, model, optimizer, manifest, payload)
        if not elastic:
            raise InvalidArgumentError("path", path, "a sharded checkpoint of the model's chunk layout (elastic=False); "
                                                     "it was saved with another chunk size or dtype")
    elif not elastic:
        raise InvalidArgumentError(
            "path", path, f"a sharded checkpoint saved by {group.world} ranks, as many as this run has (it was "
                          f"saved by {manifest['world']}; elastic=False refuses another world size)")
    return _prepare_other_layout(path, model, optimizer, manifest)


def _prepare_own_shards(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None,
                     manifest: dict[str, Any], payload: dict[str, Any]) -> Callable[[], None]:
    """The load of a checkpoint saved with the model's layout and world size: this rank's file only."""
    group = _group_of(model)
    saved = payload["model"]
    name = os.path.join(path, _shard_name(manifest["token"], group.rank, group.world))
    load_small_state, load_buffers = _prepare_shared_state(path, name, model, optimizer, payload)
    _check_rank_values(name, model, saved, optimizer)

    def apply() -> None:
        for chunk, entry in zip(model.chunks, saved["chunks"]):
            model.runtime.write_params(chunk, entry["param"])
            bump_versions(slot.param for slot in chunk.slots)
            if chunk.has_master and chunk.optim[MASTER].allocated:
                chunk.optim[MASTER].write(entry["master"] if entry["master"] is not None else entry["param"])
            elif entry["master"] is not None:
                warn_if_masters_lose_precision(chunk, chunk.name, entry["master"])
        if load_small_state is not None:
            load_small_state()  # hyper-parameters and the scaler
            for chunk, entry in zip(model.chunks, saved["chunks"]):
                if not chunk.trainable:
                    continue
                for key, values in saved_state(entry).items():
                    chunk.optim[key].write(values)
                if optimizer.update_rule.keeps_slot_state:
                    scalars = saved_slot_scalars(entry, [optimizer.group_of(slot.param) for slot in chunk.slots])
                    optimizer.replace_kept_state(chunk, {k: scalar_copy(v) for k, v in scalars.items()},
                                                 {k: scalar_copy(v) for k, v in entry["whole"].items()})
                chunk.steps = {slot.index_in_chunk: count for slot, count in zip(chunk.slots, saved_slot_steps(entry))
                               if count}
        load_buffers()
    return apply


def _prepare_other_layout(path: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None,
                       manifest: dict[str, Any]) -> Callable[[], None]:
    """The load of a checkpoint saved by another world size or with another chunk layout
    (:mod:`chunkmem.io.resharding`). Every rank file is memory-mapped; each file's checksum is verified
    by one loading rank (rank ``r`` the files ``r``, ``r + world``, ...), and the ranks agree on the
    outcome before anything is written, so together they read every byte once to verify it."""
    group = _group_of(model)
    world = manifest["world"]
    parts = [_read_rank_file(path, manifest, r, verify=r % group.world == group.rank) for r in range(world)]
    files = [os.path.join(path, _shard_name(manifest["token"], r, world)) for r in range(world)]
    load_small_state, load_buffers = _prepare_shared_state(path, files[0], model, optimizer, parts[0])
    load_shards = plan_resharded_load(path, model, optimizer, SavedLayout(parts, files), load_small_state)

    def apply() -> None:
        load_shards()
        load_buffers()
    return apply


def _prepare_shared_state(path: str, name: str, model: ShardedModelV2, optimizer: ShardedOptimizerV2 | None,
                       payload: dict[str, Any]) -> tuple[Callable[[], None] | None, Callable[[], None]]:
    """Check what every rank file holds alike (``name``'s: the state_dict keys, the buffers, the
    optimizer's param groups and scaler) against the model and optimizer; returns the functions that
    load the optimizer's hyper-parameters and scaler (``None`` without an optimizer) and the buffers."""
    saved = payload["model"]
    own_keys = list(model.module.state_dict(keep_vars=True))
    if [k for k, _ in saved["keys"]] != own_keys:
        raise InvalidArgumentError("path", path, f"a checkpoint of this model's state_dict keys (it has "
                                                 f"{len(saved['keys'])} keys, the model {len(own_keys)})")
    _check_buffers(name, model, saved)
    optimizer_load = None
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise InvalidArgumentError("optimizer", "a ShardedOptimizerV2",
                                       f"None: the checkpoint {path!r} was saved without optimizer state")
        small = payload["optimizer"]
        _, params = export_param_groups(optimizer)
        if small["param_names"] != [model.parameter_name(p) for p in params]:
            raise InvalidArgumentError("optimizer", "a ShardedOptimizerV2 whose param_groups hold other parameters "
                                                    "or another order", "the param groups the checkpoint was saved with")
        optimizer_load = prepare_hyper_load(optimizer, small["param_groups"], small["loss_scaler"],
                                         adam=optimizer.update_rule.adam_hyper_parameters)
    buffers = model.module.state_dict(keep_vars=True)

    def load_buffers() -> None:
        with torch.no_grad():
            for key, value in saved["buffers"].items():
                buffers[key].copy_(value)
    return (None if optimizer_load is None else optimizer_load.apply), load_buffers


def _check_rank_values(name: str, model: ShardedModelV2, saved: dict[str, Any],
                       optimizer: ShardedOptimizerV2 | None) -> None:
    """Raise (naming the file and the field) unless every tensor and number the load of this rank file
    writes fits the model: shards of the chunk's size, floating, with data; steps >= 0. Called after the
    layout check, before anything is written."""
    for n, (chunk, entry) in enumerate(zip(model.chunks, saved["chunks"])):
        where = f"{name}: model.chunks[{n}]"
        check_tensor_data(f"{where}['param']", entry["param"], floating=True, numel=chunk.shard_numel)
        if entry["master"] is not None:
            check_tensor_data(f"{where}['master']", entry["master"], floating=True, numel=chunk.shard_numel)
        if optimizer is not None and chunk.trainable:
            if entry["step"] < 0:
                raise InvalidArgumentError(f"{where}['step']", entry["step"], "an integer >= 0")
            counts = saved_slot_steps(entry)
            if len(counts) != len(chunk.slots) or any(not isinstance(c, int) or isinstance(c, bool) or c < 0
                                                      for c in counts):
                raise InvalidArgumentError(f"{where}['slot_steps']", counts,
                                           f"{len(chunk.slots)} integers >= 0, one per parameter of the chunk")
            state = saved_state(entry)
            if not entry_fits_rule(entry, optimizer.update_rule, chunk.state_families):
                raise InvalidArgumentError(f"{where}: the optimizer state", f"families {list(state)}",
                                           f"the optimizer's {list(chunk.state_families)} (save and load with one "
                                           f"optimizer class)")
            for family, values in state.items():
                buf = chunk.optim[family]
                check_tensor_data(f"{where}[{family!r}]", values, floating=buf.dtype.is_floating_point, numel=buf.numel)
                if not buf.dtype.is_floating_point and values.dtype != buf.dtype:
                    raise InvalidArgumentError(f"{where}[{family!r}]", f"a tensor of dtype {values.dtype}", f"{buf.dtype}")
            for kind in (_scalars_field(entry), "whole") if "whole" in entry else ():
                for key, kept in entry[kind].items():
                    if not isinstance(kept, dict):
                        raise CheckpointError(f"{where}[{kind!r}][{key!r}] is a {type(kept).__name__}, expected a "
                                              f"dict of the optimizer's state")
                    for field_name, value in kept.items():
                        if isinstance(value, torch.Tensor):
                            check_tensor_data(f"{where}[{kind!r}][{key!r}][{field_name!r}]", value)


def _check_buffers(name: str, model: ShardedModelV2, saved: dict[str, Any]) -> None:
    """Raise naming the file unless ``saved`` holds the model's buffers, of their shapes."""
    own = model.module.state_dict(keep_vars=True)
    expected = [key for key, slot in saved["keys"] if slot is None]
    if sorted(saved["buffers"]) != sorted(expected):
        raise InvalidArgumentError(f"{name}: model.buffers", f"buffers {first_few(sorted(saved['buffers']))}",
                                   f"the model's buffers {first_few(sorted(expected))}")
    for key, value in saved["buffers"].items():
        check_tensor_data(f"{name}: model.buffers[{key!r}]", value)
        if tuple(value.shape) != tuple(own[key].shape):
            raise InvalidArgumentError(f"{name}: model.buffers[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                                       f"shape {tuple(own[key].shape)}, the model's")


def _chunk_table(model: ShardedModelV2) -> list[Any]:
    """The model's chunks as a rank file describes them: sizes, this rank's shard, dtype, parameters."""
    return [(c.numel, c.shard_numel, c.shard_offset, _dtype_name(c.dtype), c.trainable,
             [(s.name, s.offset, s.numel, list(s.shape)) for s in c.slots]) for c in model.chunks]


def _saved_chunk_table(saved: dict[str, Any]) -> list[Any]:
    return [(e["numel"], e["shard_numel"], e["shard_offset"], e["dtype"], e["trainable"],
             [(s["name"], s["offset"], s["numel"], list(s["shape"])) for s in e["slots"]]) for e in saved["chunks"]]


def _read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a sharded checkpoint directory, every field checked (format 1 or 2)."""
    name = os.path.join(path, MANIFEST)
    allowed = f"a sharded checkpoint directory with a {MANIFEST} written by chunkmem.save_checkpoint(sharded=True)"
    if not os.path.isfile(name):
        raise InvalidArgumentError("path", path, f"{allowed}; there is no {MANIFEST}")
    try:
        with open(name, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{name}: cannot be read as a checkpoint manifest (damaged?): {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") not in (SHARDED_FORMAT, SHARDED_FORMAT_V1):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InvalidArgumentError("path", path, f"{allowed} (format {SHARDED_FORMAT!r} or {SHARDED_FORMAT_V1!r}; "
                                                 f"found {found!r})")
    token = _field(manifest, "token", str, name, "the hex token of the committed save")
    if not _TOKEN.match(token):
        raise CheckpointError(f"{name}: field 'token' is {token!r}, expected hex digits")
    world = _field(manifest, "world", int, name, "the number of ranks that saved (an integer >= 1)")
    if world < 1:
        raise CheckpointError(f"{name}: field 'world' is {world}, expected an integer >= 1")
    files = _field(manifest, "files", list, name, "the names of the rank files")
    if manifest["format"] == SHARDED_FORMAT:
        checksums = _field(manifest, "checksums", dict, name, "each rank file's checksum under its name")
        if not all(isinstance(v, str) for v in checksums.values()):
            raise CheckpointError(f"{name}: field 'checksums' holds a value that is not a string")
    if not all(isinstance(f, str) for f in files):
        raise CheckpointError(f"{name}: field 'files' holds a value that is not a file name")
    return manifest


def _read_rank_file(path: str, manifest: dict[str, Any], rank: int, verify: bool = True) -> dict[str, Any]:
    """One rank's file of a sharded checkpoint: found, checksum verified (format 2; unless ``verify`` is
    false: another rank verifies it), memory-mapped, and its header and fields checked."""
    base = _shard_name(manifest["token"], rank, manifest["world"])
    name = os.path.join(path, base)
    if not os.path.isfile(name):
        raise InvalidArgumentError("path", path, f"a complete sharded checkpoint; reading rank {rank}'s file {base} "
                                                 f"failed: there is no such file")
    manifest_name = os.path.join(path, MANIFEST)
    if base not in manifest["files"]:
        raise CheckpointError(f"{manifest_name}: field 'files' does not name {base}, the file of rank {rank}")
    if manifest["format"] == SHARDED_FORMAT:
        if base not in manifest["checksums"]:
            raise CheckpointError(f"{manifest_name}: field 'checksums' has no checksum of {base}")
        found = file_checksum(name) if verify else None
        if found is not None and found != manifest["checksums"][base]:
            raise CheckpointError(f"{name}: the rank file is damaged: its checksum is {found}, {MANIFEST} records "
                                  f"{manifest['checksums'][base]}; nothing was loaded")
    try:
        payload = torch.load(name, map_location="cpu", weights_only=True, mmap=True)  # tensors read as used
    except Exception as exc:  # noqa: BLE001 - a damaged part
        raise CheckpointError(f"{name}: cannot be read as a rank file of a sharded checkpoint (damaged?): "
                              f"{exc}") from exc
    header = (payload.get("format"), payload.get("token"), payload.get("rank"), payload.get("world")) \
        if isinstance(payload, dict) else None
    if header != (manifest["format"], manifest["token"], rank, manifest["world"]):
        raise InvalidArgumentError("path", path, f"a consistent sharded checkpoint; {base} has header {header}")
    _check_rank_fields(name, payload)
    return payload


_CHUNK_FIELDS = {"index": int, "numel": int, "shard_numel": int, "shard_offset": int, "dtype": str,
                 "trainable": bool, "slots": list, "param": torch.Tensor, "master": (torch.Tensor, type(None)),
                 "step": int, "exp_avg": (torch.Tensor, type(None)), "exp_avg_sq": (torch.Tensor, type(None))}
_SLOT_FIELDS = {"name": str, "offset": int, "numel": int, "shape": list}


def _check_rank_fields(name: str, payload: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the file and the field unless every field a rank file
    must have is there with its type."""
    model = _field(payload, "model", dict, name, "the model's part")
    _field(model, "dtype", str, name, "the model's dtype name", "model.")
    keys = _field(model, "keys", list, name, "the state_dict keys and the parameter behind each", "model.")
    if not all(isinstance(k, (list, tuple)) and len(k) == 2 and isinstance(k[0], str) for k in keys):
        raise CheckpointError(f"{name}: field 'model.keys' holds an entry that is not [key, parameter name]")
    _field(model, "buffers", dict, name, "the module buffers", "model.")
    for n, entry in enumerate(_field(model, "chunks", list, name, "one entry per chunk", "model.")):
        where = f"model.chunks[{n}]."
        if not isinstance(entry, dict):
            raise CheckpointError(f"{name}: field '{where[:-1]}' is a {type(entry).__name__}, expected a dict")
        for key, kinds in _CHUNK_FIELDS.items():
            _field(entry, key, kinds, name, _kind_names(kinds), where)
        if "state" in entry:  # an optimizer other than Adam: its families
            _field(entry, "state", dict, name, "dict", where)
        if "whole" in entry:  # one that keeps state per parameter (scalars, whole-parameter state)
            _field(entry, "whole", dict, name, "dict", where)
            _field(entry, _scalars_field(entry), dict, name, "dict", where)
        for m, slot in enumerate(entry["slots"]):
            if not isinstance(slot, dict):
                raise CheckpointError(f"{name}: field '{where}slots[{m}]' is a {type(slot).__name__}, expected a dict")
            for key, kinds in _SLOT_FIELDS.items():
                _field(slot, key, kinds, name, _kind_names(kinds), f"{where}slots[{m}].")
    optimizer = _field(payload, "optimizer", (dict, type(None)), name, "the optimizer's part or None")
    if optimizer is not None:
        for key, kinds in {"param_groups": list, "param_names": list, "loss_scaler": (dict, type(None))}.items():
            _field(optimizer, key, kinds, name, _kind_names(kinds), "optimizer.")


def _scalars_field(entry: dict[str, Any]) -> str:
    """The field of a saved chunk that holds another optimizer's scalar state: ``"slot_scalars"`` (by
    parameter), or ``"scalars"`` (by param group) in a file written before 2026-11-27."""
    return "scalars" if "scalars" in entry and "slot_scalars" not in entry else "slot_scalars"


def _field(doc: dict[str, Any], key: str, kinds: type | tuple[type, ...], file: str, what: str,
           where: str = "") -> Any:
    """``doc[key]``; :class:`CheckpointError` naming ``file`` and the field (``where`` + ``key``) when
    it is missing or not of ``kinds`` (``bool`` is not an ``int`` here)."""
    if key not in doc:
        raise CheckpointError(f"{file}: field {where + key!r} is missing; expected {what}")
    value = doc[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise CheckpointError(f"{file}: field {where + key!r} is a {type(value).__name__}, expected {what}")
    return value


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _consolidate(path: str, parts: list[dict[str, Any]], files: list[str]) -> dict[str, Any]:
    """The full model and optimizer state dicts from every rank's file (``files``: their names), as the full
    format holds them."""
    layouts = [[(e["numel"], e["dtype"], e["slots"]) for e in part["model"]["chunks"]] for part in parts]
    if any(layout != layouts[0] for layout in layouts):
        raise InvalidArgumentError("path", path, "rank files of one chunk layout (they differ)")

    def joined(pieces: list[Any], n: int) -> Any:
        """A chunk's whole family from the ranks' pieces: a replicated chunk's (persistent parameters,
        whole on every rank) is rank 0's."""
        entry = parts[0]["model"]["chunks"][n]
        return pieces[0] if entry["shard_numel"] == entry["numel"] else torch.cat(pieces)

    located: dict[str, tuple[int, dict[str, Any]]] = {}
    for n, entry in enumerate(parts[0]["model"]["chunks"]):
        for slot in entry["slots"]:
            located[slot["name"]] = (n, slot)
    model_state = _consolidated_model(parts, located, joined)
    small = parts[0]["optimizer"]
    if small is None:
        return {"model": model_state, "optimizer": None}
    saved = SavedLayout(parts, files)
    if holds_low_bit_state(saved):  # per piece of each shard: read back whole per parameter
        state = consolidated_state(path, saved, small)
    else:
        state = _consolidated_state(parts, small, located, joined)
    optimizer_state = {"state": state, "param_groups": small["param_groups"], "loss_scaler": small["loss_scaler"]}
    return {"model": model_state, "optimizer": optimizer_state}


def _consolidated_model(parts: list[dict[str, Any]], located: dict[str, tuple[int, dict[str, Any]]],
                        joined: Callable[[list[Any], int], Any]) -> OrderedDict[str, torch.Tensor]:
    """The full model state dict from every rank's file: the fp32 masters (or the parameters widened to fp32)
    of each parameter, the buffers (``located``: each parameter's saved chunk and slot, by name)."""
    def full(family: str, n: int) -> torch.Tensor | None:
        pieces = [part["model"]["chunks"][n][family] for part in parts]
        return None if any(p is None for p in pieces) else joined(pieces, n)

    values: dict[int, torch.Tensor] = {}
    model_state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, name in parts[0]["model"]["keys"]:
        if name is None:
            model_state[key] = parts[0]["model"]["buffers"][key].clone()
            continue
        n, slot = located[name]
        if n not in values:
            master = full("master", n)
            values[n] = master if master is not None else full("param", n).to(torch.float32)
        model_state[key] = _slot_view(values[n], slot).clone()
    return model_state


def _consolidated_state(parts: list[dict[str, Any]], small: dict[str, Any],
                        located: dict[str, tuple[int, dict[str, Any]]],
                        joined: Callable[[list[Any], int], Any]) -> dict[int, dict[str, Any]]:
    """The ``"state"`` of the full optimizer state dict of per-element families (Adam's moments, another
    optimizer's state) from every rank's file (``small``: rank 0's optimizer part)."""
    state: dict[int, dict[str, Any]] = {}
    families: dict[int, dict[str, torch.Tensor]] = {}
    group_of = {i: g for g, group in enumerate(small["param_groups"]) for i in group["params"]}
    group_of_name = {name: group_of[i] for i, name in enumerate(small["param_names"])}
    for index, name in enumerate(small["param_names"]):
        n, slot = located[name]
        entry = parts[0]["model"]["chunks"][n]
        step = saved_slot_steps(entry)[entry["slots"].index(slot)] if entry["trainable"] else 0
        if step == 0:  # torch keeps no state for a parameter never stepped
            continue
        if n not in families:
            families[n] = {key: joined([saved_state(part["model"]["chunks"][n])[key] for part in parts], n)
                           for key in saved_state(entry)}
        gathered = families[n]
        if "state" not in entry:
            state[index] = adam_entry(step, _slot_view(gathered["exp_avg"], slot),
                                      _slot_view(gathered["exp_avg_sq"], slot), slot["shape"])
        elif entry["whole"]:  # whole-parameter state: one rank, by position in the chunk
            position = entry["slots"].index(slot)
            if position in entry["whole"]:
                state[index] = scalar_copy(entry["whole"][position])
        else:
            scalars = saved_slot_scalars(entry, [group_of_name.get(s["name"]) for s in entry["slots"]])
            position = entry["slots"].index(slot)
            if position in scalars:
                keys = small["per_group"][group_of[index]]
                state[index] = any_entry(scalars[position], {k: gathered[k] for k in keys},
                                         lambda flat, s=slot: _slot_view(flat, s), slot["shape"])
    return state


def _slot_view(flat: torch.Tensor, slot: dict[str, Any]) -> torch.Tensor:
    return flat[slot["offset"]:slot["offset"] + slot["numel"]].view(tuple(slot["shape"]))


def _shard_name(token: str, rank: int, world: int) -> str:
    return f"shard-{token}-rank{rank}-of-{world}.pt"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _saved(buf: Any) -> torch.Tensor:
    """What a rank file holds of a chunk buffer: a copy, or for a buffer on the disk tier its file region
    mapped (the save then streams it from disk instead of holding every chunk in memory)."""
    return buf.memory.disk.mapped(buf.region, buf.disk_slot) if buf.on_disk else _cpu_copy(buf.read())


# ---- files ---------------------------------------------------------------------------------------


def _save_error(path: str, written: str, exc: Exception, disk_path: str | None = None) -> Exception:
    """What a save that failed with ``exc`` while writing ``written`` (the checkpoint ``path`` or a file in
    it) raises: for a system error (a full disk, a missing directory) a :class:`CheckpointError` naming
    the checkpoint, the file and the cause, chained from the ``OSError``; ``exc`` itself otherwise.
    ``disk_path``: the model's disk-tier scratch directory, named when it is gone (a sharded save reads
    the disk-resident state from its files)."""
    cause = _os_error_behind(exc)
    if cause is None or isinstance(exc, ChunkmemError) or isinstance(cause, ChunkmemError):
        return exc  # chunkmem's own errors (a DiskIOError of the disk tier) name their files already
    reason = str(cause)
    if cause.errno is not None:
        reason = f"{os.strerror(cause.errno)} (errno {errno.errorcode.get(cause.errno, cause.errno)})"
    if disk_path is not None and not os.path.isdir(disk_path):
        error = CheckpointError(
            f"cannot save the checkpoint {path!r}: the model's disk-tier scratch directory (model.disk_path="
            f"{disk_path!r}) was removed while training, and a sharded save reads the state resting on disk from "
            f"its files ({reason}: {cause.filename!r}). Nothing was changed or lost: training goes on through the "
            f"files still open; save with sharded=False, which reads the state through them")
    else:
        file = "" if written == path else f" (its file {os.path.basename(written)!r})"
        error = CheckpointError(f"cannot write the checkpoint {path!r}{file}: {reason}; nothing was changed (a "
                                f"checkpoint saved at {path!r} before is left as it was)")
    error.__cause__ = cause
    return error


def _os_error_behind(exc: BaseException | None) -> OSError | None:
    """``exc`` or the first ``OSError`` it was raised from or while handling (torch.save reports a failed
    write of its file as a ``RuntimeError`` raised while handling the ``OSError``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _remove_stale(path: str, token: str) -> None:
    """Remove the rank files of other tokens and temporary files left by interrupted saves. Never
    raises: the save is committed already, and what stays is removed by the next one."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        names = []
        warnings.warn(f"could not list {path!r} to remove stale checkpoint files: {exc}", stacklevel=4)
    for name in names:
        match = _SHARD_FILE.match(name)
        target = temporary_target(name)
        temporary = target is not None and (target == MANIFEST or _SHARD_FILE.match(target) is not None)
        if (match and match.group("token") != token) or temporary:
            try:
                os.remove(os.path.join(path, name))
            except OSError as exc:
                warnings.warn(f"could not remove the stale checkpoint file {name!r} in {path!r}: {exc}",
                              stacklevel=4)


# ---- ranks ---------------------------------------------------------------------------------------


def _group_of(model: ShardedModelV2) -> ShardGroup:
    """The ranks the model's chunks are sharded over (its shard group, with shard groups)."""
    return model.chunks[0].shards if model.chunks else SINGLE_PROCESS


def _collective(group: ShardGroup) -> bool:
    return group.world > 1 and distributed_ready()


def _new_token(group: ShardGroup) -> str:
    """A fresh name for one save, made by rank 0 and shared with the other ranks."""
    token = secrets.token_hex(8)
    if _collective(group):  # rank 0's, through a bounded collective (see chunkmem.distributed.collectives)
        token = group.all_gather_bytes(token.encode(), "the checkpoint's name token")[0].decode()
    return token


def _gather_strings(group: ShardGroup, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (on every rank)."""
    if not _collective(group):
        return [text]
    return [data.decode() for data in group.all_gather_bytes(text.encode(), "the ranks' checkpoint file names")]


def _agree(group: ShardGroup, error: Exception | None, what: str) -> None:
    """Wait for every rank (when distributed), then raise on every rank if any failed: the rank's own
    error, or :class:`CheckpointError` naming what another rank failed."""
    if _collective(group):
        failed = torch.tensor([0 if error is None else group.rank + 1], dtype=torch.int64)
        all_reduce_over(group.group, failed, dist.ReduceOp.MAX, what=f"the outcome of {what}")
        if error is None and int(failed.item()):
            raise CheckpointError(f"{what} failed on rank {int(failed.item()) - 1} (see its error); nothing was "
                                  f"changed by this call")
    if error is not None:
        raise error
