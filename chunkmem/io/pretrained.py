"""Hugging Face ``from_pretrained`` into chunks, and ``save_pretrained`` from chunks (safetensors).

Inside :class:`~chunkmem.ZeroInitContext`, ``SomeModel.from_pretrained(directory)`` (any
``transformers.PreTrainedModel`` class, ``AutoModel*`` too) runs :func:`from_pretrained`:

1. the model is built from its config inside the context, with transformers' ``no_init_weights``
   (no random initialisation is computed): each module's parameters go into chunks of the context's
   dtype as its ``__init__`` returns, so at most one module's parameters exist outside chunks;
2. the checkpoint is read one safetensors file at a time (``model.safetensors``, or each shard of
   ``model.safetensors.index.json``), one tensor at a time; each tensor is written straight into its
   parameter's chunk (this rank's part only under ``shard_param=True``; no collective) and dropped;
3. parameters the checkpoint lacks (a new head) are initialised by the model's own ``_init_weights``;
   tied parameters (an lm head tied to the embedding) are one parameter and load once.

So the whole model never exists in fp32 (nor at all, sharded) in one process: the peak outside
the chunks is one module's parameters while building, then one checkpoint tensor. Values are rounded
to the context's dtype (an fp32 context keeps them exactly); the optimizer's fp32 masters are built
later from the chunks.

:func:`save_pretrained` writes what ``PreTrainedModel.save_pretrained`` writes (``config.json``,
``generation_config.json``, ``model.safetensors`` or shards with an index) from a
:class:`~chunkmem.ShardedModelV2`, gathering one chunk at a time (fp32 values, from the masters where
they exist); tied parameters are saved once, under the key transformers keeps. A plain
``from_pretrained`` loads it. ``transformers`` and ``safetensors`` are needed only here (``pip install
chunkmem[hf]``); the rest of chunkmem never imports this module's dependencies.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..errors import ArgumentTypeError, InvalidArgumentError, check_type
from ..core.param_guard import slot_of
from ..core.tiers import parse_size

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_DTYPE_ARGUMENTS = ("dtype", "torch_dtype")
_IGNORED_ARGUMENTS = ("local_files_only", "low_cpu_mem_usage", "use_safetensors", "trust_remote_code")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("chunkmem.io.pretrained needs transformers and safetensors: pip install chunkmem[hf]") \
            from exc
    return transformers


def safe_open(path: str) -> Any:
    """Open one safetensors file for reading tensor by tensor (a context manager)."""
    from safetensors import safe_open as _open

    return _open(path, framework="pt", device="cpu")


# ---- loading ----------------------------------------------------------------------------------------

def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a ``save_pretrained`` directory, in shard order."""
    index = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        return [os.path.join(directory, name) for name in names]
    single = os.path.join(directory, WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    raise InvalidArgumentError("pretrained_model_name_or_path", directory,
                               f"a local directory holding {WEIGHTS_NAME} or {INDEX_NAME} (written by "
                               f"save_pretrained; nothing is downloaded)")


def _split_kwargs(config: Any, kwargs: dict[str, Any], context: Any) -> None:
    """Apply ``from_pretrained`` keyword arguments: config attributes are set on the config (as
    transformers does), a dtype must be the context's, a few loading switches are ignored."""
    for key, value in kwargs.items():
        if key in _DTYPE_ARGUMENTS:
            if value not in (None, "auto", context.dtype):
                raise InvalidArgumentError(key, value, f"None, 'auto' or {context.dtype} (the ZeroInitContext "
                                                       f"dtype: chunks hold the model in that dtype)")
        elif key == "attn_implementation":
            config._attn_implementation = value
        elif key in _IGNORED_ARGUMENTS:
            continue
        elif hasattr(config, key):
            setattr(config, key, value)
        else:
            raise InvalidArgumentError(key, value, "a config attribute, config, attn_implementation, dtype or one of "
                                                   + ", ".join(_IGNORED_ARGUMENTS))


def from_pretrained(model_class: type, pretrained_model_name_or_path: str | os.PathLike, context: Any,
                    *model_args: Any, config: Any = None, **kwargs: Any) -> nn.Module:
    """Build ``model_class`` from a local ``save_pretrained`` directory inside the open ``context`` (a
    :class:`~chunkmem.ZeroInitContext`) and load its safetensors weights straight into the chunks
    (module docstring). Inside the context, ``model_class.from_pretrained(path, ...)`` calls this.

    Args:
        model_class: a ``transformers.PreTrainedModel`` subclass or an ``AutoModel*`` class.
        pretrained_model_name_or_path: a local directory (no download can happen).
        context: the open ZeroInitContext the model is built in.
        config: a config to use instead of the directory's ``config.json``.
        kwargs: config attributes to override (as transformers does), ``attn_implementation``, ``dtype``
            (``None``, ``"auto"`` or the context's dtype); ``local_files_only`` and a few other loading
            switches are accepted and ignored.
    Returns the model in eval mode, as transformers returns it.
    """
    transformers = _transformers()
    if not isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
        raise ArgumentTypeError("pretrained_model_name_or_path", pretrained_model_name_or_path,
                                "a local directory (str or os.PathLike)")
    directory = os.fspath(pretrained_model_name_or_path)
    if not os.path.isdir(directory):
        raise InvalidArgumentError("pretrained_model_name_or_path", directory,
                                   "an existing local directory written by save_pretrained (nothing is downloaded)")
    files = checkpoint_files(directory)
    if config is None:
        config = transformers.AutoConfig.from_pretrained(directory)
    else:
        check_type("config", config, transformers.PretrainedConfig, "None or a transformers.PretrainedConfig")
    _split_kwargs(config, kwargs, context)
    from transformers.initialization import no_init_weights

    with no_init_weights():
        if issubclass(model_class, nn.Module):
            model = model_class(config, *model_args)
        else:  # an AutoModel* class
            model = model_class.from_config(config, *model_args)
    model.tie_weights()  # no_init_weights skipped it (post_init ties through init_weights)
    loaded = load_checkpoint_into(model, files)
    _init_missing(model, loaded)
    generation = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.eval()
    return model


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict key of ``model`` and the parameter or buffer it names (tied parameters under each
    of their names)."""
    return dict(model.state_dict(keep_vars=True))


def _resolve(key: str, targets: dict[str, torch.Tensor], prefix: str) -> str | None:
    """The model's key for a checkpoint key: itself, or with the base-model prefix added or removed
    (a ``GPT2Model`` checkpoint into ``GPT2LMHeadModel`` and back), as transformers does."""
    if key in targets:
        return key
    if prefix and f"{prefix}.{key}" in targets:
        return f"{prefix}.{key}"
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in targets:
        return key[len(prefix) + 1:]
    return None


def load_checkpoint_into(model: nn.Module, files: list[str]) -> set[int]:
    """Write the tensors of ``files`` (safetensors, read one file and one tensor at a time) into the
    chunk-managed parameters and the buffers of ``model`` (built inside a ZeroInitContext that is still
    open). Returns the ids of the parameters and buffers written. A checkpoint tensor of the wrong shape
    raises :class:`~chunkmem.InvalidArgumentError` naming the key; keys the model lacks are ignored."""
    targets = _targets(model)
    prefix = getattr(model, "base_model_prefix", "")
    written: set[int] = set()
    for path in files:
        with safe_open(path) as handle:
            for key in handle.keys():
                name = _resolve(key, targets, prefix)
                if name is None:
                    continue
                target = targets[name]
                value = handle.get_tensor(key)
                if tuple(value.shape) != tuple(target.shape):
                    raise InvalidArgumentError(f"checkpoint tensor {key!r} of shape", tuple(value.shape),
                                               f"the model's shape {tuple(target.shape)} ({os.path.basename(path)})")
                _write(target, value)
                written.add(id(target))
                del value
    return written


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    slot = slot_of(target)
    with torch.no_grad():
        if slot is None:  # a buffer, or a parameter outside chunks
            with torch._C.DisableTorchFunctionSubclass():
                target.data.copy_(value)
            return
        chunk = slot.chunk
        local = chunk.param.shard.tensor if chunk.param.shard_valid else chunk.param.device
        chunk.write_own_part(slot, local, value)


def _init_missing(model: nn.Module, written: set[int]) -> None:
    """Initialise, with the model's own ``_init_weights``, the modules whose parameters the checkpoint
    lacked (loaded parameters are flagged so transformers' init functions leave them alone), with a
    warning naming them."""
    missing = [name for name, p in model.named_parameters() if id(p) not in written]
    if not missing:
        return
    warnings.warn(f"from_pretrained: {len(missing)} parameters are not in the checkpoint and were initialised by "
                  f"{type(model).__name__}._init_weights: {missing[:8]}", stacklevel=3)
    missing_modules = []
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None]
        if any(id(p) not in written for p in params):
            missing_modules.append(module)
        for p in params:
            if id(p) in written:
                p._is_hf_initialized = True
    for module in missing_modules:
        model._init_weights(module)


# ---- ZeroInitContext: from_pretrained while the context is open -------------------------------------

@contextlib.contextmanager
def patched_from_pretrained(context: Any) -> Iterator[None]:
    """While open, ``PreTrainedModel.from_pretrained`` and the ``AutoModel*`` classes' ``from_pretrained``
    load into chunks through :func:`from_pretrained` with ``context``. Does nothing unless transformers
    has been imported."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers import modeling_utils
    from transformers.models.auto import auto_factory

    def load(cls: type, path: Any, *args: Any, **kwargs: Any) -> nn.Module:
        return from_pretrained(cls, path, context, *args, **kwargs)

    bases = (modeling_utils.PreTrainedModel, auto_factory._BaseAutoModelClass)
    patched: list[tuple[type, Any]] = []
    for base in bases:
        for cls in _with_subclasses(base):  # AutoModel* classes carry their own copy of from_pretrained
            if "from_pretrained" in cls.__dict__:
                patched.append((cls, cls.__dict__["from_pretrained"]))
                cls.from_pretrained = classmethod(load)
    try:
        yield
    finally:
        for cls, original in patched:
            cls.from_pretrained = original
        # An AutoModel* class that transformers built while the context was open copied the patched
        # method (it copies its base's): give it its base's original back.
        for base, original in ((b, o) for b, o in patched if b in bases):
            for cls in _with_subclasses(base):
                method = cls.__dict__.get("from_pretrained")
                function = getattr(method, "__func__", method)
                if getattr(function, "__code__", None) is load.__code__:
                    cls.from_pretrained = original


def _with_subclasses(base: type) -> list[type]:
    found, todo = [base], [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


# ---- saving -----------------------------------------------------------------------------------------

def _saved_keys(module: nn.Module) -> dict[str, torch.Tensor]:
    """The keys ``save_pretrained`` writes and their tensors: a tied parameter once (under the name
    transformers keeps: not a key in ``all_tied_weights_keys``' targets), ``_keys_to_ignore_on_save``
    left out."""
    tied_targets = set(getattr(module, "all_tied_weights_keys", None) or {})
    ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    state = module.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for key, value in state.items():
        if key not in ignored:
            by_tensor.setdefault(id(value), []).append(key)
    keys = {}
    for names in by_tensor.values():
        kept = [n for n in names if n not in tied_targets] or names
        keys[kept[0]] = state[kept[0]]
    return {k: v for k, v in state.items() if k in keys}


def _shard_plan(items: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in items:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _module_to_save(model: Any, module: nn.Module | None) -> nn.Module:
    """:func:`save_pretrained`'s ``model`` and ``module`` checked: the transformers model it saves."""
    transformers = _transformers()
    if not (isinstance(model, nn.Module) and callable(getattr(model, "full_values", None))):
        raise ArgumentTypeError("model", type(model).__name__, "a chunkmem.ShardedModelV2 wrapping a transformers model")
    if module is None:
        check_type("model.module", model.module, transformers.PreTrainedModel,
                   "a transformers.PreTrainedModel (or pass module=, the one inside it to save)")
        return model.module
    check_type("module", module, transformers.PreTrainedModel, "None or a transformers.PreTrainedModel")
    if not any(m is module for m in model.module.modules()):
        raise InvalidArgumentError("module", type(module).__name__, "None or a submodule of model.module")
    return module


def _prepare_directory(module: nn.Module, directory: str) -> None:
    """The writing process: the directory made, an earlier save's weights removed (they would be loaded
    too), the config (fp32) and generation config written."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name == INDEX_NAME or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(directory, name))
    module.config.dtype = "float32"
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(directory)
    if module.can_generate() and getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(directory)


def save_pretrained(model: Any, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                    is_main_process: bool | None = None, module: nn.Module | None = None) -> list[str]:
    """Write a :class:`~chunkmem.ShardedModelV2` wrapping a ``transformers.PreTrainedModel`` as
    ``save_pretrained`` does (module docstring), streaming: the chunks are gathered one at a time (a
    collective when sharded: every rank calls this) and a safetensors file is written as soon as all
    its tensors are gathered, so at most one file's tensors and one chunk are held at once. Tensors are
    fp32 (``config.dtype`` says so). ``max_shard_size``: bytes per file (an int or ``"5GB"``-style
    str); a tensor larger than that gets a file of its own. ``is_main_process`` (default: rank 0)
    writes. ``module``: the transformers model to save when the wrapped module only contains one (a
    training wrapper around ``GPT2LMHeadModel``); default ``model.module``. Returns the weight files
    written (empty on other ranks)."""
    from safetensors.torch import save_file

    module = _module_to_save(model, module)
    check_type("save_directory", save_directory, (str, os.PathLike), "a directory path")
    max_bytes = parse_size(max_shard_size, "max_shard_size", minimum=1)
    if is_main_process is None:
        is_main_process = model.data_parallel.rank == 0
    check_type("is_main_process", is_main_process, bool, "None, True or False")
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise InvalidArgumentError("save_directory", directory, "a directory (this is a file)")
    saved = _saved_keys(module)
    key_of = {id(v): k for k, v in saved.items()}
    # chunk order, then the buffers: the order tensors become available
    ordered: list[tuple[str, torch.Tensor]] = []
    for chunk in model.chunks:
        ordered.extend((key_of[id(s.param)], s.param) for s in chunk.slots if id(s.param) in key_of)
    placed = {k for k, _ in ordered}
    ordered.extend((k, v) for k, v in saved.items() if k not in placed)
    shards = _shard_plan([(k, v.numel() * 4 if slot_of(v) is not None else v.numel() * v.element_size())
                          for k, v in ordered], max_bytes)
    names = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {key: names[i] for i, keys in enumerate(shards) for key in keys}
    if is_main_process:
        _prepare_directory(module, directory)
    pending: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    written: list[str] = []

    def flush() -> None:
        for i, keys in enumerate(shards):
            name = names[i]
            if name in pending and len(pending[name]) == len(keys):
                if is_main_process:
                    save_file(pending[name], os.path.join(directory, name), metadata={"format": "pt"})
                    written.append(os.path.join(directory, name))
                del pending[name]

    for chunk in model.chunks:
        if not any(id(s.param) in key_of for s in chunk.slots):
            continue  # nothing to save here (the same on every rank: no gather)
        full = model.full_values(chunk)  # collective when sharded, in chunk order on every rank
        for slot in chunk.slots:
            key = key_of.get(id(slot.param))
            if key is not None and is_main_process:
                pending[file_of[key]][key] = slot.view(full).clone().contiguous()
            elif key is not None:
                pending[file_of[key]][key] = torch.empty(0)  # counted, never written
        del full
        flush()
    for key, value in saved.items():
        if slot_of(value) is None:  # buffers
            pending[file_of[key]][key] = value.detach().to("cpu", copy=True).contiguous()
    flush()
    if is_main_process and len(names) > 1:
        total = sum(v.numel() * 4 if slot_of(v) is not None else v.numel() * v.element_size() for v in saved.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        with open(os.path.join(directory, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    return written

