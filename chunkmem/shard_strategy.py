"""Shard strategies: how a chunk is divided over the data-parallel ranks.

chunkmem shards whole chunks, never single tensors: every chunk is split into equal contiguous
shards, one per rank. The strategy decides how gathers are grouped:

* :class:`TensorShardStrategy` gathers each chunk a module needs with its own collective.
* :class:`BucketTensorShardStrategy` gathers all chunks one module needs in one collective (better
  bandwidth when a module's parameters span small chunks).

With a single process (the only mode built so far) every rank holds the whole chunk and both
strategies move nothing.
"""
from __future__ import annotations


class BaseShardStrategy:
    """Base class of the shard strategies; ``bucketed`` says whether gathers of a module are merged."""

    bucketed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TensorShardStrategy(BaseShardStrategy):
    """Shard every chunk evenly over the ranks; gather chunk by chunk."""


class BucketTensorShardStrategy(BaseShardStrategy):
    """Shard every chunk evenly over the ranks; gather all chunks of one module in one collective."""

    bucketed = True
