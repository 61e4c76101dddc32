"""Hugging Face ``Trainer`` and Accelerate over chunkmem's stage-3 model and optimizer.

:func:`chunkmem.initialize` at ZeRO stage 3 returns a :class:`~chunkmem.ShardedModelV2` and a
:class:`~chunkmem.ShardedOptimizerV2`, which behave as a plain module and a torch optimizer where these
libraries look: the module's forward signature and attributes (``config``, ``save_pretrained``...),
``train()``/``eval()``, ``zero_grad()``, ``.to(the compute device)``, ``state_dict()``/``load_state_dict()``
of both, ``param_groups`` for any schedule, ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``. Two
classes cover the rest:

* :class:`ChunkmemTrainer`, a ``transformers.Trainer``. ``save_model`` and every checkpoint write the
  gathered weights with the wrapped model's ``save_pretrained`` (``config.json``, tied weights once), so
  ``from_pretrained`` loads them; the plain ``Trainer`` writes a bare ``model.safetensors`` for a module that
  is not a ``PreTrainedModel`` and fails on tied weights (safetensors refuses shared tensors). The label
  names come from the wrapped module's class (a PEFT model's base model). Every rank takes part in the gathers a save needs. With
  ``optimizers=(None, None)`` the optimizer ``Trainer`` builds is wrapped in a ``ShardedOptimizerV2``. Its
  Accelerator is a :class:`ChunkmemAccelerator`.
* :class:`ChunkmemAccelerator`, an ``accelerate.Accelerator``. A chunkmem model is neither moved nor wrapped
  in ``DistributedDataParallel`` under ``torchrun``: chunkmem places the chunks and averages the gradients
  over the ranks itself, and DDP's first broadcast would read parameters that exist only as shards. The
  optimizer is wrapped without Accelerate's device placement (which would gather the whole state once just
  to load it back). An fp16 model's backward goes through the optimizer's loss scaling
  (``ShardedOptimizerV2.backward``) and a step the scaler skips is reported as skipped, so ``Trainer`` does
  not advance the schedule on it.

Refused around a chunkmem model, with :class:`~chunkmem.UnsupportedOperationError` naming the alternative:
Accelerate's or ``Trainer``'s mixed precision (``fp16=``/``bf16=``: chunkmem chooses the dtype, in its
config), ``torch.compile``, DeepSpeed, FSDP, Megatron, XLA and tensor/context parallelism (chunkmem shards
the model). The ZeRO-1/2 ``LowLevelZeroOptimizer`` is refused by both classes for now (not a
``torch.optim.Optimizer``: Accelerate leaves it unprepared, ``save_state`` would miss its state and
``torchrun`` would put DDP over its own reduction); use stage 3.

Importing this module imports ``transformers`` and ``accelerate``.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from transformers import Trainer
from transformers.utils import can_return_loss, find_labels

from ..errors import UnsupportedOperationError
from ..model.sharded_model import ShardedModelV2
from ..optim.closure import run_closure
from ..optim.low_level_zero import LowLevelZeroOptimizer
from ..optim.sharded_optimizer import ShardedOptimizerV2

__all__ = ["ChunkmemAccelerator", "ChunkmemTrainer"]

OPTIMIZER_NAME = "optimizer.pt"  # the file names Trainer resumes from (transformers.trainer's constants)
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"

_STAGES_1_2 = ("chunkmem's ZeRO-1/2 LowLevelZeroOptimizer under ChunkmemTrainer / ChunkmemAccelerator: not supported "
               "yet. It is not a torch.optim.Optimizer, so Accelerate does not prepare it (save_state would leave "
               "its state out; under torchrun the module would be wrapped in DistributedDataParallel on top of "
               "its own gradient reduction) and Trainer saves its state from rank 0 alone (its state_dict() "
               "gathers over the ranks). Use stage 3 (zero_optimization.stage 3), which these classes drive")


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer an ``AcceleratedOptimizer`` wraps (``optimizer`` itself otherwise)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class ChunkmemAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around a :class:`~chunkmem.ShardedOptimizerV2`: no device placement
    (the state lives in chunks, where chunkmem put it; Accelerate's placement would gather it all once just
    to load it back), and ``step_was_skipped`` is true after a step the fp16 loss scaler skipped."""

    def __init__(self, optimizer: ShardedOptimizerV2) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)

    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step when the gradients are synchronised (the last micro-batch of an
        accumulation); ``closure``, when given, is run first with autograd on, as torch's optimizers do,
        and its loss returned."""
        if not self.gradient_state.sync_gradients:
            return None
        loss = run_closure(closure)
        pending = self.optimizer.grads_pending
        stepped = self.optimizer.step()
        self._is_overflow = pending and not stepped  # gradients there but not applied: the scaler skipped
        return loss


class ChunkmemAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that prepares chunkmem's stage-3 model and optimizer as they need.

    ``prepare(model, optimizer, loader, scheduler)`` returns the :class:`~chunkmem.ShardedModelV2` as it
    is (registered, so ``save_state``/``load_state``/``get_state_dict`` see it): no
    ``DistributedDataParallel`` (chunkmem reduces the gradients over the ranks itself: mean, as DDP),
    no ``.to(device)`` (chunkmem places the chunks). The optimizer is wrapped without device placement.
    The data loader and the scheduler are prepared as usual, so each rank gets its share of the batches.
    Every other model and optimizer is prepared as ``Accelerator`` does.

    ``backward(loss)`` runs the chunkmem optimizer's scaled backward when the model is fp16 (bf16 and
    fp32: ``loss.backward()``, as ``Accelerator``); ``clip_grad_norm_(model.parameters(), c)`` is torch's
    over the chunk-managed parameters.

    With one process a plain ``Accelerator`` works as well; under ``torchrun`` use this one (the only
    line that changes), with every rank calling what gathers (``get_state_dict``, ``save_state``).
    """

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        if any(isinstance(_inner_optimizer(arg), LowLevelZeroOptimizer) for arg in args):
            raise UnsupportedOperationError(_STAGES_1_2)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if not isinstance(model, ShardedModelV2):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._refuse_around_chunkmem("a chunkmem model")
        # evaluation_mode: Accelerate's way of preparing a model without DDP/FSDP (it only applies mixed
        # precision and torch.compile, both refused above); the chunks are placed by chunkmem.
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if not isinstance(optimizer, ShardedOptimizerV2):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        for prepared in self._optimizers:
            if prepared is optimizer or _inner_optimizer(prepared) is optimizer:
                return prepared
        self._refuse_around_chunkmem("chunkmem's optimizer")
        prepared = ChunkmemAcceleratedOptimizer(optimizer)
        self._optimizers.append(prepared)
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        scaled = [o for o in map(_inner_optimizer, self._optimizers)
                  if isinstance(o, ShardedOptimizerV2) and o.grad_scaler is not None]
        if not scaled:
            return super().backward(loss, **kwargs)
        if len(scaled) > 1 or kwargs:
            raise UnsupportedOperationError(
                "Accelerator.backward with several fp16 chunkmem optimizers prepared, or with backward arguments "
                f"({sorted(kwargs)}): call the right optimizer's optim.backward(loss) yourself")
        scaled[0].backward(loss / self.gradient_accumulation_steps)

    def _refuse_around_chunkmem(self, what: str) -> None:
        """What Accelerate would wrap around a chunkmem model and that chunkmem does itself."""
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                                     DistributedType.XLA):
            raise UnsupportedOperationError(
                f"preparing {what} with Accelerate's {self.distributed_type.value}: chunkmem already shards the model "
                f"(ZeRO-3); launch without a DeepSpeed/FSDP/Megatron plugin (plain torchrun or accelerate launch)")
        if self.mixed_precision != "no":
            raise UnsupportedOperationError(
                f"preparing {what} with Accelerate's mixed precision ({self.mixed_precision!r}): chunkmem chooses the "
                f"compute dtype and keeps fp32 masters itself; set it in chunkmem's config (\"bf16\": {{\"enabled\": "
                f"true}} or \"fp16\") and leave mixed_precision 'no' (Trainer: no fp16=/bf16= arguments)")
        dynamo = getattr(getattr(self.state, "dynamo_plugin", None), "backend", None)
        if dynamo is not None and str(getattr(dynamo, "value", dynamo)).lower() != "no":
            raise UnsupportedOperationError(
                f"preparing {what} with torch.compile ({dynamo}): chunkmem's hooks fetch each module's chunks as it "
                f"runs; train without torch_compile / dynamo_backend")
        if getattr(self, "parallelism_config", None) is not None:
            raise UnsupportedOperationError(
                f"preparing {what} with a ParallelismConfig (tensor, context or sequence parallelism): chunkmem's "
                f"ZeRO-3 is data parallel only; remove parallelism_config")


