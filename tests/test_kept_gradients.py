"""On a CPU device tier, a chunk whose gradients rest there unsharded keeps the tensors autograd produced
instead of copying them into its gradient buffer (chunkmem.runtime.gradients). Every use of the
gradients must still give what plain PyTorch gives: the step, accumulation, zero_grad without set_to_none,
clipping, the accessors; the ledger counts them as the chunk's buffer; an interrupted backward drops
what it began."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.core.tiers import Tier
from chunkmem.optim import host_adam_ext
from chunkmem.utils import safe_get_full_grad
from models import TinyGPT, batches, lm_loss

LR, WD = 1e-2, 0.01


def _build(reference, keep: bool = True):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cuda",
                              dtype=torch.float32, chunk_size=16384)
    model.runtime.gradients.keeps_autograd_tensors = keep
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    return model, optim


def _grad_bytes(model) -> int:
    return model.runtime.memory.ledger.tier_bytes(Tier.DEVICE, ("grad",))


def test_gradients_stay_autograd_tensors_counted_as_the_chunk_buffer():
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(1)[0]
    plain = copy.deepcopy(reference)
    lm_loss(plain(x), x).backward()
    model, optim = _build(reference)
    assert model.runtime.gradients.keeps_autograd_tensors  # no CUDA here: the device tier is the CPU
    optim.backward(lm_loss(model(x), x))
    chunks = model.runtime.trainable_chunks()
    for chunk in chunks:
        pieces = model.runtime.grad_pieces(chunk)
        assert pieces is not None and not chunk.grad.allocated and not chunk.grad_staging.allocated
        assert [offset for offset, _ in pieces] == [slot.offset for slot in chunk.slots]
    assert _grad_bytes(model) == sum(c.grad.nbytes for c in chunks)
    for name, p in plain.named_parameters():
        assert torch.equal(safe_get_full_grad(dict(model.module.named_parameters())[name]), p.grad), name
    optim.step()
    assert _grad_bytes(model) == 0 and all(model.runtime.grad_pieces(c) is None for c in chunks)


def _plain_steps(reference, data, scenario: str) -> list[torch.Tensor]:
    model = copy.deepcopy(reference)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **host_adam_ext.fp32_reference_options())
    for x in data:
        for _ in range(2 if scenario == "accumulate" else 1):
            lm_loss(model(x), x).backward()
        if scenario == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optim.step()
        optim.zero_grad(set_to_none=scenario != "zero_grad keeps buffers")
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("scenario", ["plain loop", "accumulate", "zero_grad keeps buffers", "clip", "read grads"])
def test_every_use_of_kept_gradients_trains_like_plain(scenario):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=4)
    expected = _plain_steps(reference, data, scenario)
    model, optim = _build(reference)
    params = dict(model.module.named_parameters())
    for x in data:
        for _ in range(2 if scenario == "accumulate" else 1):
            optim.backward(lm_loss(model(x), x))
        if scenario == "clip":
            optim.clip_grad_norm(0.05)
        if scenario == "read grads":  # the accessor wants the flat buffer: the chunks take their pieces in
            assert all(safe_get_full_grad(p) is not None for p in params.values())
            assert all(model.runtime.grad_pieces(c) is None for c in model.runtime.trainable_chunks())
        optim.step()
        optim.zero_grad(set_to_none=scenario != "zero_grad keeps buffers")
    state = model.state_dict()
    for (name, _), want in zip(reference.named_parameters(), expected):
        if scenario == "clip":  # the norm is summed in another order than torch's
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(state[name], want), name


@pytest.mark.parametrize("keep", [True, False], ids=["kept tensors", "flat buffer"])
def test_an_interrupted_backward_drops_the_gradients_it_began(keep):
    """A backward that raises half-way through a chunk's parameters leaves that chunk without gradients
    (none of its buffer's unwritten memory, none of the pieces) and the ledger without their bytes; the
    chunks it finished keep theirs; the next iteration trains like plain PyTorch."""
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(1)[0]
    model, optim = _build(reference, keep)
    at_raise: dict[int, int] = {}

    def fail(grad):
        at_raise.update({c.index: len(c.grad_slots_received) for c in model.runtime.trainable_chunks()})
        raise RuntimeError("injected in the backward")

    def watch(module, inputs, output):
        output.register_hook(fail)

    hook = model.module.blocks[0].register_forward_hook(watch)  # blocks.1.ln done, blocks.0.fc2.bias not
    with pytest.raises(RuntimeError, match="injected"):
        optim.backward(lm_loss(model(x), x))
    hook.remove()
    chunks = model.runtime.trainable_chunks()
    begun = [c for c in chunks if 0 < at_raise[c.index] < len(c.trainable_slots())]
    assert begun, "the injected error must fall inside a chunk's gradients"
    for chunk in begun:
        assert model.runtime.grad_pieces(chunk) is None and not chunk.grad.allocated
    holding = [c for c in chunks if model.runtime.grad_pieces(c) is not None or c.grad.allocated]
    assert _grad_bytes(model) == sum(c.grad.nbytes for c in holding)
    optim.zero_grad()
    assert _grad_bytes(model) == 0
    data = batches(2, seed=5)
    expected = _plain_steps(reference, data, "plain loop")
    for batch in data:
        optim.backward(lm_loss(model(batch), batch))
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    for (name, _), want in zip(reference.named_parameters(), expected):
        assert torch.equal(state[name], want), name
