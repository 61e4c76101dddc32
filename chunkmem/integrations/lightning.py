"""chunkmem as a Lightning strategy: ``L.Trainer(strategy=ChunkmemStrategy(config), ...)``.

The LightningModule stays as it is: ``configure_optimizers`` returns a torch optimizer (and optionally
learning-rate schedulers), ``training_step`` computes a loss. When the Trainer sets up the optimizers,
the strategy passes the module and that optimizer to :func:`chunkmem.initialize` with ``config`` (the
DeepSpeed or the ColossalAI form, a dict or the path of a JSON file):

* at ZeRO stage 3 (and in the ColossalAI form) the LightningModule is wrapped in a
  :class:`~chunkmem.ShardedModelV2` and the optimizer in a :class:`~chunkmem.ShardedOptimizerV2`. Every
  ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` enters through the wrapper's
  forward (Lightning's forward redirection: the module's ``forward`` is pointed at the step for one
  call), so each step is one iteration of chunkmem's runtime, whose hooks fetch every submodule's chunks
  as ``self(...)`` and the submodules run;
* at stages 1 and 2 the module stays a plain module (cast to the configured dtype) and the optimizer
  becomes a :class:`~chunkmem.LowLevelZeroOptimizer`.

The model is never wrapped in DistributedDataParallel: chunkmem reduces the gradients itself, over the
default ``torch.distributed`` group that Lightning creates. The backward goes through the chunkmem
optimizer's ``backward`` (it scales the loss with fp16), the Trainer's ``gradient_clip_val`` through
:meth:`ShardedOptimizerV2.clip_grad_norm` (torch's formula, ``min(1, max_norm / (norm + 1e-6))``), and
checkpoints hold the full model state (gathered from the chunks, fp32 masters) and the full optimizer
state in torch's layout, so ``trainer.fit(model, ckpt_path=...)`` resumes exactly, at any number of
processes. See ``ChunkmemStrategy`` for what is refused and why.

Only this module of chunkmem imports Lightning (``lightning.pytorch``).
"""
from __future__ import annotations

import copy
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..configs.reading import read_config
from ..faces.config import initialize
from ..errors import InvalidArgumentError, UnsupportedOperationError
from ..model.sharded_model import ShardedModelV2
from ..optim.low_level_zero import LowLevelZeroOptimizer, optimizer_of
from ..optim.sharded_optimizer import ShardedOptimizerV2

__all__ = ["ChunkmemStrategy", "ChunkmemPrecision"]

_WRAPPER_ATTR = "_chunkmem_lightning_wrapper"  # on the LightningModule: the ShardedModelV2 that holds it


def _is_stage3(config: dict[str, Any]) -> bool:
    """Whether ``config`` wraps the module in a ShardedModelV2 (ColossalAI form, or DeepSpeed stage 3)."""
    if "zero" in config:
        return True
    zero = config.get("zero_optimization")
    return isinstance(zero, Mapping) and zero.get("stage") == 3


