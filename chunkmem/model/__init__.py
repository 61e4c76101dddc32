"""The wrapped model: :class:`~chunkmem.ShardedModelV2`, the ``nn.Module`` face the optimizers, checkpoints and
planner take (``sharded_model``), its construction (``builder``: every check, the layout, the chunks, the
memory and the runtime, built once) and what it passes through for its module (``module_face``: the
forward's signature, the 16-bit casts of inputs and outputs). It sits under :mod:`chunkmem.optim`, which
steps it, so it is not among :mod:`chunkmem.faces`."""
