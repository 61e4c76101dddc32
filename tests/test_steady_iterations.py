"""Steady iterations: where every chunk stays on the device throughout (``cuda`` placement, or an ``auto`` plan
that moves nothing), an iteration that follows the schedule walks no period. The modules' hooks return at once,
so the wrapper's host time per module call falls (``benchmarks/wrapper_overhead.py --host-bound``), and the
training must not change: every test here compares bit for bit with the same run walking its periods (the
residency test patched to say no), and with plain PyTorch where chunkmem's update is torch's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.runtime.executor import ChunkExecutor
from tests.models import TinyGPT, batches, build_sharded, lm_loss, train

STEPS = 5


@pytest.fixture
def walking(monkeypatch):
    """Make every iteration walk its periods, as before steady iterations existed."""
    def walk() -> None:
        monkeypatch.setattr(ChunkExecutor, "resident_throughout", lambda self, moves, in_param_memory: False)
    return walk


def _params(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _run(reference, policy: str, dtype: torch.dtype, **kwargs):
    model, optim = build_sharded(reference, policy, dtype, **kwargs)
    losses = train(model, optim, batches(STEPS))
    return model, losses, _params(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_resident_iterations_are_steady_and_train_bitwise_as_walked_ones(walking, dtype, use_checkpoint):
    torch.manual_seed(0)
    reference = TinyGPT(use_checkpoint=use_checkpoint)  # a tied head and a parameter used functionally
    model, losses, params = _run(reference, "cuda", dtype)
    doc = model.memory_stats()
    # TinyGPT's root uses side.weight functionally: its first trace finds that and traces again; every
    # iteration after the second trace is steady
    assert doc["traces"] == 2 and doc["steady_iterations"] == STEPS - 2
    walking()
    walked_model, walked_losses, walked_params = _run(reference, "cuda", dtype)
    assert walked_model.memory_stats()["steady_iterations"] == 0
    assert losses == walked_losses
    assert all(torch.equal(params[k], walked_params[k]) for k in params)
    # what the last walked iteration measured is what memory_stats still shows
    assert doc["last_iteration"] == walked_model.memory_stats()["last_iteration"]


def test_steady_fp32_training_is_torchs_adamw():
    torch.manual_seed(0)
    reference = TinyGPT()
    plain = copy.deepcopy(reference)
    optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for x in batches(STEPS):
        lm_loss(plain(x), x).backward()
        optim.step()
        optim.zero_grad()
    model, _, params = _run(reference, "cuda", torch.float32)
    assert model.memory_stats()["steady_iterations"] == STEPS - 2
    expected = plain.state_dict()
    assert all(torch.equal(params[k], expected[k]) for k in params)


def test_a_steady_iteration_calls_only_the_roots_hooks(monkeypatch):
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cuda", torch.float32)
    runtime = model.runtime
    calls: list[tuple[str, str]] = []
    for edge in ("pre_forward", "post_forward", "pre_backward"):
        method = getattr(runtime, edge)

        def counted(module, *args, _edge=edge, _method=method, **kwargs):
            calls.append((_edge, type(module).__name__))
            return _method(module, *args, **kwargs)
        monkeypatch.setattr(runtime, edge, counted)
    data = batches(3)
    train(model, optim, data[:2])  # traced twice (the root's functional use of side.weight is found in the first)
    calls.clear()
    train(model, optim, data[2:])
    assert calls == [("pre_forward", "TinyGPT"), ("post_forward", "TinyGPT"), ("pre_backward", "TinyGPT")]
    assert not runtime.steady  # over with its backward


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_no_iteration_is_steady_where_chunks_move(policy):
    torch.manual_seed(0)
    reference = TinyGPT()
    kwargs = {}
    if policy == "auto":  # room for about half the chunks: the plan moves some in every iteration
        cm.set_device_memory_capacity(6 * 16384 * 4)
    try:
        model, losses, _ = _run(reference, policy, torch.float32, **kwargs)
    finally:
        cm.set_device_memory_capacity(None)
    doc = model.memory_stats()
    assert doc["steady_iterations"] == 0 and doc["totals"]["moved_to_device_bytes"] > 0


def test_an_auto_plan_that_moves_nothing_is_steady(walking):
    torch.manual_seed(0)
    reference = TinyGPT()
    model, losses, params = _run(reference, "auto", torch.float32, gpu_margin_mem_ratio=1.0)
    assert model.memory_stats()["steady_iterations"] == STEPS - 2
    walking()
    _, walked_losses, walked_params = _run(reference, "auto", torch.float32, gpu_margin_mem_ratio=1.0)
    assert losses == walked_losses and all(torch.equal(params[k], walked_params[k]) for k in params)


def test_new_input_shapes_trace_again_then_steady_again():
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cuda", torch.float32)
    train(model, optim, batches(3))
    train(model, optim, batches(3, seq=8, seed=1))  # another signature: traced again
    doc = model.memory_stats()
    assert doc["traces"] == 3 and doc["steady_iterations"] == 3


def test_a_forward_that_raises_in_a_steady_iteration_leaves_the_next_one_whole():
    torch.manual_seed(0)
    reference = TinyGPT()
    model, optim = build_sharded(reference, "cuda", torch.float32)
    data = batches(4)
    train(model, optim, data[:2])
    assert model.runtime.steady is False
    with pytest.raises(IndexError):
        model(torch.full((2, 16), 10_000))  # past the embedding: raises inside a steady forward
    assert not model.runtime.steady
    losses = train(model, optim, data[2:])
    twin, twin_optim = build_sharded(reference, "cuda", torch.float32)
    expected = train(twin, twin_optim, data)
    assert losses == expected[2:]
    twin_params = _params(twin)
    assert all(torch.equal(v, twin_params[k]) for k, v in _params(model).items())


def test_a_custom_function_reading_its_weight_in_a_steady_backward_reads_the_parameter():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(weight)
            return x * weight.sum()

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            read.append(weight.sum().item())  # a read of the chunk-managed parameter inside the backward
            return grad * weight.sum(), torch.ones_like(weight) * grad.sum()

    class Scaled(TinyGPT):
        def forward(self, idx):
            return Scale.apply(super().forward(idx), self.side.weight)

    read: list[float] = []
    torch.manual_seed(0)
    reference = Scaled()
    model, optim = build_sharded(reference, "cuda", torch.float32)
    for x in batches(3):
        loss = lm_loss(model(x), x)
        optim.backward(loss)
        with torch.no_grad():
            before = model.module.side.weight.detach().sum().item()
        optim.step()
        optim.zero_grad()
        assert read[-1] == before  # what the backward read is the parameter the step then updated
    assert model.memory_stats()["steady_iterations"] == 1


def test_a_parameter_used_functionally_in_a_steady_forward_changes_no_module_chunks():
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cuda", torch.float32)
    train(model, optim, batches(2))
    chunks = {module: list(found) for module, found in model.runtime.module_chunks.items()}
    train(model, optim, batches(3, seed=1))  # steady: side.weight met through F.linear inside the root's call
    assert model.runtime.module_chunks == chunks
    doc = model.memory_stats()
    assert doc["traces"] == 2 and doc["steady_iterations"] == 3