def _plain_optimizer(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ChunkmemPrecision(Precision):
    """The precision plugin of :class:`ChunkmemStrategy` (set by it; not for other strategies).

    The dtype comes from the chunkmem config (``fp16`` / ``bf16``), not from ``Trainer(precision=...)``:
    the backward is the chunkmem optimizer's (loss scaling with fp16), the step is its step (unscale,
    overflow check, clipping folded into the update), clipping by norm is its ``clip_grad_norm``."""

    precision = "32-true"  # what Lightning reports; the chunkmem config decides the compute dtype

    def __init__(self) -> None:
        super().__init__()
        self._optimizer: Any = None  # chunkmem's optimizer, once the strategy built it
        self._input_dtype: torch.dtype | None = None  # stages 1, 2 in 16 bits: floating inputs cast to it

    # ---- what the strategy tells it ----------------------------------------------------------------

    def attach(self, optimizer: Any, input_dtype: torch.dtype | None) -> None:
        self._optimizer = optimizer
        self._input_dtype = input_dtype

    def convert_input(self, data: Any) -> Any:
        """At stages 1 and 2 with a 16-bit dtype the module's parameters are 16-bit and it is not wrapped:
        floating inputs are cast to that dtype, as ShardedModelV2 does at stage 3."""
        if self._input_dtype is None:
            return data
        dtype = self._input_dtype
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, data)

    # ---- backward, step, clipping ------------------------------------------------------------------

    def _chunkmem_optimizer(self, what: str) -> Any:
        if self._optimizer is None:
            raise UnsupportedOperationError(f"{what} with ChunkmemStrategy outside trainer.fit (no optimizer is set up)")
        return self._optimizer

    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        optim = self._chunkmem_optimizer("a backward")
        if is_overridden("backward", model):
            rank_zero_warn("ChunkmemStrategy runs the backward through the chunkmem optimizer's backward(loss) "
                           "(loss scaling with fp16): the LightningModule.backward you overrode is not called")
        if args or kwargs:
            if optim.grad_scaler is not None:
                raise UnsupportedOperationError(
                    f"backward with arguments ({args}, {kwargs}) under ChunkmemStrategy with fp16: the chunkmem "
                    f"optimizer's backward(loss) scales the loss and takes no other argument; call "
                    f"manual_backward(loss) without them")
            tensor.backward(*args, **kwargs)  # unscaled (fp32 / bf16): plain autograd, the hooks take the gradients
            return
        optim.backward(tensor)

    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Run the closure (training_step, backward, clipping) once, then the chunkmem step."""
        if kwargs:
            raise UnsupportedOperationError(
                f"optimizer.step({', '.join(kwargs)}=...) under ChunkmemStrategy: the chunkmem optimizer's step "
                f"takes no argument")
        optim = self._chunkmem_optimizer("optimizer.step()")
        if _plain_optimizer(optimizer) is not optim:
            raise UnsupportedOperationError(
                f"ChunkmemStrategy steps one optimizer, the chunkmem optimizer it built; got {type(optimizer).__name__}")
        closure_result = self._wrap_closure(model, optimizer, closure)
        optim.step()
        return closure_result

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Stage 3: :meth:`ShardedOptimizerV2.clip_grad_norm` (one pass over the chunks, folded into the
        step). Stages 1, 2: torch's ``clip_grad_norm_``, which the LowLevelZeroOptimizer's gradient
        stand-ins serve (unscaled norms over every rank, the factor applied in the store)."""
        optim = self._chunkmem_optimizer("gradient clipping")
        if isinstance(optim, ShardedOptimizerV2):
            optim.clip_grad_norm(float(clip_val))
        else:
            super().clip_grad_by_norm(optim, clip_val)

    # clip_grad_by_value: Lightning's, torch's clip_grad_value_ over the optimizer's parameters, whose
    # gradient stand-ins clamp the gradients where they live (in unscaled units) at every stage


