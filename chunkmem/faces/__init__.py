"""The faces: the classes and functions a training script calls, the reference's wrappers and their
construction. :func:`~chunkmem.initialize` (``config``: a configuration to a wrapped model and optimizer),
:class:`~chunkmem.TrainingEngine` and :func:`~chunkmem.initialize_engine` (``engine``, with the checkpoint
directory layout of ``engine_checkpoints``), :class:`~chunkmem.ZeroInitContext` (``init_context``) and
:class:`~chunkmem.TiledLinear` (``tiled_linear``). Nothing else in chunkmem imports them but the faces above
them (:mod:`chunkmem.deepspeed`, :mod:`chunkmem.integrations`) and the package's own ``__init__``; each is
exported as ``chunkmem.<name>``."""
