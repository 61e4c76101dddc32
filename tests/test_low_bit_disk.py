"""torchao's 8-bit Adams (and HybridAdam(state_dtype="8bit", bf16_stochastic_round=True)) over the disk tier and with
``step_in_backward`` (chunkmem.optim.low_bit_rule,
disk_step, rounding_draws): the codes streamed from disk a whole chunk at a time, the block scales in memory, an
atomic step all or nothing, the backward's updates kept or redone, and stochastic rounding's numbers drawn where
torchao's step draws them whatever order the chunks are updated in. Every run is compared bit for bit with torchao's
own per-parameter step run eagerly on the plain model, the default generator's state included."""
from __future__ import annotations

import copy
import errno

import pytest
import torch

import chunkmem as cm
from chunkmem.storage.disk_io import inject_faults
from models import TinyGPT, batches, lm_loss
from torchao_reference import eager_step as _eager_step

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from test_low_bit_state import _same_as_plain_form  # noqa: E402

CHUNK_NUMEL = 1 << 15  # elements: several chunks


def _groups(module, grouped: bool):
    """All parameters in one group, or torchao's usual two in an order other than the model's: the vectors (no
    weight decay) first, then the matrices."""
    if not grouped:
        return module.parameters()
    params = list(module.parameters())
    return [{"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for p in params if p.dim() >= 2]}]


def _reference(dtype):
    torch.manual_seed(0)
    return TinyGPT(d=64).to(dtype)


def _plain_run(reference, make, data, grouped=False, between=None, masters=False):
    """torchao's eager step over the plain model; with ``masters``, over fp32 masters of its 16-bit parameters (what
    chunkmem keeps for a 16-bit model without stochastic rounding), the 16-bit copies computing the gradients."""
    plain = copy.deepcopy(reference)
    stepped = copy.deepcopy(plain).float() if masters else plain
    optimizer = make(_groups(stepped, grouped))
    torch.manual_seed(1234)
    for x in data:
        lm_loss(plain(x), x).backward()
        if between is not None:
            between()
        if masters:
            for master, p in zip(stepped.parameters(), plain.parameters()):
                master.grad = p.grad.float()  # (exact: torchao computes in fp32 from it)
        _eager_step(optimizer)
        optimizer.zero_grad()
        if masters:
            with torch.no_grad():
                for master, p in zip(stepped.parameters(), plain.parameters()):
                    p.copy_(master)
                    p.grad = None
    return stepped, optimizer, torch.get_rng_state()


def _chunked_run(reference, make, data, dtype, grouped=False, between=None, step_in_backward=False, **model_kwargs):
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), dtype=dtype, chunk_size=CHUNK_NUMEL * dtype.itemsize,
                              **{"tensor_placement_policy": "cpu", **model_kwargs})
    optim = cm.ShardedOptimizerV2(model, make(_groups(model.module, grouped)), step_in_backward=step_in_backward)
    torch.manual_seed(1234)
    for x in data:
        optim.backward(lm_loss(model(x), x))
        if between is not None:
            between()
        optim.step()
        optim.zero_grad()
    return model, optim, torch.get_rng_state()


def _assert_same(chunked, plain):
    (model, optim, rng), (module, optimizer, plain_rng) = chunked, plain
    state = model.state_dict()
    for key, p in module.named_parameters():
        assert torch.equal(state[key].to(p.dtype), p.detach()), key  # (the masters, where they are fp32)
    ours, theirs = optim.state_dict()["state"], optimizer.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert torch.equal(ours[index]["step"], entry["step"])
        if optim.update_rule.plain_state:  # HybridAdam's
            _same_as_plain_form(ours[index], entry, index)
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours[index][key], entry[key]
            assert type(a) is type(b), (index, key)
            if isinstance(b, OptimState8bit):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale), (index, key)
            else:
                assert torch.equal(a, b), (index, key)
    assert torch.equal(rng, plain_rng), "the default generator is not where torchao's step leaves it"


