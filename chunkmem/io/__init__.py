"""Checkpoints (full and sharded, atomic, resharded to another world size or chunk layout) and Hugging Face
loading and saving. The bytes on disk are :mod:`chunkmem.storage`'s; the model's state dict is
:mod:`chunkmem.state_dicts`', the optimizers' :mod:`chunkmem.optim.state_dict`'s."""
