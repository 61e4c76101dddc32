"""8-bit Adam moments in chunks (chunkmem.optim.blockwise, low_bit_adam, low_bit_rule) against torchao's
AdamW8bit / Adam8bit: the quantization format, the host kernel against the torch-op formulation, training over
every placement bit for bit equal to torchao's step run eagerly, and within one fp32 rounding a step of its
compiled step, the state dict in torchao's format both ways, checkpoints, exact bytes, and what is refused."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.optim import blockwise, low_bit_adam
from chunkmem.optim.low_bit_rule import LOW_BIT_FAMILIES
from models import TinyGPT, batches, lm_loss, resting_tier_bytes
from torchao_reference import eager_step as _eager_step

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim import quant_utils  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

CLASSES = {"adamw8bit": torchao_optim.AdamW8bit, "adam8bit": torchao_optim.Adam8bit}


def _plain(reference, make, data, step=_eager_step):
    plain = copy.deepcopy(reference)
    optimizer = make(plain.parameters())
    for x in data:
        lm_loss(plain(x), x).backward()
        step(optimizer)
        optimizer.zero_grad()
    return plain, optimizer


def _wrapped(reference, make, placement="cpu", **kwargs):
    module = copy.deepcopy(reference)
    optimizer = make(module.parameters())
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              dtype=torch.float32, chunk_size=1 << 17, **kwargs)
    return model, cm.ShardedOptimizerV2(model, optimizer)


def _train(model, optim, data):
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()


def _same_state(ours, theirs, plain_form=False):
    """``ours`` holds what torchao's ``theirs`` holds, in torchao's form or (``plain_form``) HybridAdam's."""
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert torch.equal(ours["state"][index]["step"], entry["step"])
        if plain_form:
            _same_as_plain_form(ours["state"][index], entry, index)
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours["state"][index][key], entry[key]
            assert type(a) is type(b), (index, key)
            if isinstance(b, OptimState8bit):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale), (index, key)
                assert a.signed == b.signed and a.block_size == b.block_size
            else:
                assert torch.equal(a, b), (index, key)


def _same_as_plain_form(mine, entry, index):
    """HybridAdam's plain entry (chunkmem.optim.low_bit_param) holds what torchao's ``entry`` holds: the codes and
    scales of an OptimState8bit, or its plain moments as fp32 tensors."""
    for key in ("exp_avg", "exp_avg_sq"):
        value = entry[key]
        if isinstance(value, OptimState8bit):
            assert torch.equal(mine[f"{key}_codes"], value.codes) and torch.equal(mine[f"{key}_scales"], value.scale), \
                (index, key)
        else:
            assert set(mine) == {"step", "exp_avg", "exp_avg_sq"}, index
            assert mine[key].dtype == torch.float32 and torch.equal(mine[key], value.float()), (index, key)


