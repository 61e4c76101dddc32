"""Configurations read into settings: a DeepSpeed JSON config (``deepspeed``: ``zero_optimization``, ``fp16``,
``bf16``, ``data_types``, ``optimizer``, with ``KEY_TABLE``; ``loop_settings``: the training-loop keys) and the
ColossalAI dict (``colossalai``: ``zero.model_config`` / ``zero.optimizer_config``), both through ``reading``
(a dict or a JSON file, the key checks and their errors naming the key path). They build
:class:`~chunkmem.settings.ModelSettings` and :class:`~chunkmem.settings.OptimizerSettings` (and the arguments
of :class:`~chunkmem.LowLevelZeroOptimizer`), never a wrapped model: :func:`chunkmem.initialize` does that. The
faces above read them: :mod:`chunkmem.faces` and :mod:`chunkmem.deepspeed`."""
