"""The torch optimizer a chunked optimizer wraps, as the user's script still holds it.

``ShardedOptimizerV2`` and ``LowLevelZeroOptimizer`` lay their chunks out from the wrapped optimizer's param
groups once. A group added later to the wrapped optimizer itself (``optim.optim.add_param_group``, or the
script's own reference to the torch optimizer) would show in ``param_groups`` and get gradients, but never
be stepped or zeroed: :func:`seal_param_groups` makes that call raise instead, naming the alternative.
"""
from __future__ import annotations

from typing import Any, NoReturn

from ..errors import UnsupportedOperationError


class RefusedAddParamGroup:
    """Stands for the wrapped optimizer's ``add_param_group`` (a picklable callable: the optimizer may be
    copied or saved whole)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __call__(self, param_group: dict[str, Any]) -> NoReturn:
        raise UnsupportedOperationError(
            f"add_param_group on the optimizer wrapped by {self.owner}: its chunks were laid out from the param "
            f"groups it had when {self.owner} was built, so a group added now would never be stepped; pass every "
            f"param group to the torch optimizer before building {self.owner}; nothing was changed")


def seal_param_groups(optimizer: Any, owner: str) -> None:
    """Make ``optimizer.add_param_group`` raise from now on (``owner`` names the chunked optimizer)."""
    optimizer.add_param_group = RefusedAddParamGroup(owner)
