"""Shard strategies: how the chunks sharded over the data-parallel ranks are gathered.

chunkmem shards whole chunks, never single tensors: every chunk is split into equal contiguous
shards, one per rank (``ShardedModelV2``'s ``process_group``), and a module's chunks are gathered
(``all_gather``) before its forward and backward. The strategy decides how those gathers are grouped:

* :class:`TensorShardStrategy` gathers each chunk with its own collective.
* :class:`BucketTensorShardStrategy` gathers all the chunks one module (or one step of the auto plan)
  needs in one collective: fewer, larger messages, at the cost of one extra copy of those chunks.

Both give bitwise the same results. With a single process nothing is gathered and the strategies
do not differ.
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
