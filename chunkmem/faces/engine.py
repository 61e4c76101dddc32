"""The training engine: DeepSpeed's engine loop (what :func:`chunkmem.deepspeed.initialize` returns) and
ColossalAI's ``Engine`` loop shape (what :func:`chunkmem.initialize_engine` returns) over a chunkmem model
and optimizer.

One micro-batch is ``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``. The engine
divides each loss by ``gradient_accumulation_steps`` before its backward, and its :meth:`step` steps the
optimizer only at an accumulation boundary (every ``gradient_accumulation_steps``-th call); there the
optimizer clips (the config's ``gradient_clipping``), updates and releases the gradients, the learning-rate
schedule advances unless the step was skipped for an overflow, and ``global_steps`` counts one. Checkpoints
are directories per tag under ``save_dir`` with a ``latest`` file naming the last one, as DeepSpeed writes
them (:mod:`chunkmem.faces.engine_checkpoints`); what is inside is chunkmem's (see :meth:`TrainingEngine.save_checkpoint`).
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..configs.reading import read_config
from .config import initialize as wrap
from ..core.param_guard import ParameterAccessError, slot_of
from ..core.tiers import Tier, device_of_tier
from ..distributed.collectives import ShardGroup
# the checkpoint directory's names, importable from here as before they moved to engine_checkpoints
from .engine_checkpoints import ENGINE_ENVELOPE, ENGINE_FORMAT, ENGINE_STATE, LATEST  # noqa: F401
from .engine_checkpoints import barrier, check_dir, check_tag, open_tag, write_tag
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedOperationError, check_type
from ..io.checkpoint import load_checkpoint, save_checkpoint
from ..model.sharded_model import ShardedModelV2
from ..storage.atomic_file import write_atomically
from ..configs.loop_settings import LoopSettings

__all__ = ["TrainingEngine", "initialize_engine"]


def _refuse_sharded_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """``engine.module.state_dict()`` at stage 3 with the parameters sharded over ranks (a pre-hook the
    engine registers on the user's module there): each rank holds only its shard, which DeepSpeed's
    ``state_dict`` returns as empty tensors without a word. Refused here, before any value is read, naming
    the ways to the whole weights, unless every sharded parameter is gathered now (inside
    ``GatheredParameters``). ``keep_vars=True`` reads nothing and passes (the wrapper's own ``state_dict``
    takes the parameter objects that way)."""
    if keep_vars:
        return
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        slot = slot_of(param)
        chunk = None if slot is None else slot.chunk
        host = None if chunk is None else chunk.host
        if host is None or not chunk.param.sharded or host.in_forward or host.is_open(chunk, for_writing=False):
            continue
        raise ParameterAccessError(
            f"engine.module.state_dict() at ZeRO stage 3 with the parameters sharded over {chunk.param.shards.world} "
            f"ranks: this rank holds only its shard of {name!r} (DeepSpeed returns empty tensors here). For the whole "
            "weights, every rank calls one of: engine.save_16bit_model(save_dir) (rank 0 writes them in the training "
            "dtype); engine.sharded_model.state_dict() (fp32, gathered a chunk at a time; rank0_only=True keeps it "
            "on rank 0 only); or `with deepspeed.zero.GatheredParameters(list(engine.module.parameters())): state = "
            "engine.module.state_dict()` (its tensors keep the gathered values after the block)")


class TrainingEngine(nn.Module):
    """The training engine over a chunkmem model (see the module docstring).

    Built by :func:`chunkmem.deepspeed.initialize` (there also named ``DeepSpeedEngine``) or
    :func:`chunkmem.initialize_engine`, not directly. ``module`` is the user's module at every stage, as in
    DeepSpeed: the object passed in (cast to the configured dtype at stages 1 and 2; at stage 3 its parameters
    are chunk-managed, :class:`~chunkmem.ChunkParameter`), so ``engine.module.named_parameters()`` and
    ``engine.module.state_dict()`` carry the module's own keys and its own methods (``save_pretrained``) are
    there. ``sharded_model`` is the :class:`~chunkmem.ShardedModelV2` wrapping it at stage 3 (``None`` at
    stages 1 and 2): what the engine's forward, backward, step and checkpoints run on, and chunkmem's own
    surface (``memory_stats()``, ``tier_bytes()``, a gathered fp32 ``state_dict()``). Only ``module`` is a
    registered submodule, so ``engine.parameters()`` yields each parameter once and ``engine.state_dict()``
    has DeepSpeed's ``module.``-prefixed keys.

    Reading the weights at stage 3 (see :mod:`chunkmem.core.param_guard`): in one process
    ``engine.module.state_dict()`` returns copies of the current values in the training dtype (fp32 masters
    where they exist: ``engine.sharded_model.state_dict()``). With the parameters sharded over several ranks,
    where DeepSpeed's ``engine.module.state_dict()`` silently returns empty partitioned tensors, chunkmem's
    raises :class:`~chunkmem.ParameterAccessError` naming the ways to the full weights:
    :meth:`save_16bit_model`, ``engine.sharded_model.state_dict()``, or ``engine.module.state_dict()`` inside
    ``deepspeed.zero.GatheredParameters(engine.module.parameters())`` (its tensors keep the gathered values
    after the block); every rank calls each.

    ``optimizer`` is the chunkmem optimizer (``None`` for a model only), ``lr_scheduler`` the schedule
    (``None``: none), stepped at each applied optimizer step where ``steps_schedule`` (DeepSpeed's engine; not
    ColossalAI's, whose loop steps its schedule itself). Counters: ``global_steps`` (optimizer steps,
    skipped ones included), ``global_samples``, ``skipped_steps`` (overflows), ``micro_steps`` (calls of
    :meth:`step`). ``criterion``: the loss function given to :func:`chunkmem.initialize_engine`
    (ColossalAI's ``engine.criterion``), else ``None``.
    """

    def __init__(self, module: nn.Module, optimizer: Any, lr_scheduler: Any, loop: LoopSettings, stage: int,
                 training_dataloader: Any = None, criterion: Any = None, steps_schedule: bool = True) -> None:
        super().__init__()
        sharded = module if isinstance(module, ShardedModelV2) else None
        # the wrapper is kept out of the submodules: registered beside the user's module, every parameter would
        # come twice from engine.parameters() (and state_dict() would hold each key twice)
        self.__dict__["_sharded_model"] = sharded
        self.module = sharded.module if sharded is not None else module
        if sharded is not None and sharded.shards.world > 1:
            self.module.register_state_dict_pre_hook(_refuse_sharded_state_dict)
        self.criterion = criterion
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.steps_schedule = steps_schedule
        self._saves = 0  # save_checkpoint calls so far (names the directory a save writes before it is swapped in)
        self.training_dataloader = training_dataloader
        self._loop = loop
        self._stage = stage
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._boundary_override: bool | None = None
        self._step_applied = False
        self._in_no_sync = False
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    # ---- what the config says ------------------------------------------------------------------------

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks (``None``: the config does not say)."""
        return self._loop.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per forward on this rank (``None``: the config does not say)."""
        return self._loop.micro_batch

    def gradient_accumulation_steps(self) -> int:
        """Backwards per optimizer step."""
        return self._loop.accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (1, 2 or 3)."""
        return self._stage

    def steps_per_print(self) -> int | None:
        return self._loop.steps_per_print

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return ShardGroup.of(None).rank

    @property
    def world_size(self) -> int:
        return ShardGroup.of(None).world

    @property
    def device(self) -> torch.device:
        """Where the forward computes: the GPU of this rank, or the CPU on a machine without one."""
        return device_of_tier(Tier.DEVICE)

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (``False`` after an overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The unscaled gradient norm the last optimizer step computed (before clipping), or ``None``
        where it computed none (no clipping and no loss scaler)."""
        return self._require_optimizer("get_global_grad_norm").global_grad_norm

    def fp16_enabled(self) -> bool:
        return self._dtype() == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self._dtype() == torch.bfloat16

    @property
    def sharded_model(self) -> ShardedModelV2 | None:
        """The :class:`~chunkmem.ShardedModelV2` wrapping :attr:`module` at stage 3 (``None`` at stages 1 and
        2, where the module itself trains): chunkmem's own surface (``memory_stats()``, ``tier_bytes()``,
        ``state_dict()`` gathered in fp32, ``full_parameter(p)``)."""
        return self._sharded_model

    @property
    def _model(self) -> nn.Module:
        """What the loop runs and the checkpoints read and write: the wrapper at stage 3, else the module."""
        return self._sharded_model if self._sharded_model is not None else self.module

    def train(self, mode: bool = True) -> "TrainingEngine":
        """``module.train(mode)`` (``eval()``: ``train(False)``), the wrapper's flag along with it."""
        super().train(mode)
        if self._sharded_model is not None:
            self._sharded_model.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "TrainingEngine":
        # engine.to(...), .half(), .cuda(): at stage 3 refused as the wrapper refuses them (its parameters'
        # dtype and placement belong to chunkmem), as before the user's module became engine.module
        if self._sharded_model is not None:
            self._sharded_model._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def _dtype(self) -> torch.dtype:
        if self._sharded_model is not None:
            return self._sharded_model.dtype
        return next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.float32)

    def get_lr(self) -> list[float]:
        """The learning rate of every param group."""
        return [group["lr"] for group in self._require_optimizer("get_lr").param_groups]

    def get_mom(self) -> list[Any]:
        """The ``betas`` (or ``momentum``) of every param group."""
        return [group.get("betas", group.get("momentum")) for group in
                self._require_optimizer("get_mom").param_groups]

    # ---- the loop ------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward."""
        with self._timed("forward"):
            return self._model(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by ``gradient_accumulation_steps`` (``scale_wrt_gas=False``: as it
        is) through the optimizer's loss scaling; returns the divided loss."""
        optimizer = self._require_optimizer("backward")
        check_type("loss", loss, torch.Tensor, "a scalar torch.Tensor")
        if loss.numel() != 1:
            raise InvalidArgumentError("loss", f"a tensor of shape {tuple(loss.shape)}", "a scalar tensor")
        check_type("scale_wrt_gas", scale_wrt_gas, bool, "True or False")
        if retain_graph is not False:
            raise InvalidArgumentError("retain_graph", retain_graph, "False (a chunkmem backward frees the graph)")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        # step_in_backward: only the backward before the step starts its updates; the others accumulate
        accumulating = not self.is_gradient_accumulation_boundary() and hasattr(optimizer, "accumulating")
        with self._timed("backward"), optimizer.accumulating() if accumulating else contextlib.nullcontext():
            optimizer.backward(loss)
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` steps the optimizer."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the boundary by hand (``None``: back to counting micro steps), as DeepSpeed allows."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ArgumentTypeError("is_boundary", is_boundary, "True, False or None")
        self._boundary_override = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At an accumulation boundary: the optimizer step (clipping, overflow check, update, gradients
        released), then the schedule (``lr_kwargs`` passed to its ``step``) unless the step was skipped
        for an overflow; ``global_steps`` counts one either way. Elsewhere only the micro step counts."""
        optimizer = self._require_optimizer("step")
        if self._in_no_sync:
            raise UnsupportedOperationError("engine.step() inside engine.no_sync(): leave the context first (the "
                                            "gradients of its backwards are not reduced yet)")
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise ArgumentTypeError("lr_kwargs", lr_kwargs, "None or a dict of keyword arguments of the schedule's step")
        with self._timed("step"):
            if self.is_gradient_accumulation_boundary():
                had_gradients = optimizer.grads_pending
                applied = optimizer.step()
                self._step_applied = bool(applied)
                if applied or not had_gradients:
                    if self.lr_scheduler is not None and self.steps_schedule:
                        self._step_schedule(lr_kwargs)
                else:
                    self.skipped_steps += 1
                self.global_steps += 1
                self.global_samples += self.train_batch_size() or 0
                self._report_progress()
        self.micro_steps += 1

    def _step_schedule(self, lr_kwargs: dict[str, Any] | None) -> None:
        with warnings.catch_warnings():
            if getattr(self.lr_scheduler, "optimizer", self.optimizer) is not self.optimizer:
                # a torch schedule over the optimizer chunkmem's wraps, whose own step() never runs: torch's
                # warning that the schedule stepped before the optimizer would be false
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (the optimizer's ``zero_grad``)."""
        self._require_optimizer("zero_grad").zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backwards accumulate without reducing over the ranks; the first backward outside
        reduces the sum (stage 3: ``ShardedModelV2.no_sync``; stages 1, 2: the optimizer's). DeepSpeed
        refuses it at stages 2 and 3; chunkmem has it at every stage. :meth:`step` inside is refused."""
        if self._in_no_sync:
            raise InvalidArgumentError("no_sync", "a nested no_sync()", "one no_sync() at a time")
        if self._sharded_model is not None:
            inner = self._sharded_model.no_sync()
        else:
            inner = self._require_optimizer("no_sync").no_sync()
        self._in_no_sync = True
        try:
            with inner:
                yield
        finally:
            self._in_no_sync = False

    def empty_partition_cache(self) -> None:
        """Give back the memory of chunk buffers kept for reuse (chunkmem's block pool; with CUDA,
        torch's cached blocks too). The model's parameters stay where the placement keeps them."""
        if self._sharded_model is not None:
            self._sharded_model.empty_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save the model, optimizer, schedule, counters and ``client_state`` under ``save_dir/tag``
        (``tag`` default ``global_step{global_steps}``) and, with ``save_latest``, write ``tag`` into
        ``save_dir/latest``. Every rank calls it. Inside the tag directory: stage 3 writes a chunkmem
        sharded checkpoint ``zero/`` (each rank its shards; loads at any world size, resharded, unless the
        config says ``elastic_checkpoint: false``), stages 1 and 2 a full checkpoint ``model_optim.pt``;
        rank 0 writes ``engine_state.pt`` (``torch.save``: counters, schedule state, ``client_state``, with the
        SHA-256 of those bytes, checked at load). One atomic unit per tag: every file is written into a directory
        beside the tag, which replaces the tag only once all are there (a ``client_state`` that does not pickle
        raises :class:`~chunkmem.InvalidArgumentError` before any file is written); ``latest`` is written last.
        A save that fails or is killed leaves the tag as it was (a kill between the two renames of the swap
        leaves the old tag aside, and the next load of it puts it back). Returns ``True``."""
        save_dir = check_dir(save_dir, "save_dir")
        tag = check_tag(f"global_step{self.global_steps}" if tag is None else tag)
        client_state = {} if client_state is None else client_state
        check_type("client_state", client_state, dict, "a dict")
        check_type("save_latest", save_latest, bool, "True or False")
        if exclude_frozen_parameters is not False:
            raise InvalidArgumentError("exclude_frozen_parameters", exclude_frozen_parameters,
                                       "False (chunkmem checkpoints hold every parameter)")
        state = None
        if self.global_rank == 0:
            state = {"format": ENGINE_FORMAT, "global_steps": self.global_steps, "global_samples": self.global_samples,
                     "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps,
                     "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
                     "world_size": self.world_size, "client_state": client_state}
        self._saves += 1
        write_tag(save_dir, tag, f".{tag}.pending-{self._saves}-{self.global_steps}", state,
                  lambda pending: save_checkpoint(self._model_checkpoint_path(pending), self._model, self.optimizer,
                                                  sharded=self._sharded_files), save_latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Load what :meth:`save_checkpoint` wrote under ``load_dir/tag`` (``tag=None``: the one the
        ``latest`` file names; without that file a warning and ``(None, None)``, as DeepSpeed). Returns
        ``(the tag directory, client_state)``. ``load_optimizer_states=False`` or ``load_module_only``
        loads the model's values only (``load_module_only`` also leaves counters and schedule as they
        are); ``load_lr_scheduler_states=False`` leaves the schedule. Every rank calls it; nothing
        changes unless every file checks out."""
        load_dir = check_dir(load_dir, "load_dir")
        for name, value in (("load_optimizer_states", load_optimizer_states),
                            ("load_lr_scheduler_states", load_lr_scheduler_states),
                            ("load_module_only", load_module_only)):
            check_type(name, value, bool, "True or False")
        if load_module_strict is not True:
            raise InvalidArgumentError("load_module_strict", load_module_strict,
                                       "True (chunkmem loads every parameter and buffer, checked)")
        if custom_load_fn is not None:
            raise InvalidArgumentError("custom_load_fn", custom_load_fn, "None (not supported by chunkmem)")
        opened = open_tag(load_dir, tag)
        if opened is None:
            return None, None
        directory, state = opened
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        if self._stage in (1, 2) and self.optimizer is not None:  # its masters are the module's values
            load_checkpoint(self._model_checkpoint_path(directory), self._model, self.optimizer,
                            elastic=self._loop.elastic_checkpoint, model_only=not with_optimizer)
        else:
            load_checkpoint(self._model_checkpoint_path(directory), self._model,
                            self.optimizer if with_optimizer else None, elastic=self._loop.elastic_checkpoint)
        if not load_module_only:
            self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
            self.skipped_steps, self.micro_steps = state["skipped_steps"], state["micro_steps"]
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return directory, state["client_state"]

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the module's state dict in the training dtype (16-bit with fp16/bf16, else fp32), gathered
        whole, to ``save_dir/save_filename`` with ``torch.save`` (rank 0 writes; every rank calls it). The
        keys are the plain module's; it loads with ``module.load_state_dict``. Returns ``True``."""
        save_dir = check_dir(save_dir, "save_dir")
        check_type("save_filename", save_filename, str, "a file name")
        if exclude_frozen_parameters is not False:
            raise InvalidArgumentError("exclude_frozen_parameters", exclude_frozen_parameters, "False")
        dtype = None if self._sharded_model is None else self._sharded_model.dtype
        state = self._model.state_dict()  # stage 3: the wrapper's, gathered (the module's keys)
        if dtype is not None:
            state = type(state)((k, v.to(dtype) if v.is_floating_point() else v) for k, v in state.items())
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            write_atomically(os.path.join(save_dir, save_filename), lambda f: torch.save(state, f))
        barrier()
        return True

    # ---- helpers -------------------------------------------------------------------------------------

    def _require_optimizer(self, what: str) -> Any:
        if self.optimizer is None:
            raise UnsupportedOperationError(f"engine.{what}() needs an optimizer: pass one to initialize() or give the "
                                            "config an 'optimizer' section")
        return self.optimizer

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        if not self._loop.wall_clock_breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[phase] += time.perf_counter() - start

    def _report_progress(self) -> None:
        every = self._loop.steps_per_print
        if every is None or self.global_steps % every or self.global_rank != 0:
            return
        line = f"[chunkmem] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}"
        if self._loop.wall_clock_breakdown:
            line += " | " + " | ".join(f"{k} {1e3 * v / every:.2f} ms/step" for k, v in self._times.items())
            self._times = dict.fromkeys(self._times, 0.0)
        print(line, flush=True)

    @property
    def _sharded_files(self) -> bool:
        """Whether checkpoints are chunkmem's sharded format (stage 3) or the full one (stages 1, 2)."""
        return self._stage == 3

    def _model_checkpoint_path(self, directory: str) -> str:
        return os.path.join(directory, "zero" if self._sharded_files else "model_optim.pt")


def initialize_engine(model: nn.Module, optimizer: Any = None, criterion: Any = None, config: Any = None,
                      train_dataloader: Any = None, test_dataloader: Any = None,
                      lr_scheduler: Any = None) -> tuple[TrainingEngine, Any, Any, Any]:
    """ColossalAI's ``initialize`` shape: returns ``(engine, train_dataloader, test_dataloader,
    lr_scheduler)`` for the loop ``engine.zero_grad(); out = engine(x); loss = engine.criterion(out, y);
    engine.backward(loss); engine.step()``.

    ``config`` is the ColossalAI form (``{"zero": {"model_config": ..., "optimizer_config": ...}}``, a dict or a
    JSON path), wrapped as :func:`chunkmem.initialize` wraps it (a DeepSpeed config goes to
    :func:`chunkmem.deepspeed.initialize`). Every :meth:`TrainingEngine.step` steps the optimizer (no
    accumulation) and, as ColossalAI's ``Engine.step()``, never the schedule: the loop steps the returned
    ``lr_scheduler`` itself (per step or per epoch). ``lr_scheduler``: ``None``, a schedule, or a callable that
    takes the wrapped optimizer and returns one (a schedule built over the optimizer passed in works too, its
    param groups being the ones read, but torch then warns that the optimizer never stepped). The engine saves and
    loads the schedule's state with its checkpoints. The data loaders are returned as they are."""
    config = read_config(config)
    if "zero" not in config:
        raise InvalidArgumentError("config", sorted(config), "the ColossalAI form {'zero': {...}}; a DeepSpeed config "
                                                             "goes to chunkmem.deepspeed.initialize")
    if criterion is not None and not callable(criterion):
        raise ArgumentTypeError("criterion", type(criterion).__name__, "None or a loss function (a callable)")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and not callable(lr_scheduler):
        raise ArgumentTypeError("lr_scheduler", type(lr_scheduler).__name__,
                                "None, a schedule with step(), or a callable making one from the optimizer")
    module, optim = wrap(model, optimizer, config)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optim)
    engine = TrainingEngine(module, optim, lr_scheduler, LoopSettings(None, None, 1), 3, train_dataloader, criterion,
                            steps_schedule=False)
    return engine, train_dataloader, test_dataloader, lr_scheduler