def _make(rounding: bool, decoupled: bool = True):
    cls = torchao_optim.AdamW8bit if decoupled else torchao_optim.Adam8bit
    return lambda params: cls(params, lr=1e-2, weight_decay=0.05, bf16_stochastic_round=rounding)


def _make_hybrid(rounding: bool, decoupled: bool = True):
    """HybridAdam with 8-bit state, as :func:`_make`'s torchao optimizer steps."""
    return lambda params: cm.HybridAdam(params, lr=1e-2, weight_decay=0.05, adamw_mode=decoupled, state_dtype="8bit",
                                        bf16_stochastic_round=rounding)


def test_the_chunk_size_cuts_the_quantized_parameters_into_several_chunks():
    """The layout the tests below rely on: several trainable chunks, most parameters quantized."""
    model = cm.ShardedModelV2(TinyGPT(d=64), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16, chunk_size=CHUNK_NUMEL * 2)
    assert len([c for c in model.chunks if c.trainable]) >= 3
    assert sum(p.numel() >= 4096 for p in model.module.parameters()) >= 6


@pytest.mark.parametrize("grouped", [False, True])
def test_stochastic_rounding_draws_in_torchaos_order_whatever_the_groups(grouped):
    """Two param groups listing the vectors before the matrices: torchao draws in the groups' order, not the
    model's; chunkmem gives each parameter those numbers, and leaves the generator where torchao's step does."""
    reference, data = _reference(torch.bfloat16), batches(3, seed=21)
    plain = _plain_run(reference, _make(True), data, grouped)
    _assert_same(_chunked_run(reference, _make(True), data, torch.bfloat16, grouped), plain)


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_step_in_backward_in_memory_equals_torchao(dtype, rounding):
    reference, data = _reference(dtype), batches(3, seed=22)
    plain = _plain_run(reference, _make(rounding), data, grouped=True, masters=dtype != torch.float32 and not rounding)
    chunked = _chunked_run(reference, _make(rounding), data, dtype, grouped=True, step_in_backward=True)
    assert chunked[1].kept_backward_updates > 0  # the backward's updates stood
    _assert_same(chunked, plain)


HYBRID_CASES = {  # step_in_backward, the model's options, AdamW's weight decay (else Adam's)
    "in the backward, in memory": (True, {}, True),
    "parameters on disk, in place": (False, dict(offload_optimizer="disk", offload_param="disk", atomic_step=False),
                                     False),
    "in the backward, parameters in memory, atomic": (True, dict(offload_optimizer="disk", atomic_step=True), True),
}


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_hybridadam_with_bf16_stochastic_round_equals_torchao_in_the_backward_and_on_disk(tmp_path, case):
    """HybridAdam(state_dtype="8bit", bf16_stochastic_round=True) draws torchao's numbers whatever order the chunks
    are updated in (the backward's, the disk step's), leaves the generator where torchao's step does, and keeps its
    plain state dict."""
    step_in_backward, model_options, decoupled = HYBRID_CASES[case]
    if "offload_optimizer" in model_options:
        model_options = dict(model_options, nvme_path=str(tmp_path), buffer_size=8192)
    reference, data = _reference(torch.bfloat16), batches(3, seed=27)
    plain = _plain_run(reference, _make(True, decoupled), data, grouped=True)
    chunked = _chunked_run(reference, _make_hybrid(True, decoupled), data, torch.bfloat16, grouped=True,
                           step_in_backward=step_in_backward, **model_options)
    model, optim = chunked[0], chunked[1]
    assert optim.update_rule.stochastic_round and "master" not in model.tier_bytes()["host"]
    if step_in_backward:
        assert optim.kept_backward_updates > 0
    if "offload_optimizer" in model_options:
        assert model.tier_bytes()["disk"]["exp_avg_codes"] == sum(c.shard_numel for c in model.chunks if c.trainable)
    _assert_same(chunked, plain)


