"""No dispatch mode, hold or held chunk outlives an exception raised in a traced forward or backward.

Under ``auto`` the first iteration (and the first with new shapes) is traced by a counting dispatch mode.
An exception inside that forward (a failing hook, an out-of-memory retry loop) or inside the optimizer's
backward must not leave the mode installed: later tensor operations of the process, sparse ones
included, must run as without chunkmem, and training goes on as if the failed iteration never ran.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import chunkmem as cm
from models import TinyGPT, batches, lm_loss


def _active_modes() -> list:
    return [m for m in _get_current_dispatch_mode_stack() if not getattr(m, "stopped", False)]


def _pair(reference: torch.nn.Module):
    cm.set_device_memory_capacity(2**30)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="auto",
                              dtype=torch.float32, chunk_size=16384)
    return model, cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))


def _train(model, optim, data) -> list[float]:
    losses = []
    for x in data:
        loss = lm_loss(model(x), x)
        optim.backward(loss)
        optim.step()
        losses.append(loss.item())
    return losses


def _fails_in_forward(model, x) -> None:
    def boom(module, args, out):
        raise ValueError("boom in a forward hook")
    handle = model.module.blocks[0].register_forward_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        model(x)
    handle.remove()


def _fails_in_backward(model, optim, x) -> None:
    def boom(grad):
        raise ValueError("boom in a backward hook")
    loss = lm_loss(model(x), x)
    handle = model.module.blocks[0].fc1.weight.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        optim.backward(loss)
    handle.remove()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_in_a_traced_iteration_leaves_no_mode_and_training_is_unchanged(where):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=4)
    expected = _train(*_pair(reference), data)
    model, optim = _pair(reference)
    if where == "forward":
        _fails_in_forward(model, data[0])
    else:
        _fails_in_backward(model, optim, data[0])
        optim.zero_grad()  # (the failed backward's finished gradients are dropped, as after any error)
    assert _active_modes() == []
    assert torch.zeros(4).to_sparse().to_dense().sum().item() == 0  # the process's own operations run plainly
    assert not any(c.in_use for c in model.chunks)
    assert _train(model, optim, data) == expected


def test_a_counting_mode_left_by_a_plain_backward_that_raised_breaks_no_operation():
    """A plain ``loss.backward()`` that raises cannot be intercepted: the counting mode stays until the next
    forward; meanwhile it must handle every tensor layout (a sparse tensor has no storage to count)."""
    torch.manual_seed(0)
    model, optim = _pair(TinyGPT())
    x = batches(1)[0]
    loss = lm_loss(model(x), x)

    def boom(grad):
        raise ValueError("boom")
    model.module.blocks[0].fc1.weight.register_hook(boom)
    with pytest.raises(ValueError):
        loss.backward()
    sparse = torch.zeros(4, 4).to_sparse()
    assert (sparse + sparse).to_dense().sum().item() == 0
    torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    model.module.blocks[0].fc1.weight._backward_hooks.clear()
    optim.zero_grad()
    optim.backward(lm_loss(model(x), x))  # the next iteration ends the left mode
    optim.step()
    assert _active_modes() == []


def _fails_in_a_bare_backward(model, x) -> None:
    def boom(grad):
        raise ValueError("boom in a backward hook")
    loss = lm_loss(model(x), x)
    handle = model.module.blocks[0].fc1.weight.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    handle.remove()


@pytest.mark.parametrize("how", ["optim.backward", "loss.backward"])
@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_a_failed_backward_leaves_nothing_for_the_step(policy, how):
    """A backward that raised part-way drops every pending gradient, those of the chunks it had finished and
    those accumulated before it: the next step() applies nothing (before 2026-11-27 it applied the finished
    chunks' gradients, and one whose chunk was left without a gradient raised a TypeError after advancing
    the first chunk's step count), and training goes on as if the failed iteration had not happened."""
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=4)

    def build():
        cm.set_device_memory_capacity(2**30 if policy == "auto" else None)
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=torch.float32, chunk_size=16384)
        cm.set_device_memory_capacity(None)
        return model, cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))

    expected_model, expected_optim = build()
    expected = _train(expected_model, expected_optim, data)
    model, optim = build()
    losses = _train(model, optim, data[:1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim.backward(lm_loss(model(data[1]), data[1]))  # accumulated, then lost with the failed one
    if how == "optim.backward":
        _fails_in_backward(model, optim, data[1])
    else:
        _fails_in_a_bare_backward(model, data[1])
    assert optim.step() is False and not optim.grads_pending
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert [set(c.steps.values()) for c in model.chunks if c.trainable] == [{1}] * sum(c.trainable for c in model.chunks)
    assert losses + _train(model, optim, data[1:]) == expected


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failed_backward_with_the_step_in_it_on_disk_neither_hangs_nor_trains_on_silently(atomic, tmp_path):
    """step_in_backward with the optimizer state on disk, and a backward that raises after the disk step took some
    chunks: atomic steps are undone (training goes on as if the failed iteration had not happened); in-place
    ones cannot be, so those started are completed and the optimizer refuses to step until a checkpoint is
    loaded. Before 2026-11-27 the next step raised a TypeError and every later one spun forever."""
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=4)

    def build(directory):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=16384, offload_optimizer="disk",
                                  nvme_path=str(directory), buffer_size=8192, atomic_step=atomic)
        return model, cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), step_in_backward=True)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expected = _train(*build(tmp_path / "a"), data)
    model, optim = build(tmp_path / "b")
    losses = _train(model, optim, data[:1])
    cm.save_checkpoint(str(tmp_path / "ckpt"), model, optim)
    _fails_in_backward(model, optim, data[1])  # (its hook is on the first block: late in the backward)
    assert optim.backward_updates == 0 and optim.step() is False
    if atomic:
        assert losses + _train(model, optim, data[1:]) == expected
        return
    with pytest.raises(cm.UnsupportedOperationError, match="in place on disk.*load a checkpoint"):
        _train(model, optim, data[1:2])
    optim.zero_grad()
    cm.load_checkpoint(str(tmp_path / "ckpt"), model, optim)
    assert losses + _train(model, optim, data[1:]) == expected