def test_the_map_codes_and_scales_are_torchaos():
    for signed in (True, False):
        assert torch.equal(blockwise.dynamic_map(signed), torch.tensor(quant_utils.create_dynamic_map(signed)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 64, generator=g) * torch.logspace(-9, 1, 256 * 64)[torch.randperm(256 * 64, generator=g)]
    qmap = blockwise.dynamic_map(True)
    x[:256] = 0  # an all-zero block (the scale's floor)
    thresholds = blockwise.rounding_thresholds(qmap)  # exact ties: the value just at and below each
    x[256:256 + 255] = thresholds
    x[512:512 + 255] = torch.nextafter(thresholds, torch.tensor(-2.0))
    x[1024] = float("nan")  # a block that is not finite
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel() // 256)
    blockwise.quantize_(x, codes, scales, qmap)
    scaled, ref_scales = quant_utils.scale_tensor(x, 256)
    assert torch.equal(codes, quant_utils.quantize_8bit_with_qmap(scaled, qmap))
    assert torch.equal(scales.nan_to_num(), ref_scales.nan_to_num())
    assert torch.equal(blockwise.dequantize(codes, scales, qmap).nan_to_num(),
                       quant_utils.dequant_with_qmap(codes, qmap, ref_scales).nan_to_num())


def test_the_host_kernel_runs_on_torchs_openmp_threads():
    """Like the fp32 kernel, the 8-bit one splits an update over the threads of the OpenMP runtime torch loaded
    (no second runtime, whose idle threads would spin on the cores after each of its updates)."""
    from chunkmem.optim import host_adam_ext
    kernel = low_bit_adam.kernel()
    if kernel is None:
        pytest.skip(f"no host kernel here: {low_bit_adam._KERNEL.error}")
    before = host_adam_ext._openmp_runtimes()
    assert bool(kernel.lib.chunkmem_low_bit_adam_openmp()) == bool(before)
    n = 1 << 16
    moments = low_bit_adam.Moments(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                                   torch.zeros(n // 256), torch.zeros(n // 256), torch.zeros(1), torch.zeros(1))
    hyper = low_bit_adam.LowBitHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    kernel.update(torch.randn(n), torch.randn(n), moments, [low_bit_adam.Segment(0, n, True, 0, hyper, 1)],
                  nthreads=2)
    assert host_adam_ext._openmp_runtimes() == before and bool(moments.codes_m.any())


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_the_host_kernel_equals_the_torch_formulation(out_dtype):
    kernel = low_bit_adam.kernel()
    if kernel is None:
        pytest.skip(f"no host kernel here: {low_bit_adam._KERNEL.error}")
    g = torch.Generator().manual_seed(3)
    n = 4096 * 3 + 700
    start = torch.randn(n, generator=g)
    hyper = [low_bit_adam.LowBitHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True),
             low_bit_adam.LowBitHyper(3e-3, 0.5, 0.9, 1e-6, 0.02, False)]
    results = []
    for use_kernel in (True, False):
        master = start.clone()
        moments = low_bit_adam.Moments(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                                       torch.zeros(48), torch.zeros(48), torch.zeros(700), torch.zeros(700))
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        for step in (1, 2, 3):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 10.0 ** (step - 2)
            grad[5000:5256] = 0  # a block whose moments decay to the scale's floor
            if step == 3:  # blocks that are not finite: a NaN scale, an infinite one
                grad[9000], grad[9300] = float("nan"), float("inf")
            segments = [low_bit_adam.Segment(0, 8192, True, 0, hyper[0], step),
                        low_bit_adam.Segment(8192, 4096, True, 32, hyper[1], step),
                        low_bit_adam.Segment(12288, 700, False, 0, hyper[step % 2], step)]
            grad = grad.to(out_dtype or torch.float32)
            if use_kernel:
                kernel.update(master, grad, moments, segments, 0.25, out)
            else:
                for segment in segments:
                    low_bit_adam.update_segment_torch_(master, grad, moments, segment, 0.25, out)
        results.append((master, moments, out))
    (a, ma, oa), (b, mb, ob) = results

    def same(x, y):  # NaN where the other has NaN
        return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
    assert same(a, b) and a.isnan().any()
    for x, y in zip(vars(ma).values(), vars(mb).values()):
        assert same(x, y)
    assert ma.scales_m.isnan().any() and ma.scales_v.isinf().any()
    if out_dtype is not None:
        assert same(oa, ob)


@pytest.mark.parametrize("placement", ["cpu", "cuda", "auto"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_training_equals_torchaos_step_bit_for_bit(name, placement):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(3, seed=5)
    make = lambda p: CLASSES[name](p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    plain, plain_optim = _plain(reference, make, data)
    model, optim = _wrapped(reference, make, placement)
    _train(model, optim, data)
    state = model.state_dict()
    for key, p in plain.named_parameters():
        assert torch.equal(state[key], p.detach()), key
    _same_state(optim.state_dict(), plain_optim.state_dict())


def test_without_the_host_kernel_the_torch_formulation_trains_alike(monkeypatch):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(2, seed=6)
    make = lambda p: torchao_optim.AdamW8bit(p, lr=1e-2)  # noqa: E731
    plain, plain_optim = _plain(reference, make, data)
    monkeypatch.setenv("CHUNKMEM_DISABLE_CPP_ADAM", "1")
    model, optim = _wrapped(reference, make, "cuda")
    _train(model, optim, data)
    state = model.state_dict()
    for key, p in plain.named_parameters():
        assert torch.equal(state[key], p.detach()), key
    _same_state(optim.state_dict(), plain_optim.state_dict())


def test_against_torchaos_compiled_step_within_its_roundings():
    """torchao compiles its step: the fused code rounds some fp32 operations differently from the eager one. A
    step rounds the update (at most about ``lr`` in magnitude: Adam's normalised step) and the parameter, so each
    step may differ by about one rounding of each: within ``2 * steps * eps * (max |p| + lr)``. A code differs
    (by one) only where a scaled moment lies within such a rounding of a half-way point: fewer than 1%. (Two
    parameter shapes: torchao compiles its step once per shape, some seconds each.)"""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False), torch.nn.Tanh(), torch.nn.Linear(128, 128))
    data = [torch.randn(8, 128, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    make = lambda p: torchao_optim.AdamW8bit(p, lr=1e-3)  # noqa: E731
    loss = lambda model, x: (model(x) - x.flip(1)).square().mean()  # noqa: E731
    plain = copy.deepcopy(reference)
    plain_optim = make(plain.parameters())
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, make(module.parameters()))
    for x in data:
        loss(plain, x).backward()
        plain_optim.step()
        plain_optim.zero_grad()
        optim.backward(loss(model, x))
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    for key, p in plain.named_parameters():
        bound = 2 * len(data) * torch.finfo(torch.float32).eps * (p.detach().abs().max() + 1e-3)
        assert (state[key] - p.detach()).abs().max() <= bound, key
    ours, theirs = optim.state_dict()["state"], plain_optim.state_dict()["state"]
    assert sum(isinstance(entry["exp_avg"], OptimState8bit) for entry in theirs.values()) == 2
    for index, entry in theirs.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(entry[key], OptimState8bit):
                codes = ours[index][key].codes.int() - entry[key].codes.int()
                assert codes.abs().max() <= 1 and (codes != 0).float().mean() < 0.01, (index, key)


def test_state_dict_moves_both_ways_between_chunkmem_and_torchao():
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=8), batches(2, seed=9)
    make = lambda p: torchao_optim.AdamW8bit(p, lr=1e-2)  # noqa: E731
    plain, plain_optim = _plain(reference, make, first + then)
    # chunkmem for two steps, then torchao from its state dict
    model, optim = _wrapped(reference, make)
    _train(model, optim, first)
    moved = copy.deepcopy(reference)
    moved.load_state_dict(model.state_dict())
    moved_optim = make(moved.parameters())
    moved_optim.load_state_dict(optim.state_dict())
    for x in then:
        lm_loss(moved(x), x).backward()
        _eager_step(moved_optim)
        moved_optim.zero_grad()
    for (key, a), b in zip(moved.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), key
    # torchao for two steps, then chunkmem from its state dict
    start, start_optim = _plain(reference, make, first)
    model, optim = _wrapped(start, make)
    optim.load_state_dict(start_optim.state_dict())
    _train(model, optim, then)
    state = model.state_dict()
    for key, p in plain.named_parameters():
        assert torch.equal(state[key], p.detach()), key
    _same_state(optim.state_dict(), plain_optim.state_dict())


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoints_resume_bit_for_bit(tmp_path, sharded):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=10), batches(2, seed=11)
    make = lambda p: torchao_optim.Adam8bit(p, lr=1e-2, weight_decay=0.01)  # noqa: E731
    model, optim = _wrapped(reference, make)
    _train(model, optim, first)
    cm.save_checkpoint(tmp_path / "ckpt", model, optim, sharded=sharded)
    _train(model, optim, then)
    resumed, resumed_optim = _wrapped(TinyGPT(d=64), make)
    cm.load_checkpoint(tmp_path / "ckpt", resumed, resumed_optim)
    _train(resumed, resumed_optim, then)
    for (key, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key
    _same_state(resumed_optim.state_dict(), optim.state_dict())


def test_the_families_are_counted_exactly():
    torch.manual_seed(0)
    module = TinyGPT(d=64)
    sizes = {name: p.numel() for name, p in module.named_parameters()}
    model, optim = _wrapped(module, lambda p: torchao_optim.AdamW8bit(p))
    host = model.tier_bytes()["host"]
    trainable = [c for c in model.chunks if c.trainable]
    quantized = [n for name, n in sizes.items() if blockwise.quantizes(n)]
    plain = [n for name, n in sizes.items() if not blockwise.quantizes(n)]
    padding = sum(4 for c in trainable for blocks in (sum(s.numel // 256 for s in c.slots
                                                          if blockwise.quantizes(s.numel)),) if blocks == 0)
    assert host["exp_avg_codes"] == host["exp_avg_sq_codes"] == sum(c.shard_numel for c in trainable)
    assert host["exp_avg_scales"] == host["exp_avg_sq_scales"] == 4 * sum(quantized) // 256 + padding
    assert host["exp_avg_fp32"] == host["exp_avg_sq_fp32"] >= 4 * sum(plain)
    assert set(host) == {"param", *LOW_BIT_FAMILIES}
    assert optim.update_rule.state_nbytes(trainable[0]) == sum(trainable[0].optim[f].nbytes for f in LOW_BIT_FAMILIES)


def test_what_is_not_supported_yet_is_refused_with_nothing_changed(tmp_path):
    module = TinyGPT(d=64)
    hybrid = lambda p, **options: cm.HybridAdam(p, state_dtype="8bit", **options)  # noqa: E731
    cases = [
        (dict(block_size=128), {}, {}, "block_size"),
        (dict(amsgrad=True), {}, {}, "amsgrad"),
    ] + [(dict(bf16_stochastic_round=True, make=make), model_kwargs, {}, word)
         for make in (torchao_optim.AdamW8bit, hybrid)
         for model_kwargs, word in ((dict(dtype=torch.float16), r"bf16_stochastic_round=True\) over an fp16 model"),
                                    (dict(dtype=torch.bfloat16, reuse_fp16_shard=True), "reuse_fp16_shard=True"))]
    for options, model_kwargs, optim_kwargs, word in cases:
        model = cm.ShardedModelV2(copy.deepcopy(module), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  **{"dtype": torch.float32, **model_kwargs})
        options = dict(options)
        optimizer = options.pop("make", torchao_optim.AdamW8bit)(model.module.parameters(), **options)
        with pytest.raises(cm.ChunkmemError, match=word):
            cm.ShardedOptimizerV2(model, optimizer, **optim_kwargs)
        assert not model.optimizer_attached and not optimizer.state


@pytest.mark.parametrize("dtype", [torch.float16])  # (with masters; fp32 differs only by their absence)
def test_the_planner_counts_the_8bit_families_as_a_real_run_holds_them(dtype):
    from chunkmem.plan import plan
    torch.manual_seed(0)
    batch = torch.randint(0, 64, (2, 16))
    plans = plan(lambda: TinyGPT(d=64), batch, 64 * 2**20, dtype=dtype, chunk_size=1 << 17, optimizer_state="8bit",
                 loss_fn=lambda out, x: lm_loss(out, x))
    cm.set_device_memory_capacity(64 * 2**20)
    for placement in ("cuda", "cpu", "auto"):
        module = TinyGPT(d=64)
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement, dtype=dtype,
                                  chunk_size=1 << 17)
        optim = cm.ShardedOptimizerV2(model, torchao_optim.AdamW8bit(model.parameters()), initial_scale=2**8)
        for _ in range(3):  # auto plans after its traced first step
            optim.backward(lm_loss(model(batch), batch))
            optim.step()
            optim.zero_grad()
        assert plans[placement].tier_bytes == resting_tier_bytes(model), placement


ROUNDING = {  # chunkmem's optimizer, torchao's reference
    "adamw8bit": (lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True),) * 2,
    "hybridadam-adamw": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.01, state_dtype="8bit",
                                                 bf16_stochastic_round=True),  # (torchao's default weight decay)
                         lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True)),
    "hybridadam-adam": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.05, adamw_mode=False, state_dtype="8bit",
                                                bf16_stochastic_round=True),
                        lambda p: torchao_optim.Adam8bit(p, lr=1e-2, weight_decay=0.05, bf16_stochastic_round=True)),
}


