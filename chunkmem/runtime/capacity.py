"""How much of the device tier a model's step needs at one time, checked against the capacity.

Run when a model is wrapped (over the modules' own parameters and those declared with
``register_external_parameter``) and again by the runtime when a forward finds a module using another
module's parameter (``F.linear(x, other.weight)``): the chunk then stays on the device, with its
gradient staging, from that module's backward on, which the first check could not know.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.nn as nn

from ..core.layout import ChunkLayout
from ..distributed.collectives import ShardGroup
from ..errors import DeviceCapacityError
from .placement import PlacementPolicy


Users = Sequence[tuple[str, Sequence[nn.Parameter]]]


@dataclass(frozen=True)
class CapacityCheck:
    """One model's device capacity check: its layout, placement, sharding and the capacity (bytes) its
    runtime was built with; called with the modules' uses of parameters as they are known."""

    layout: ChunkLayout
    policy: PlacementPolicy
    shards: ShardGroup
    reuse_grads: bool
    capacity: int

    def __call__(self, users: Users, found: str = "") -> None:
        check_device_capacity(users, self.layout, self.policy, self.shards, self.reuse_grads, self.capacity, found)


def check_device_capacity(users: Users, layout: ChunkLayout, policy: PlacementPolicy, shards: ShardGroup,
                          reuse_grads: bool, capacity: int, found: str = "") -> None:
    """Refuse a capacity that cannot hold what the policy needs on the device at one time: the chunks
    resting there (with their gradients), plus the most any module's forward or backward holds.

    ``users``: the modules that use chunk-managed parameters, in backward order (the root first: its
    backward begins with the loss), each with the parameters its forward uses (its own and those of
    other modules it uses: a tied head, ``F.linear(x, other.weight)``). A module's forward holds its
    chunks. Its backward holds them with their gradient staging, and also every chunk whose backward
    began earlier and whose gradients are not finished yet: a chunk stays on the device from the backward
    of its first user to that of its last (a tied embedding from the head's backward to the embedding's; a
    chunk without trainable parameters until every autograd node of its last user ran, counted here as
    also through the next module's backward: autograd may interleave the backward of modules that share an
    input, such as attention's q, k and v projections). ``found``: what this check learned since the model
    was built (named in the error).
    """
    count = layout.num_chunks
    grads_per_chunk = 0 if reuse_grads else 1

    def need_of(chunk_indices: set[int], world: int, staging: set[int] | None = None) -> int:
        staged = chunk_indices if staging is None else chunk_indices & staging
        return sum((1 + (grads_per_chunk if i in staged and layout.trainable(i) else 0))
                   * layout.shard_bytes(i, world) for i in chunk_indices)

    # Sharded, what rests is one shard of each chunk (a replicated chunk whole), and every chunk a module
    # uses is gathered (a replicated one is already whole where it rests).
    resting = {i for i in range(count) if policy.params_on_device_at_rest(i, count)}
    need = need_of(resting, shards.world)
    what = f"the {len(resting)} chunks resting on the device with their gradients" if resting else ""
    chunk_of = layout.chunk_of_param()
    backward = [(name, params) for name, params in users if params]
    first: dict[int, int] = {}  # chunk -> backward position of its first user
    last: dict[int, int] = {}  # chunk -> position where its gradients are finished
    grad_at: dict[int, int] = {}  # parameter -> position of its last user (autograd's AccumulateGrad)
    for position, (_, params) in enumerate(backward):
        for p in params:
            c = chunk_of[id(p)]
            first.setdefault(c, position)
            last[c] = position if layout.trainable(c) else position + 1
            grad_at[id(p)] = position
    staging_from: dict[int, int] = {}  # chunk -> position where its first gradient arrives
    for param_id, position in grad_at.items():
        c = chunk_of[param_id]
        staging_from[c] = min(staging_from.get(c, position), position)
    visiting_need, visiting_what = 0, ""
    for position, (name, params) in enumerate(backward):
        own = {chunk_of[id(p)] for p in params}
        held = {c for c in first if first[c] <= position <= last[c]} | own
        staging = {c for c in held if staging_from.get(c, position) <= position} | own
        whole_at_rest = resting if not shards.sharded else {i for i in resting if layout.is_replicated(i)}
        held -= whole_at_rest
        own = own - whole_at_rest
        held_need = need_of(held, 1, staging)
        if held_need > visiting_need or (held_need == visiting_need > 0):  # ties: the first in forward order
            visiting_need = held_need
            others = len(held - own)
            visiting_what = f"the chunks of module {name!r} with their gradients" + (
                f" and the {others} other chunk(s) its backward holds (first used by a later module's "
                f"backward, their gradients not finished yet)" if others else "")
    need += visiting_need
    what = " and ".join(w for w in (what, visiting_what) if w)
    if need > capacity:
        remedy = "use placement 'cpu'" if resting else "use smaller chunks (chunk_size=)"
        raise DeviceCapacityError(
            f"the device tier capacity of {capacity} bytes is smaller than the {need} bytes of {what}{found}; "
            f"raise it with chunkmem.set_device_memory_capacity or CHUNKMEM_DEVICE_MEMORY, or {remedy}")