class ChunkmemStrategy(DDPStrategy):
    """Train a LightningModule with chunkmem: ``L.Trainer(strategy=ChunkmemStrategy(config), ...)``.

    Args:
        config: what :func:`chunkmem.initialize` takes: a dict or the path of a JSON file, in the DeepSpeed
            form (``zero_optimization``, ``fp16`` / ``bf16``, ``optimizer``, ``gradient_clipping``) or the
            ColossalAI form (``{"zero": {"model_config": ..., "optimizer_config": ...}}``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, process_group_backend, timeout,
        start_method: as Lightning's ``DDPStrategy`` (``start_method="popen"``, the default, launches the
            other processes by running the script again; ``"spawn"`` and ``"fork"`` work too).

    The base class is Lightning's ``DDPStrategy`` for what chunkmem needs of it and nothing more: its
    launchers (one process per device), the default process group (gloo on CPUs, NCCL on GPUs) that
    chunkmem's collectives use, the distributed sampler, ``reduce`` / ``barrier`` / ``broadcast`` for
    logging and callbacks, and the forward redirection of the ``*_step`` methods through the wrapper's
    forward. Everything DDP itself does is left out: the module is not wrapped in
    ``DistributedDataParallel`` nor moved or converted by Lightning (chunkmem places and casts the
    parameters), and one process runs without any process group.

    What the Trainer's settings become:

    * ``gradient_clip_val``: after the backward, by norm (torch's ``min(1, max_norm / (norm + 1e-6))``)
      through :meth:`ShardedOptimizerV2.clip_grad_norm` at stage 3 and torch's ``clip_grad_norm_`` at stages
      1 and 2, by value (``gradient_clip_algorithm="value"``) through torch's ``clip_grad_value_``: chunkmem's
      gradient stand-ins (``param.grad``) serve torch's idioms on gradients that live in chunks or stores.
      The DeepSpeed form's ``gradient_clipping`` defaults to 1.0 in :func:`chunkmem.initialize`; under
      Lightning an absent key means no clipping unless the Trainer asks, and a config that clips (inside
      the step) while the Trainer clips too is refused.
    * ``accumulate_grad_batches``: several backwards before one step (each backward's gradients are reduced
      as it ends; the sum is kept in fp32 for 16-bit models). A DeepSpeed ``gradient_accumulation_steps``
      that differs from it is refused.
    * ``precision``: only the default (``"32-true"``): the compute dtype is the config's (``fp16`` / ``bf16``
      sections, or ``zero.model_config.dtype``); with a 16-bit dtype the wrapper casts floating inputs to it
      and floating outputs back to fp32.
    * ``configure_optimizers``: one optimizer (any torch optimizer chunkmem steps), or none when the
      DeepSpeed config has an ``optimizer`` section; learning-rate schedulers attached to it work as
      usual (the chunkmem optimizer reads the torch optimizer's param groups at every step).

    After ``fit`` the module stays in chunkmem's hands (as under Lightning's DeepSpeed stage 3), so that
    ``trainer.save_checkpoint`` still has the optimizer state and ``trainer.validate`` / ``test`` /
    ``predict`` reuse the wrapped model: read its weights with ``trainer.strategy.model.state_dict()`` (on
    every rank) or take the plain module back with :meth:`unwrap`. Processes started by
    ``start_method="spawn"`` / ``"fork"`` unwrap at the end of the run, since Lightning hands rank 0's
    plain ``state_dict()`` back to the main process.
    """

    strategy_name = "chunkmem"

    def __init__(self, config: Any, *, accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 parallel_devices: Optional[list[torch.device]] = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen") -> None:
        self.config = copy.deepcopy(read_config(config))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=None, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._failed = False

    # ---- precision: the config's, never Lightning's -----------------------------------------------

    @property
    def precision_plugin(self) -> ChunkmemPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ChunkmemPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is None or isinstance(plugin, ChunkmemPrecision):
            self._precision_plugin = plugin
            return
        if type(plugin) is Precision:  # what Lightning builds for the default precision="32-true"
            self._precision_plugin = ChunkmemPrecision()
            return
        flag = getattr(plugin, "precision", type(plugin).__name__)
        raise InvalidArgumentError(
            "Trainer(precision=...)", flag,
            "'32-true' (the default) with ChunkmemStrategy: the compute dtype is the chunkmem config's (fp16 / bf16 "
            "sections, or zero.model_config.dtype), and chunkmem casts the inputs and keeps fp32 masters itself")

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """None: a ChunkmemStrategy needs its config (DDPStrategy's names stay DDPStrategy's)."""

    # ---- processes -------------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        """The default process group chunkmem reduces over; none for one process (chunkmem then runs as one
        rank, with no collective)."""
        if self.num_nodes * self.num_processes > 1 or _distributed_is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()

    def model_to_device(self) -> None:
        """Stage 3: nothing (chunkmem places the parameters, the device holding only what computes).
        Stages 1 and 2: the plain module goes to this process's device, as under DDP."""
        assert self.model is not None
        if not _is_stage3(self.config) and not isinstance(self.model, ShardedModelV2):
            self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` and ``trainer.init_module()``: at stage 3 the tensors are made on the CPU, not
        on this process's device (chunkmem packs them into chunks and places those; a model made on the
        device would have to fit there whole). Stages 1 and 2: on the device, as under DDP."""
        if not _is_stage3(self.config):
            with super().tensor_init_context(empty_init):
                yield
            return
        with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"):
            yield

    # ---- setup -----------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if getattr(self, "_layer_sync", None) is not None and trainer.state.fn == TrainerFn.FITTING:
            raise UnsupportedOperationError("Trainer(sync_batchnorm=True) with ChunkmemStrategy: not supported")
        wrapper = module.__dict__.get(_WRAPPER_ATTR)
        self._failed = False
        if trainer.state.fn == TrainerFn.FITTING:
            if wrapper is not None:  # fitted before: pack again with the new optimizer (the weights carry over)
                self._unwrap_module(wrapper)
            if any(optimizer_of(p) is not None for p in module.parameters()):
                raise UnsupportedOperationError(
                    "a second fit of a LightningModule trained at ZeRO stage 1 or 2: its parameters stay in the "
                    "first fit's LowLevelZeroOptimizer for good, and a new optimizer cannot take them. Continue "
                    "that training with a fresh module and trainer.fit(module, ckpt_path=...), or use stage 3 "
                    "(a second fit packs the module again)")
            self.model_to_device()
            self.setup_optimizers(trainer)
        else:
            if wrapper is not None:
                self.model = wrapper
            elif _is_stage3(self.config):
                self.model, _ = initialize(module, None, self._config_for(trainer, fitting=False))
                module.__dict__[_WRAPPER_ATTR] = self.model
            else:
                self.model_to_device()
            self.precision_plugin.attach(None, self._input_dtype())
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning builds the LightningModule's optimizer and schedulers; chunkmem wraps the module and that
        optimizer as the config says."""
        super().setup_optimizers(trainer)
        module = self.lightning_module
        if len(self.optimizers) != 1:
            raise UnsupportedOperationError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers: ChunkmemStrategy trains one "
                f"model with one optimizer (use param groups for different hyper-parameters)")
        optimizer = _plain_optimizer(self.optimizers[0])
        if isinstance(optimizer, _MockOptimizer):  # configure_optimizers returned none
            optimizer = None
        model, optim = initialize(module, optimizer, self._config_for(trainer, fitting=True))
        if optim is None:
            raise InvalidArgumentError("configure_optimizers", None,
                                       "an optimizer, or a chunkmem config with an 'optimizer' section")
        if isinstance(model, ShardedModelV2):
            module.__dict__[_WRAPPER_ATTR] = model
        self.model = model
        self.optimizers = [optim]
        self.precision_plugin.attach(optim, self._input_dtype())

    def setup_precision_plugin(self) -> None:
        assert self.model is not None
        self.model, self.optimizers, self.lr_scheduler_configs = self.precision_plugin.connect(
            self.model, self.optimizers, self.lr_scheduler_configs)

    def _input_dtype(self) -> torch.dtype | None:
        """Stages 1 and 2: the 16-bit dtype of the plain module's parameters, which inputs are cast to."""
        if isinstance(self.model, ShardedModelV2):
            return None
        dtypes = {p.dtype for p in self.lightning_module.parameters() if p.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 and torch.float32 not in dtypes else None

    def _config_for(self, trainer: "pl.Trainer", fitting: bool) -> dict[str, Any]:
        """The config with the Trainer's clipping and accumulation checked against it. In the DeepSpeed form
        an absent ``gradient_clipping`` is 0 (:func:`chunkmem.initialize` alone takes DeepSpeed's 1.0): under
        Lightning the Trainer's ``gradient_clip_val`` clips, after the backward; a config that clips too is
        refused (the step would clip again)."""
        config = copy.deepcopy(self.config)
        if not fitting:  # validate / test / predict before any fit: the model only, no optimizer state
            config.pop("optimizer", None)
            config.pop("gradient_clipping", None)
            if isinstance(config.get("zero"), Mapping):
                config["zero"] = {k: v for k, v in config["zero"].items() if k != "optimizer_config"}
            return config
        clip = float(trainer.gradient_clip_val) if trainer.gradient_clip_val else 0.0
        if "zero" in config:
            optimizer_config = config["zero"].get("optimizer_config") or {}
            configured = optimizer_config.get("max_norm", 0.0) if isinstance(optimizer_config, Mapping) else 0.0
            key = "zero.optimizer_config.max_norm"
        else:
            configured = config.setdefault("gradient_clipping", 0.0)  # not chunkmem.initialize's 1.0
            key = "gradient_clipping"
        if clip and configured:
            raise InvalidArgumentError(
                key, configured, f"absent or 0 when Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips "
                                 f"(one clipping, in one place: the Trainer's, or the config's inside the step)")
        steps = config.get("gradient_accumulation_steps") if "zero" not in config else None
        if steps is not None and steps != trainer.accumulate_grad_batches:
            raise InvalidArgumentError(
                "gradient_accumulation_steps", steps,
                f"absent or equal to Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}), which "
                f"decides the accumulation under Lightning")
        return config

    # ---- checkpoints -----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The checkpoint is loaded into the wrapped model and chunkmem's optimizer (fp32 masters exact)."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full module state on rank 0 (fp32 masters where there are), gathered from every rank."""
        optim, wrapper = self._optimizer(), self._wrapper()
        if wrapper is not None:
            return wrapper.state_dict(rank0_only=True)
        if isinstance(optim, LowLevelZeroOptimizer):
            return optim.model_state_dict(self.lightning_module, rank0_only=True)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The full optimizer state in torch's layout on rank 0, gathered from every rank."""
        optimizer = _plain_optimizer(optimizer)
        if isinstance(optimizer, (ShardedOptimizerV2, LowLevelZeroOptimizer)):
            return optimizer.state_dict(rank0_only=True)
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        optim, wrapper = self._optimizer(), self._wrapper()
        if wrapper is not None:
            wrapper.load_state_dict(checkpoint["state_dict"], strict=strict)
        elif isinstance(optim, LowLevelZeroOptimizer):
            optim.load_model_state_dict(self.lightning_module, checkpoint["state_dict"])
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise InvalidArgumentError("checkpoint['optimizer_states']", f"{len(states)} optimizer states",
                                       f"{len(self.optimizers)} (one per optimizer)")
        for optimizer, state in zip(self.optimizers, states):
            _plain_optimizer(optimizer).load_state_dict(state)

    def _optimizer(self) -> Any:
        return _plain_optimizer(self.optimizers[0]) if self.optimizers else None

    def _wrapper(self) -> ShardedModelV2 | None:
        """The ShardedModelV2 that holds the LightningModule (stage 3), if any."""
        module = self.lightning_module
        return None if module is None else module.__dict__.get(_WRAPPER_ATTR)

    # ---- the end ---------------------------------------------------------------------------------

    def unwrap(self) -> nn.Module:
        """Give the LightningModule back as a plain module holding its current weights in fp32 on the CPU
        (:meth:`ShardedModelV2.unwrap`; every rank calls it). The optimizer cannot be used afterwards."""
        wrapper = self._wrapper()
        if wrapper is not None:
            self._unwrap_module(wrapper)
        return self.lightning_module

    def _unwrap_module(self, wrapper: ShardedModelV2) -> None:
        module = wrapper.module
        wrapper.unwrap()
        module.__dict__.pop(_WRAPPER_ATTR, None)
        if self.model is wrapper:
            self.model = module
        self.optimizers, self.lr_scheduler_configs = [], []  # the chunkmem optimizer went with the chunks
        self.precision_plugin.attach(None, None)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """What Lightning's teardown does, without moving the module to the CPU (its parameters are
        chunkmem's); processes started by spawn or fork give the module back plain first (see the class)."""
        wrapper = self._wrapper()
        if wrapper is not None and isinstance(self.launcher, _MultiProcessingLauncher) and not self._failed:
            self._unwrap_module(wrapper)
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
