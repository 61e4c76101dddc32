"""Will it fit? :func:`plan` answers before anything is allocated, per placement policy.

The planner runs chunkmem itself, with both tiers on PyTorch's ``meta`` device: tensors there have
shapes and dtypes but no memory, while every byte count stays exact. The model is built (or copied)
on the meta device and wrapped in a real :class:`~chunkmem.ShardedModelV2` (the same chunk-size search,
packing, capacity check, hooks, tracer, Belady planner and byte ledger as a real run), which then runs
three training iterations on the sample batch, each ``gradient_accumulation_steps`` forward/backward passes
(default 1) and a step: the first pass is traced (the tracer's
:class:`~chunkmem.runtime.tracer.StorageCounter` gives the non-model peak: activations, temporaries,
autograd's gradients), the later ones follow the schedule, and the ledger counts the bytes the last iteration
moves (attention on meta tensors is counted as the fused kernel real devices run, see
:func:`flash_attention_on_meta`). With several passes the gradient sums of the later backwards (16-bit ones
widened to fp32 unless ``grad_accum_dtype`` is the model's dtype) are on the ledger, so the device and host
peaks include them. The optimizer's families (``master`` for 16-bit models, ``exp_avg``, ``exp_avg_sq``, all fp32;
or an 8-bit Adam's codes, block scales and small parameters' moments, with or without fp32 masters: ``optimizer_state``)
cannot run on meta tensors; their bytes come from the policy's own ``optim_on_device`` rule, and the
device capacity the meta run gets is what is left after the optimizer state resting there.

While :func:`plan` runs, chunkmem's tier functions point at the meta device (process-wide): do not
train in another thread meanwhile. :func:`plan` plans one process (no ZeRO-3 sharding over ranks).

:func:`choose` plans every candidate configuration (placements ``cuda``, ``cpu``, ``auto``, ``static``
with offload fractions; the disk tier for the optimizer state and/or the parameters;
``reuse_fp16_shard``) on the same meta runs, for one rank or several (the meta run then shards over a
stand-in process group), checks each against device, host and disk budgets, predicts its seconds per
step with :mod:`chunkmem.plan.cost_model` from a :class:`~chunkmem.plan.machine_profile.MachineProfile` measured on
this machine, and recommends the fastest that fits (:class:`PlanChoice`); a :class:`Candidate` gives the
:class:`~chunkmem.ShardedModelV2` settings it stands for, which ``chunkmem.initialize(..., plan=)`` takes.

The meta run is :mod:`chunkmem.plan.meta_run`, the candidates :mod:`chunkmem.plan.candidates` (their disk tier
:mod:`chunkmem.plan.disk_accounting`), the command
line :mod:`chunkmem.plan.cli`: ``python -m chunkmem.plan --preset gpt2-small --batch-size 8 --seq-len 1024 --device-memory 24GiB``
prints the per-placement table (the presets are :mod:`chunkmem.gpt`'s GPT, the model the benchmarks
train); ``--candidates`` (with ``--host-memory``, ``--disk-memory``, ``--nvme-path``, ``--ranks``,
``--profile``) the candidates with their predicted seconds per step and the recommendation marked;
``--gradient-accumulation-steps`` and ``--grad-accum-dtype`` plan either for training with gradient
accumulation; ``--optimizer-states`` plans 8-bit optimizer state (``fp32``, ``8bit``, ``8bit-bf16``: see
:func:`plan`'s ``optimizer_state``); ``--builder module:function`` plans any model.
"""
from .candidates import Candidate, PlanChoice, choose, format_candidates
from .meta_run import PolicyPlan, format_table, plan

__all__ = ["Candidate", "PlanChoice", "PolicyPlan", "choose", "format_candidates", "format_table", "plan"]
