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
generator is always where the next parameter's numbers begin); an update out of order walks forward past the
draws before it or goes back to a state it kept, so a backward's updates cost one more pass over the draws, which
only skips them where skipping is cheap (below). When the step ends, the default generator is set to the state after the last parameter's draw, where the
reference's step leaves it.

On the CPU the numbers come from ``csrc/mt19937_draws.cpp``, which runs torch's CPU generator (a Mersenne twister)
on the state torch exports, without torch's per-element loop, and skips numbers by regenerating the twister's
words only (checked against ``torch.randint`` when it loads; else, and on CUDA, torch draws them: walking forward
then draws and drops the numbers).

A sequence holds for one step (:class:`StepDraws` keeps an optimizer's, one per device, from step to step): made
from the default generator's state and the order of the parameters stepped.
If either is no longer what it was made from (the user drew random numbers after the backward, a parameter got no
gradient after all), the updates made with it were not the step's: the optimizer's speculation key says so
(:meth:`DrawSequence.key`) and the step redoes them.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable, Hashable, Sequence

import torch

from ..core.chunk import Chunk, ParamSlot
from ..core.native_build import CSRC, LoadedOnce, load_library
from ..core.param_guard import slot_of

ROUNDING_RANGE = 1 << 16
"""The draws are integers in ``[0, ROUNDING_RANGE)`` (the 16 bits an fp32 value loses as bf16)."""
SOURCE = CSRC / "mt19937_draws.cpp"
CXXFLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (the CPU's, or the CUDA device's)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class TorchDraws:
    """Draws with torch's own generator on ``device``, from ``state``."""

    def __init__(self, device: torch.device, state: torch.Tensor) -> None:
        self.device = device
        self._generator = torch.Generator(device)
        self._generator.set_state(state)

    def state(self) -> torch.Tensor:
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def draw(self, numel: int, part: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        numbers = torch.randint(0, ROUNDING_RANGE, (numel,), generator=self._generator, device=self.device,
                                dtype=torch.int32)
        return _placed(numbers, part, out)

    def skip(self, numel: int) -> None:
        self.draw(numel)


class HostDraws:
    """The CPU generator's draws computed from its exported ``state`` by ``csrc/mt19937_draws.cpp``."""

    def __init__(self, lib: ctypes.CDLL, state: torch.Tensor) -> None:
        self._lib = lib
        self._state = state.clone()

    def state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    def draw(self, numel: int, part: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        start, end = part if part is not None else (0, numel)
        self.skip(start)
        if out is None:
            out = torch.empty(end - start, dtype=torch.int32)
        self._lib.chunkmem_mt19937_draw_low16(ctypes.c_void_p(self._state.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                              ctypes.c_int64(end - start))
        self.skip(numel - end)
        return out

    def skip(self, numel: int) -> None:
        self._lib.chunkmem_mt19937_skip(ctypes.c_void_p(self._state.data_ptr()), ctypes.c_int64(numel))


def _placed(numbers: torch.Tensor, part: tuple[int, int] | None, out: torch.Tensor | None) -> torch.Tensor:
    """``numbers``' elements ``part`` (all: ``None``), copied into ``out`` where given."""
    if part is not None:
        numbers = numbers[part[0]:part[1]]
    return numbers if out is None else out.copy_(numbers)


def _load_host_draws() -> ctypes.CDLL:
    lib, _, _ = load_library(SOURCE, CXXFLAGS, "mt19937_draws")
    if lib.chunkmem_mt19937_abi() != 1:
        raise RuntimeError("the library has another ABI version")
    for name in ("chunkmem_mt19937_draw_low16", "chunkmem_mt19937_skip"):
        getattr(lib, name).restype = None
    if not _matches_torch(lib):
        raise RuntimeError("its numbers differ from torch.randint's on this machine")
    return lib


def _matches_torch(lib: ctypes.CDLL) -> bool:
    """Whether draws and skips of every length around the twister's 624 words, from a fresh seed and from the
    middle of a run, give torch.randint's numbers and the generator's state after them."""
    reference = torch.Generator().manual_seed(12345)
    ours = HostDraws(lib, reference.get_state())
    for numel, skipped in ((1, 0), (623, 1), (624, 0), (625, 623), (1000, 624), (1, 1249), (3000, 5), (7, 2000)):
        torch.randint(0, ROUNDING_RANGE, (skipped,), generator=reference, dtype=torch.int32)
        ours.skip(skipped)
        drawn = torch.randint(0, ROUNDING_RANGE, (numel,), generator=reference, dtype=torch.int32)
        if not torch.equal(ours.draw(numel), drawn) or not torch.equal(ours.state(), reference.get_state()):
            return False
    return True


_HOST_DRAWS = LoadedOnce(_load_host_draws, "chunkmem: the C++ CPU generator for stochastic rounding is unavailable, "
                                           "torch draws the numbers instead ({error})")


_kept = threading.local()  # per thread: the last host buffer of a chunk's numbers


def numbers_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of ``numel`` elements on ``device`` (contents undefined). On the host, the one this thread
    drew a chunk's numbers into last time, where its size is the same and nothing views it any more: a chunk's
    numbers take hundreds of MB, and new pages cost their zeroing and a fault each, a tenth of the update's time."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.int32, device=device)  # (the device's caching allocator reuses)
    kept = getattr(_kept, "buffer", None)
    # held by nothing else: the tensor by _kept, this name and getrefcount's argument; its memory by the tensor and
    # the untyped_storage() object (a view would add one)
    free = (kept is not None and kept.numel() == numel and sys.getrefcount(kept) == 3
            and torch._C._storage_Use_Count(kept.untyped_storage()._cdata) == 2)
    if not free:
        kept = _kept.buffer = torch.empty(numel, dtype=torch.int32)
    return kept


def draws_from(device: torch.device, state: torch.Tensor) -> TorchDraws | HostDraws:
    """Draws on ``device`` starting at the generator state ``state``: the native ones on the CPU where they load."""
    lib = _HOST_DRAWS.get(stacklevel=3) if device.type == "cpu" else None
    return TorchDraws(device, state) if lib is None else HostDraws(lib, state)


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
        self._draws = draws_from(device, self.start)
        self._states: dict[int, torch.Tensor] = {0: self.start}  # position -> the state before its draw
        self._position = 0  # the draws stand before this parameter's numbers
        self._lock = threading.Lock()  # the disk step's thread and autograd's both draw

    def holds_for(self, order: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the sequence is the one a step over ``order`` would draw now: the default generator still at
        the state it was made from, the same parameters stepped in the same order."""
        return tuple(order) == self.order and torch.equal(default_generator(self.device).get_state(), self.start)

    def key(self, keys: Sequence[Hashable]) -> tuple[int, ...]:
        """What the draws of the parameters ``keys`` depend on besides the start: their positions in the order."""
        return tuple(self._index[key] for key in keys)

    def draw(self, key: Hashable, part: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The numbers of the parameter ``key`` (int32, one per element, flat), as the reference draws them; only
        its elements ``part`` (``(start, end)``), into ``out`` where given."""
        with self._lock:
            self._move_to(self._index[key])
            self._states.setdefault(self._position, self._draws.state())
            numbers = self._draws.draw(self.order[self._position][1], part, out)
            self._position += 1
        return numbers

    def end_state(self) -> torch.Tensor:
        """The generator's state after every parameter's draw (where the reference's step leaves it)."""
        with self._lock:
            self._move_to(len(self.order))
            return self._draws.state()

    def _move_to(self, position: int) -> None:
        """Stand before the numbers of the parameter at ``position``: back to the state kept there, or forward,
        skipping the numbers between (and keeping the state before each parameter passed)."""
        if position < self._position:
            self._draws.set_state(self._states[position])
            self._position = position
        while self._position < position:
            self._states.setdefault(self._position, self._draws.state())
            self._draws.skip(self.order[self._position][1])
            self._position += 1


class StepDraws:
    """The draws of one optimizer's steps: for each step, a :class:`DrawSequence` per device over the parameters
    the step updates, in the order of ``param_groups`` (the wrapped optimizer's, read at every step)."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self._groups = param_groups
        self._sequences: dict[torch.device, DrawSequence] = {}
        self._in_step = False  # inside step(): every chunk's gradients are final

    def begin_step(self) -> None:
        """``step()`` starts updating: which parameters it steps is known now."""
        self._in_step = True

    def end_step(self, stepped: bool) -> None:
        """After a step, each device's default generator where the reference's step leaves it: past every
        parameter's draw (a step that raised leaves it, and the draws made, as they were)."""
        self._in_step = False
        if stepped:
            for device, sequence in self._sequences.items():
                default_generator(device).set_state(sequence.end_state())
            self._sequences.clear()

    def order(self) -> list[tuple[int, int]]:
        """``(id(parameter), numel)`` of every parameter this step updates, in the reference's order (the param
        groups, then each group's parameters): those with a gradient; in the backward, a parameter of a chunk whose
        gradients are not final yet is taken to get one (the step redoes an update that assumed wrongly)."""
        order = []
        with torch._C.DisableTorchFunctionSubclass():  # requires_grad of a chunk-managed parameter
            for group in self._groups:
                for param in group["params"]:
                    slot = slot_of(param)
                    chunk = slot.chunk
                    given = slot.index_in_chunk in chunk.slots_with_grads  # stepped even if frozen since
                    if not given and (not param.requires_grad or self._in_step or chunk.grads_finished):
                        continue
                    order.append((id(param), slot.numel))
        return order

    def sequence(self, device: torch.device) -> DrawSequence:
        """This step's draws on ``device``: the one made earlier in this step (or its backward) while it holds,
        else a new one from the default generator's state now."""
        order = self.order()
        sequence = self._sequences.get(device)
        if sequence is None or not sequence.holds_for(order):
            sequence = self._sequences[device] = DrawSequence(device, order)
        return sequence

    def key(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> tuple[bytes, tuple[int, ...]]:
        """What the numbers of ``params`` depend on: the default generator's state the step starts from and their
        positions in the order of the parameters stepped."""
        sequence = self.sequence(device)
        return bytes(sequence.start.numpy()), sequence.key([id(p) for p in params])

    def shard_numbers(self, chunk: Chunk, stepped: Sequence[tuple[ParamSlot, tuple[int, int] | None]],
                      device: torch.device) -> Callable[[], torch.Tensor]:
        """What draws the numbers of this rank's shard of ``chunk`` (int32 on ``device``, indexed like the shard):
        each stepped parameter's part (``(slot, part)``; ``part`` ``None``: none of it here) of its draw. Which
        numbers is decided now, on the caller's thread; the drawing may run on another."""
        sequence = self.sequence(device)
        parts = [(slot, part) for slot, part in stepped if part is not None]

        def draw() -> torch.Tensor:
            shard = numbers_buffer(chunk.shard_numel, device)  # (elements no part covers: unread)
            for slot, (a, b) in parts:
                start = slot.offset + a - chunk.shard_offset
                sequence.draw(id(slot.param), (a, b), shard[start:start + b - a])
            return shard
        return draw
