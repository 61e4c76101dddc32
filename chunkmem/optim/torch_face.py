"""The ``torch.optim.Optimizer`` contract of an optimizer that wraps another one.

:class:`WrappingOptimizer` is a ``torch.optim.Optimizer`` whose ``param_groups``, ``defaults`` and ``state``
are those of the torch optimizer it wraps (``self.optim``), so that schedulers, hooks and scripts that read
them see the wrapped optimizer's, and which refuses what would split the two: a new param group added to it,
and pickling (the state lives in the model's chunks). ``torch.optim.Optimizer.__init__`` is not called: it
would build a second list of param groups and a second state.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, NoReturn

from torch.optim import Optimizer

from ..errors import UnsupportedOperationError


class WrappingOptimizer(Optimizer):
    """See the module docstring. Subclasses set ``self.optim`` (the wrapped optimizer) and call
    :meth:`_init_optimizer_hooks` when built."""

    optim: Any

    def _init_optimizer_hooks(self) -> None:
        """The hook registries ``torch.optim.Optimizer.__init__`` would have made (step and state-dict hooks)."""
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups, the same list (hyper-parameters are read from here at
        every step, so a scheduler that changes ``lr`` or ``betas`` changes the next step)."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state, which stays empty: the step counts and moments
        live in the chunks; :meth:`state_dict` returns them in torch's layout."""
        return self.optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> NoReturn:
        """Refused: every trainable parameter is in a param group from the start. Give the wrapped
        optimizer every group before building this one."""
        name = type(self).__name__
        raise UnsupportedOperationError(
            f"{name}.add_param_group is not supported: every trainable parameter is in a param group "
            f"from the start; pass every param group to the wrapped optimizer before building {name}")

    def __getstate__(self) -> NoReturn:
        raise UnsupportedOperationError(
            f"a {type(self).__name__} cannot be pickled or copied (its state lives in the model's chunks); save "
            f"optim.state_dict() or use chunkmem.save_checkpoint")

    def _hooked_state_dict(self, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``make()`` with torch's state-dict pre hooks before it and post hooks after (each may replace it)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = make()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            replaced = post_hook(self, state)
            state = state if replaced is None else replaced
        return state

    def _hooked_load(self, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` with torch's load-state-dict pre hooks (each may replace it) and post hooks."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = pre_hook(self, state_dict)
            state_dict = state_dict if replaced is None else replaced
        load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