@pytest.mark.parametrize("case", list(ROUNDING))
def test_bf16_parameters_as_their_own_masters_round_stochastically_as_torchao_does(case):
    """``bf16_stochastic_round=True`` on a bf16 model: no fp32 master; each step's result rounded to bf16 with random
    numbers from the default generator, drawn per parameter in the model's order: bit for bit torchao's eager
    step under the same seed (HybridAdam's state dict in its plain form)."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64).to(torch.bfloat16)
    data = batches(3, seed=12)
    make, make_reference = ROUNDING[case]

    plain = copy.deepcopy(reference)
    plain_optim = make_reference(plain.parameters())
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.bfloat16,
                              chunk_size=1 << 16)
    optim = cm.ShardedOptimizerV2(model, make(model.parameters()))
    for n, x in enumerate(data):
        lm_loss(plain(x), x).backward()
        torch.manual_seed(100 + n)
        _eager_step(plain_optim)
        plain_optim.zero_grad()
        optim.backward(lm_loss(model(x), x))
        torch.manual_seed(100 + n)
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    for key, p in plain.named_parameters():
        assert torch.equal(state[key], p.detach().float()), key
    _same_state(optim.state_dict(), plain_optim.state_dict(), plain_form=case.startswith("hybridadam"))
    host = model.tier_bytes()["host"]
    assert "master" not in host and host["param"] == sum(2 * c.shard_numel for c in model.chunks)


def test_torchaos_4bit_state_is_kept_whole_not_stepped_as_fp32_families():
    """torchao's 4-bit Adam quantizes the state of larger tensors only (a tensor subclass): before 2026-11-27 the
    probe saw a small tensor's fp32 state, and every step after the first ran on fp32 families (silently
    another optimizer). Now its state is whole-parameter state, kept as its own step makes it."""
    from chunkmem.optim.any_optimizer import probe_state
    layout = probe_state(torchao_optim.AdamW4bit([torch.nn.Parameter(torch.zeros(4))]))
    assert layout.whole and layout.families == ()


def test_bf16_masters_hold_4_bytes_a_parameter_and_the_scales_at_rest():
    """The bytes of ``benchmarks/bytes_per_param.py --state 8bit-bf16``, exactly: a bf16 model under
    ``AdamW8bit(bf16_stochastic_round=True)``, placement ``cpu``, after ``step`` and ``zero_grad``: per chunk element
    the bf16 parameter and two codes (4 bytes), per 256 elements of a quantized parameter two fp32 scales (8 bytes),
    per element of a small parameter two bf16 moments (4 bytes); no master, no gradient."""
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(d=64), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16, chunk_size=1 << 16)
    optim = cm.ShardedOptimizerV2(model, torchao_optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True))
    for x in batches(2, seed=13):
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
    chunks = [c for c in model.chunks if c.trainable]
    assert chunks == model.chunks
    elements = sum(c.shard_numel for c in chunks)
    blocks = [sum(s.numel // 256 for s in c.slots if blockwise.quantizes(s.numel)) for c in chunks]
    small = [sum(s.numel for s in c.slots if not blockwise.quantizes(s.numel)) for c in chunks]
    scales = sum(4 * max(n, 1) for n in blocks)  # (a buffer holds at least one element)
    moments = sum(2 * max(n, 1) for n in small)
    assert resting_tier_bytes(model) == {"device": {}, "host": {
        "param": 2 * elements, "exp_avg_codes": elements, "exp_avg_sq_codes": elements, "exp_avg_scales": scales,
        "exp_avg_sq_scales": scales, "exp_avg_fp32": moments, "exp_avg_sq_fp32": moments}}
    assert sum(model.tier_bytes()["host"].values()) == 4 * elements + 2 * scales + 2 * moments