class ChunkmemTrainer(Trainer):
    """``transformers.Trainer`` for the model and optimizer :func:`chunkmem.initialize` returns at stage 3::

        model, optim = chunkmem.initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-5), config)
        trainer = ChunkmemTrainer(model=model, args=args, train_dataset=train,
                                  optimizers=(optim, get_linear_schedule_with_warmup(optim, 100, 1000)))

    ``optimizers=(None, None)`` (``Trainer``'s own optimizer and schedule from ``args``) works too: the
    optimizer ``Trainer`` builds over the model's parameters is wrapped in a
    :class:`~chunkmem.ShardedOptimizerV2` (no clipping of its own: ``max_grad_norm`` clips).

    Differences from ``Trainer``, all about a chunkmem model (any other model trains as under ``Trainer``):

    * ``save_model`` and the checkpoints write the model with the wrapped module's ``save_pretrained``
      (``config.json`` and safetensors, tied weights once) and the weights gathered from the chunks
      (fp32, from the fp32 masters), so ``from_pretrained`` loads them and ``resume_from_checkpoint``
      continues bit for bit; every rank takes part in the gathers (call ``save_model`` on every rank,
      as with DeepSpeed);
    * the optimizer state is gathered on every rank and written once (torch's AdamW layout);
    * its Accelerator is a :class:`ChunkmemAccelerator`: under ``torchrun`` (``TrainingArguments(use_cpu=
      True)`` on CPUs, gloo) the model is not wrapped in ``DistributedDataParallel``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.optimizer, LowLevelZeroOptimizer):
            raise UnsupportedOperationError(_STAGES_1_2)
        if isinstance(self.model, ShardedModelV2):
            # Trainer reads the label names off the model's class; read them off the wrapped module's (for a
            # PeftModel, whose forward takes **kwargs, off its base model's), as for the plain model.
            module = self.model.module
            module = module.get_base_model() if hasattr(module, "get_base_model") else module  # a PeftModel
            if self.args.label_names is None:
                self.label_names = find_labels(type(module))
            self.can_return_loss = can_return_loss(type(module))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer builds a plain Accelerator itself; make it this module's subclass (the same object and
        # state: the subclass only adds how a chunkmem model and optimizer are prepared).
        if type(self.accelerator) is Accelerator:
            self.accelerator.__class__ = ChunkmemAccelerator
        elif not isinstance(self.accelerator, ChunkmemAccelerator):
            raise UnsupportedOperationError(
                f"ChunkmemTrainer with an Accelerator of class {type(self.accelerator).__name__}: it needs "
                f"accelerate.Accelerator to make it a ChunkmemAccelerator")

    def create_optimizer(self, model: Any = None) -> Any:
        """``Trainer``'s optimizer (from ``args``) and, for a chunkmem model, chunkmem's step around it."""
        if self.optimizer is not None or not isinstance(self.model, ShardedModelV2):
            return super().create_optimizer(model)
        optimizer = super().create_optimizer(model)
        self.optimizer = ShardedOptimizerV2(self.model, _inner_optimizer(optimizer))
        return self.optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not isinstance(self.model, ShardedModelV2):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is None:  # a gather of every chunk: every rank is here (Trainer calls save_model on all)
            state_dict = self.model.state_dict(rank0_only=True)
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        module = self.model.module
        if hasattr(module, "save_pretrained"):  # a PreTrainedModel, a PeftModel: config and weights
            module.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        else:  # a plain module: its weights, each tensor once (tied parameters share one value)
            import safetensors.torch

            unique: dict[str, torch.Tensor] = {}
            seen: set[int] = set()
            for key, value in state_dict.items():
                if id(value) not in seen:
                    seen.add(id(value))
                    unique[key] = value.contiguous()
            safetensors.torch.save_file(unique, os.path.join(output_dir, "model.safetensors"),
                                        metadata={"format": "pt"})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = _inner_optimizer(self.optimizer)
        if not isinstance(optimizer, ShardedOptimizerV2):
            return super()._save_optimizer_and_scheduler(output_dir)
        state = optimizer.state_dict(rank0_only=True)  # gathers the moments: every rank calls it
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*save or load the state of the optimizer.*")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
