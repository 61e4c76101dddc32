"""One parameter's 8-bit Adam state as plain tensors: :class:`~chunkmem.HybridAdam` with ``state_dtype="8bit"``.

Alone, the optimizer keeps this state per parameter, and its ``state_dict()`` holds it as it is; wrapped in
:class:`~chunkmem.ShardedOptimizerV2`, the moments live in chunk families (:mod:`chunkmem.optim.low_bit_rule`) and
the state dict holds the same entries, so a run moves between the two both ways. No torchao is needed. An entry is:

* ``"step"``: a float32 scalar tensor, the steps taken;
* a parameter whose state is quantized (at least 4096 elements, in whole blocks of 256:
  :func:`chunkmem.optim.blockwise.quantizes`): ``"exp_avg_codes"`` and ``"exp_avg_sq_codes"``, ``uint8`` tensors
  shaped like the parameter (one code per element), and ``"exp_avg_scales"`` and ``"exp_avg_sq_scales"``, flat
  fp32 tensors of one scale per block of 256 elements (:mod:`chunkmem.optim.blockwise`, torchao's format);
* any other parameter: ``"exp_avg"`` and ``"exp_avg_sq"``, fp32 tensors shaped like the parameter, as
  ``torch.optim.Adam`` keeps them (a bf16 parameter under ``bf16_stochastic_round=True``: fp32 tensors holding
  bf16 values, torchao's bf16 state).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..errors import InvalidArgumentError, check_type
from ..state_dicts import check_tensor_data
from .blockwise import BLOCK_SIZE, quantizes
from .low_bit_adam import LowBitHyper, Moments, Segment, update_segments_
from .rounding_draws import ROUNDING_RANGE
from .state_dict import check_entry as check_step_entry

CODES = ("exp_avg_codes", "exp_avg_sq_codes")
SCALES = ("exp_avg_scales", "exp_avg_sq_scales")
PLAIN = ("exp_avg", "exp_avg_sq")


class _Shape(NamedTuple):
    """What a state-dict check reads of a parameter: its element count and shape."""

    numel: int
    shape: tuple[int, ...]


def new_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state of ``param`` before its first step: step 0 and zero moments, on the parameter's device."""
    device = param.device
    state = {"step": torch.zeros((), dtype=torch.float32, device=device)}
    if quantizes(param.numel()):
        for codes, scales in zip(CODES, SCALES):
            state[codes] = torch.zeros(param.shape, dtype=torch.uint8, device=device)
            state[scales] = torch.zeros(param.numel() // BLOCK_SIZE, dtype=torch.float32, device=device)
    else:
        for key in PLAIN:
            state[key] = torch.zeros(param.shape, dtype=torch.float32, device=device)
    return state


def moments_of(entry: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
    """The ``exp_avg`` and ``exp_avg_sq`` of an entry: ``(codes, scales)`` pairs of flat tensors, or flat fp32
    tensors (views where the entry's tensors are contiguous)."""
    if CODES[0] in entry:
        return tuple((entry[c].reshape(-1), entry[s].reshape(-1)) for c, s in zip(CODES, SCALES))
    return tuple(entry[key].reshape(-1) for key in PLAIN)


def exported(held: tuple[Any, Any], shape: torch.Size) -> dict[str, torch.Tensor]:
    """An entry's moments (without ``"step"``) from ``held`` (as :meth:`Moments.of` gives them): copies on the
    CPU, the codes and plain moments shaped like the parameter."""
    copy = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    if isinstance(held[0], tuple):
        entry = {codes: copy(pair[0]).view(tuple(shape)) for codes, pair in zip(CODES, held)}
        entry.update({scales: copy(pair[1]) for scales, pair in zip(SCALES, held)})
        return entry
    return {key: copy(values).float().view(tuple(shape)) for key, values in zip(PLAIN, held)}


def update_parameter_(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                      hyper: LowBitHyper, stochastic_round: bool = False) -> None:
    """One step of ``param`` (any float dtype; a 16-bit one is updated in fp32 and rounded back to nearest) and of
    its ``state`` (:func:`new_state`'s layout) with ``grad``: one segment of :func:`update_segments_`, the update
    of the chunk families. Counts the step.

    ``stochastic_round`` (a bf16 ``param`` only): the parameter is its own master, rounded to bf16 stochastically
    with numbers drawn here from its device's default generator as torchao's step draws them, and plain moments
    are rounded to bf16, as torchao keeps a small bf16 parameter's, while ``state`` holds them in fp32."""
    state["step"] += 1
    quantized = CODES[0] in state
    in_place = param.is_contiguous()
    target = param.detach() if in_place else param.detach().contiguous()
    flat = target.view(-1)
    random = None
    if stochastic_round:
        random = torch.randint(0, ROUNDING_RANGE, param.shape, device=param.device, dtype=torch.int32).view(-1)
    master = flat if flat.dtype == torch.float32 or stochastic_round else flat.float()
    moments = _moments(state, quantized, torch.bfloat16 if stochastic_round else torch.float32, param.device)
    segment = Segment(0, flat.numel(), quantized, 0, hyper, int(state["step"].item()))
    update_segments_(master, grad.detach().reshape(-1).contiguous(), moments, [segment],
                     param_out=None if master is flat else flat, random=random)
    if not quantized and stochastic_round:
        for key, values in zip(PLAIN, (moments.plain_m, moments.plain_v)):
            state[key].copy_(values.view(state[key].shape))
    if not in_place:
        param.detach().copy_(target)


def _moments(state: dict[str, torch.Tensor], quantized: bool, plain_dtype: torch.dtype,
             device: torch.device) -> Moments:
    """``state``'s moments as the update reads them: views of its codes and scales, or its plain moments (views
    where ``plain_dtype`` is fp32, else copies in ``plain_dtype``); the kind it lacks empty."""
    held = moments_of(state)
    none8 = torch.empty(0, dtype=torch.uint8, device=device)
    none_plain = torch.empty(0, dtype=plain_dtype, device=device)
    if quantized:
        return Moments(held[0][0], held[1][0], held[0][1], held[1][1], none_plain, none_plain)
    none32 = torch.empty(0, device=device)
    return Moments(none8, none8, none32, none32, held[0].to(plain_dtype), held[1].to(plain_dtype))


def check_entry(index: Any, name: str, entry: Any, numel: int, shape: tuple[int, ...]) -> int:
    """The step count of a saved entry of a parameter of ``numel`` elements and ``shape``, after checking it holds
    the module docstring's keys, dtypes and sizes (raises :class:`~chunkmem.InvalidArgumentError` naming ``index``
    and ``name``)."""
    where = f"state_dict['state'][{index!r}] (parameter {name!r})"
    parameter = _Shape(numel, tuple(shape))
    if not quantizes(numel):
        return check_step_entry(index, name, entry, parameter, PLAIN)
    listing = ", ".join(("step",) + CODES + SCALES)
    check_type(where, entry, Mapping, f"a dict with {listing} (8-bit state of a parameter of {numel} elements)")
    for key in ("step",) + CODES + SCALES:
        if key not in entry:
            raise InvalidArgumentError(where, f"a state without {key!r}", f"{listing} (8-bit state of a parameter of "
                                       f"{numel} elements; one under 4096 elements keeps exp_avg and exp_avg_sq)")
    for codes, scales in zip(CODES, SCALES):
        value = check_tensor_data(f"{where}[{codes!r}]", entry[codes])
        if value.dtype != torch.uint8 or tuple(value.shape) != tuple(shape):
            raise InvalidArgumentError(f"{where}[{codes!r}]", _described(value), f"a uint8 tensor of shape {tuple(shape)}")
        value = check_tensor_data(f"{where}[{scales!r}]", entry[scales])
        if value.dtype != torch.float32 or tuple(value.shape) != (numel // BLOCK_SIZE,):
            raise InvalidArgumentError(f"{where}[{scales!r}]", _described(value),
                                       f"an fp32 tensor of shape ({numel // BLOCK_SIZE},) (a scale per {BLOCK_SIZE} "
                                       f"elements)")
    return check_step_entry(index, name, {"step": entry["step"]}, parameter, ())


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