def test_numbers_drawn_between_the_backward_and_the_step_are_respected():
    """The user draws random numbers after the backward: torchao's step then draws after them, so the updates the
    backward made with the numbers before are undone and redone with the right ones."""
    reference, data = _reference(torch.bfloat16), batches(2, seed=23)
    between = lambda: torch.rand(7)  # noqa: E731
    plain = _plain_run(reference, _make(True), data, between=between)
    chunked = _chunked_run(reference, _make(True), data, torch.bfloat16, between=between, step_in_backward=True)
    assert chunked[1].kept_backward_updates == 0
    _assert_same(chunked, plain)


DISK_CASES = {
    "fp32 atomic": (torch.float32, False, dict(atomic_step=True)),
    "fp32 in place": (torch.float32, False, dict(atomic_step=False)),
    "bf16 masters on disk": (torch.bfloat16, False, dict(atomic_step=True)),
    "bf16 rounded, parameters on disk": (torch.bfloat16, True, dict(atomic_step=True, offload_param="disk")),
    # the parameters in host memory are their own masters: an atomic step journals them (before 2026-11-27 the
    # journal's file was not made for them and the step failed)
    "bf16 rounded, parameters in memory": (torch.bfloat16, True, dict(atomic_step=True)),
    "bf16 rounded in place, parameters on disk": (torch.bfloat16, True, dict(atomic_step=False, offload_param="disk")),
}


@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("case", list(DISK_CASES))
def test_the_disk_tier_equals_torchao(tmp_path, case, step_in_backward):
    dtype, rounding, disk = DISK_CASES[case]
    if step_in_backward and not disk["atomic_step"] and dtype != torch.float32 and not rounding:
        pytest.skip("(no such case)")
    reference, data = _reference(dtype), batches(3, seed=24)
    plain = _plain_run(reference, _make(rounding, decoupled=case != "fp32 in place"), data, grouped=True,
                       masters=dtype != torch.float32 and not rounding)
    # I/O buffers smaller than a chunk's shard: the 8-bit update still gets each chunk whole
    chunked = _chunked_run(reference, _make(rounding, decoupled=case != "fp32 in place"), data, dtype, grouped=True,
                           step_in_backward=step_in_backward, offload_optimizer="disk", nvme_path=str(tmp_path),
                           buffer_size=8192, **disk)
    model = chunked[0]
    tiers = model.tier_bytes()
    assert tiers["disk"]["exp_avg_codes"] == sum(c.shard_numel for c in model.chunks if c.trainable)
    assert "exp_avg_codes" not in tiers["host"] and tiers["host"]["exp_avg_scales"] > 0
    # the optimizer's bytes: on disk the codes, the masters and the parameters that are their own masters (the
    # parameters on disk were counted on the host before 2026-11-27)
    assert chunked[1].get_memory_usage(with_disk=True)[2] == sum(tiers["disk"].values())
    if step_in_backward:
        assert chunked[1].kept_backward_updates > 0
    _assert_same(chunked, plain)


@pytest.mark.parametrize("params", ["disk", "memory"])  # in memory: restored from the journal
def test_a_failed_atomic_disk_step_changes_nothing_and_the_next_one_equals_torchao(tmp_path, params):
    reference, data = _reference(torch.bfloat16), batches(3, seed=25)
    plain = _plain_run(reference, _make(True), data)
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.bfloat16,
                              chunk_size=CHUNK_NUMEL * 2, offload_optimizer="disk", nvme_path=str(tmp_path),
                              **(dict(offload_param="disk") if params == "disk" else {}))
    optim = cm.ShardedOptimizerV2(model, _make(True)(model.module.parameters()))
    torch.manual_seed(1234)
    for n, x in enumerate(data):
        optim.backward(lm_loss(model(x), x))
        if n == 1:
            before_params = {k: v.clone() for k, v in model.state_dict().items()}
            scales = [c.optim["exp_avg_scales"].read().clone() for c in model.chunks if c.trainable]
            rng = torch.get_rng_state()
            with inject_faults(write_errno=errno.ENOSPC, what="chunk", after=3):
                with pytest.raises(cm.DiskStepError):
                    optim.step()
            for key, value in model.state_dict().items():
                assert torch.equal(value, before_params[key]), key
            for kept, chunk in zip(scales, [c for c in model.chunks if c.trainable]):
                assert torch.equal(chunk.optim["exp_avg_scales"].read(), kept)
            assert torch.equal(torch.get_rng_state(), rng)
        optim.step()
        optim.zero_grad()
    _assert_same((model, optim, torch.get_rng_state()), plain)


