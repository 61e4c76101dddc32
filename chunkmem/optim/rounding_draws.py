"""The random numbers of stochastic rounding, each parameter's where the reference's step draws them, whatever
order chunkmem updates the chunks in.

torchao's 8-bit Adams with ``bf16_stochastic_round=True`` draw, inside their step, one
``torch.randint(0, 2**16)`` tensor of int32 per parameter that has a gradient, in the order of the param groups and
of the parameters in each group, from the default generator of the parameter's device. chunkmem updates the chunks
in another order: the disk chunks first, in the order their gradients land, or during the backward
(``step_in_backward``), last chunk first, some on the disk step's thread. A :class:`DrawSequence` gives each
parameter the numbers the reference's step would have drawn for it: it copies the default generator's state when
the step's first update draws, and keeps a private generator that it moves along the reference's order, keeping the
state before each parameter's draw as it passes it. Updates in the reference's order draw once (the private
generator is always where the next parameter's numbers begin); an update out of order walks forward through the
draws before it (drawing and dropping them) or goes back to a state it kept, so a backward's updates cost the draws
twice. When the step ends, the default generator is set to the state after the last parameter's draw, where the
reference's step leaves it.

A sequence holds for one step: made from the default generator's state and the order of the parameters stepped.
If either is no longer what it was made from (the user drew random numbers after the backward, a parameter got no
gradient after all), the updates made with it were not the step's: the optimizer's speculation key says so
(:meth:`DrawSequence.key`) and the step redoes them.
"""
from __future__ import annotations

import threading
from typing import Hashable, Sequence

import torch

ROUNDING_RANGE = 1 << 16
"""The draws are integers in ``[0, ROUNDING_RANGE)`` (the 16 bits an fp32 value loses as bf16)."""


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (the CPU's, or the CUDA device's)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class DrawSequence:
    """One step's draws on one device (see the module docstring).

    Args:
        device: where the numbers are drawn (the device whose default generator the reference's step draws from).
        order: ``(key, numel)`` of every parameter the step updates, in the reference's order (param groups, then
            the parameters of each group).
    """

    def __init__(self, device: torch.device, order: Sequence[tuple[Hashable, int]]) -> None:
        self.device = device
        self.order = tuple(order)
        self.start = default_generator(device).get_state()
        self._index = {key: i for i, (key, _) in enumerate(self.order)}
        self._generator = torch.Generator(device)
        self._generator.set_state(self.start)
        self._states: dict[int, torch.Tensor] = {0: self.start}  # position -> the state before its draw
        self._position = 0  # the private generator stands before this parameter's draw
        self._lock = threading.Lock()  # the disk step's thread and autograd's both draw

    def holds_for(self, order: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the sequence is the one a step over ``order`` would draw now: the default generator still at
        the state it was made from, the same parameters stepped in the same order."""
        return tuple(order) == self.order and torch.equal(default_generator(self.device).get_state(), self.start)

    def key(self, keys: Sequence[Hashable]) -> tuple[int, ...]:
        """What the draws of the parameters ``keys`` depend on besides the start: their positions in the order."""
        return tuple(self._index[key] for key in keys)

    def draw(self, key: Hashable) -> torch.Tensor:
        """The numbers of the parameter ``key`` (int32, one per element, flat), as the reference draws them."""
        with self._lock:
            position = self._index[key]
            self._move_to(position)
            numbers = self._draw_next()
        return numbers

    def end_state(self) -> torch.Tensor:
        """The generator's state after every parameter's draw (where the reference's step leaves it)."""
        with self._lock:
            self._move_to(len(self.order))
            return self._generator.get_state()

    def _move_to(self, position: int) -> None:
        if position == self._position:
            return
        if position < self._position or position in self._states:
            kept = max(p for p in self._states if p <= position)
            self._generator.set_state(self._states[kept])
            self._position = kept
        while self._position < position:
            self._draw_next()

    def _draw_next(self) -> torch.Tensor:
        """Draw the numbers of the parameter at the current position and step past it, keeping the state before
        each draw and after the last one."""
        self._states.setdefault(self._position, self._generator.get_state())
        numel = self.order[self._position][1]
        numbers = torch.randint(0, ROUNDING_RANGE, (numel,), generator=self._generator, device=self.device,
                                dtype=torch.int32)
        self._position += 1
        if self._position == len(self.order):
            self._states.setdefault(self._position, self._generator.get_state())
        return numbers