class _Unavailable:
    """Stands in for a native library that failed to load."""

    @staticmethod
    def get(stacklevel: int = 2):
        return None


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_each_parameter_gets_torchs_numbers_in_any_order(monkeypatch, engine):
    """The draws of a step, asked for backwards and out of order, equal torch.randint's in the reference's order,
    and the end state is the generator's after them: with the C++ twister and with torch's own generator."""
    from chunkmem.optim import rounding_draws
    if engine == "torch":
        monkeypatch.setattr(rounding_draws, "_HOST_DRAWS", _Unavailable())
    else:
        assert rounding_draws._HOST_DRAWS.get() is not None, rounding_draws._HOST_DRAWS.error
    sizes = [5, 700, 624, 1, 3000, 2, 1250]
    torch.manual_seed(7)
    expected = [torch.randint(0, 1 << 16, (n,), dtype=torch.int32) for n in sizes]
    end = torch.get_rng_state()
    torch.manual_seed(7)
    sequence = rounding_draws.DrawSequence(torch.device("cpu"), list(enumerate(sizes)))
    assert isinstance(sequence._draws, rounding_draws.HostDraws if engine == "native" else rounding_draws.TorchDraws)
    for position in (6, 4, 5, 0, 3, 1, 2, 6):
        assert torch.equal(sequence.draw(position), expected[position]), position
    assert torch.equal(sequence.end_state(), end)
    assert sequence.holds_for(list(enumerate(sizes))) and not sequence.holds_for(list(enumerate(sizes[:-1])))


def test_numbers_drawn_after_a_backward_whose_disk_updates_cannot_be_undone_are_refused(tmp_path):
    reference, data = _reference(torch.bfloat16), batches(1, seed=26)
    with pytest.raises(cm.UnsupportedOperationError, match="random generator"):
        _chunked_run(reference, _make(True), data, torch.bfloat16, between=lambda: torch.rand(3),
                     step_in_backward=True, offload_optimizer="disk", offload_param="disk", atomic_step=False,
                     nvme_path=str(tmp_path))


def test_a_chunks_numbers_buffer_is_reused_only_when_nothing_holds_it():
    """The host buffer a chunk's numbers are drawn into is the thread's last one when its size matches and neither
    it nor a view of it is held any more; never one a caller or another thread still holds."""
    import threading

    from chunkmem.optim import rounding_draws

    cpu = torch.device("cpu")
    first = rounding_draws.numbers_buffer(10, cpu)
    address = first.data_ptr()
    held = rounding_draws.numbers_buffer(10, cpu)
    assert held.data_ptr() != address  # the first is still held
    address = held.data_ptr()
    del first, held
    again = rounding_draws.numbers_buffer(10, cpu)
    assert again.data_ptr() == address  # nothing holds it: reused
    view = again[2:5]
    del again
    assert rounding_draws.numbers_buffer(10, cpu).data_ptr() != address  # a view still reads it
    del view
    assert rounding_draws.numbers_buffer(12, cpu).numel() == 12
    mine = rounding_draws.numbers_buffer(12, cpu)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(rounding_draws.numbers_buffer(12, cpu).data_ptr()))
    thread.start()
    thread.join()
    assert theirs[0] != mine.data_ptr()
