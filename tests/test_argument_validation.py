"""Argument validation (task H1): wrong types are TypeErrors, values no training can use are refused at
the boundary, and a refused argument leaves the module, the capacity and every other state unchanged."""
import copy

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from models import TinyGPT


def assert_type_error(exc_info, argument):
    err = exc_info.value
    assert isinstance(err, TypeError) and isinstance(err, cm.ChunkmemError)
    assert isinstance(err, cm.InvalidArgumentError)  # compatibility: old handlers still catch it
    assert err.argument == argument


def snapshot(module):
    """Each parameter's object, class, dtype, storage pointer and value."""
    return [(name, p, type(p.data), p.dtype, p.data.data_ptr(), p.detach().clone())
            for name, p in module.named_parameters()]


def assert_untouched(module, before):
    after = list(module.named_parameters())
    assert [n for n, _ in after] == [b[0] for b in before]
    for (name, p), (_, p0, cls, dtype, ptr, value) in zip(after, before):
        assert p is p0, name
        assert type(p.data) is cls is torch.Tensor, name
        assert p.dtype == dtype and p.data.data_ptr() == ptr, name
        assert torch.equal(p.detach(), value), name
        assert not hasattr(p, "_chunkmem_slot"), name
    assert not getattr(module, "_chunkmem_wrapped", False)


def wrap(module, **kwargs):
    kwargs.setdefault("tensor_placement_policy", "cpu")
    return cm.ShardedModelV2(module, cm.TensorShardStrategy(), **kwargs)


# ---- the error classes ----------------------------------------------------------------------------

def test_argument_type_error_is_type_value_and_chunkmem_error():
    err = cm.ArgumentTypeError("x", "y", "an int")
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    assert isinstance(err, cm.InvalidArgumentError) and isinstance(err, cm.ChunkmemError)
    assert str(err) == "x='y' is not allowed: expected an int"
    assert "ArgumentTypeError" in cm.__all__


def test_check_helpers_split_type_from_value():
    from chunkmem.errors import check_choice, check_number, check_type

    for call in (lambda: check_type("a", 1, str, "a str"), lambda: check_type("a", True, int, "an int"),
                 lambda: check_number("a", "1"), lambda: check_number("a", None), lambda: check_number("a", True),
                 lambda: check_number("a", 1.0, integer=True), lambda: check_choice("a", 3, ("x", "y"))):
        with pytest.raises(cm.ArgumentTypeError):
            call()
    for call in (lambda: check_number("a", float("nan")), lambda: check_number("a", -1, low=0),
                 lambda: check_number("a", float("inf"), finite=True), lambda: check_choice("a", "z", ("x", "y"))):
        with pytest.raises(cm.InvalidArgumentError) as info:
            call()
        assert not isinstance(info.value, TypeError)
    check_number("a", float("inf"), low=0)  # infinity stays allowed where it means something (max_norm)
    check_number("a", 3, low=0, high=3, finite=True)


# ---- ShardedModelV2: every refusal leaves the module as it was ---------------------------------------

@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(reduce_scatter_bucket_size_mb=float("inf")), cm.InvalidArgumentError, r"reduce_scatter_bucket_size_mb=inf"),
    (dict(reduce_scatter_bucket_size_mb=1e300), cm.InvalidArgumentError, r"<= 2\*\*43"),
    (dict(reduce_scatter_bucket_size_mb=float("nan")), cm.InvalidArgumentError, "reduce_scatter_bucket_size_mb=nan"),
    (dict(reduce_scatter_bucket_size_mb="25"), cm.ArgumentTypeError, "reduce_scatter_bucket_size_mb='25'"),
    (dict(gradient_predivide_factor=float("inf")), cm.InvalidArgumentError, "gradient_predivide_factor=inf"),
    (dict(fp32_reduce_scatter=1), cm.ArgumentTypeError, "fp32_reduce_scatter=1"),
    (dict(reuse_fp16_shard="no"), cm.ArgumentTypeError, "reuse_fp16_shard='no'"),
    (dict(tensor_placement_policy=None), cm.ArgumentTypeError, "tensor_placement_policy=None"),
    (dict(dtype="float16"), cm.ArgumentTypeError, "dtype='float16'"),
    (dict(dtype=torch.float64), cm.InvalidArgumentError, "dtype=torch.float64"),
    (dict(chunk_size=2.0**20), cm.ArgumentTypeError, "chunk_size=1048576.0"),
    (dict(chunk_size=4097), cm.InvalidArgumentError, r"chunk_size=4097.*multiple of 2 bytes.*float16"),
    (dict(chunk_size=4098, dtype=torch.float32), cm.InvalidArgumentError, r"chunk_size=4098.*multiple of 4 bytes"),
    (dict(chunk_size=1), cm.InvalidArgumentError, "chunk_size=1 "),
    (dict(offload_param_frac=float("inf"), tensor_placement_policy="static"), cm.InvalidArgumentError,
     "offload_param_frac=inf"),
])
def test_rejected_model_argument_leaves_module_untouched(kwargs, error, pattern):
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = snapshot(module)
    with pytest.raises(error, match=pattern) as info:
        wrap(module, **kwargs)
    if error is cm.ArgumentTypeError:
        assert_type_error(info, info.value.argument)
    else:
        assert not isinstance(info.value, TypeError)
    assert_untouched(module, before)
    model = wrap(module)  # the module is still whole: it wraps and runs afterwards
    assert torch.isfinite(model(torch.ones(1, 8))).all()


def test_wrong_module_and_strategy_types_are_type_errors():
    with pytest.raises(TypeError) as info:
        wrap("a module")
    assert_type_error(info, "module")
    with pytest.raises(TypeError, match="shard_strategy='tensor'") as info:
        cm.ShardedModelV2(nn.Linear(2, 2), "tensor")
    assert_type_error(info, "shard_strategy")


def test_module_wrapped_twice_is_refused_and_first_wrapper_still_trains():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference = copy.deepcopy(module)
    model = wrap(module, dtype=torch.float32)

    def chunk_views() -> list:  # where each parameter points (past the guard: .data there is a copy)
        with torch._C.DisableTorchFunctionSubclass():
            return [(p._chunkmem_slot, p.data_ptr()) for p in module.parameters()]

    weights = chunk_views()
    for again, which in [(module, "it is already wrapped"), (module[0], "it is already wrapped"),
                         (nn.Sequential(module), "its submodule '0' is already wrapped")]:
        with pytest.raises(cm.InvalidArgumentError, match=f"module='Sequential|Linear'.*{which}"):
            wrap(again, dtype=torch.float32)
    assert chunk_views() == weights
    # the first wrapper is intact: one step equals plain torch AdamW (the second wrap used to break backward)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=0.1))
    plain_optim = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    x = torch.randn(3, 4)
    optim.backward(model(x).sum())
    assert optim.step() is not False
    reference(x).sum().backward()
    plain_optim.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_a_failed_wrap_does_not_mark_the_module():
    module = nn.Linear(4, 4)
    with pytest.raises(cm.InvalidArgumentError):
        wrap(module, chunk_size=8)  # smaller than the weight
    wrap(module)  # the refused wrap did not count as a wrap


def test_integer_parameter_refused_naming_it():
    module = nn.Linear(3, 3)
    module.counts = nn.Parameter(torch.tensor([100001, 7, 2**40]), requires_grad=False)
    before = snapshot(module)
    with pytest.raises(cm.InvalidArgumentError, match=r"module parameter 'counts' of dtype=torch.int64"):
        wrap(module)
    assert_untouched(module, before)
    assert module.counts.tolist() == [100001, 7, 2**40]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex_parameters_refused(dtype):
    with pytest.warns(UserWarning) if dtype.is_complex else _no_warning():
        module = nn.Linear(3, 3).to(dtype)
    before = snapshot(module)
    with pytest.raises(cm.InvalidArgumentError, match=f"parameter 'weight' of dtype={dtype}"):
        wrap(module, dtype=torch.float32)
    assert_untouched(module, before)


def test_module_without_parameters_refused():
    module = nn.Sequential(nn.ReLU())
    module.register_buffer("scale", torch.ones(2))
    with pytest.raises(cm.InvalidArgumentError, match="module='Sequential'.*at least one parameter"):
        wrap(module)
    assert module.scale.dtype == torch.float32


def _no_warning():
    import contextlib
    return contextlib.nullcontext()


# ---- ZeroInitContext ----------------------------------------------------------------------------------

def context(**kwargs):
    kwargs.setdefault("target_device", "cpu")
    kwargs.setdefault("shard_strategy", cm.TensorShardStrategy())
    return cm.ZeroInitContext(**kwargs)


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(target_device=None), cm.ArgumentTypeError, "target_device=None"),
    (dict(target_device=1.5), cm.ArgumentTypeError, "target_device=1.5"),
    (dict(target_device=True), cm.ArgumentTypeError, "target_device=True"),
    (dict(shard_param="yes"), cm.ArgumentTypeError, "shard_param='yes'"),
    (dict(dtype="fp16"), cm.ArgumentTypeError, "dtype='fp16'"),
    (dict(chunk_size="1MiB"), cm.ArgumentTypeError, "chunk_size='1MiB'"),
    (dict(chunk_size=1), cm.InvalidArgumentError, r"chunk_size=1 .*at least 128 bytes"),
    (dict(chunk_size=126), cm.InvalidArgumentError, r"chunk_size=126 .*at least 128 bytes"),
    (dict(chunk_size=255, dtype=torch.float32), cm.InvalidArgumentError, r"multiple of 4 bytes.*at least 256"),
    (dict(model_numel_tensor=[0]), cm.ArgumentTypeError, r"model_numel_tensor=\[0\]"),
    (dict(model_numel_tensor=torch.zeros(2)), cm.InvalidArgumentError, "model_numel_tensor="),
])
def test_zero_init_context_refusals(kwargs, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        context(**kwargs)
    assert isinstance(info.value, TypeError) == (error is cm.ArgumentTypeError)


def test_zero_init_context_smallest_chunk_size_is_accepted():
    with context(chunk_size=128, dtype=torch.float16):
        module = nn.Linear(8, 8)  # 64 weight elements fill one 128-byte chunk exactly
    chunks = {id(p._chunkmem_slot.chunk): p._chunkmem_slot.chunk for p in module.parameters()}
    assert sorted(c.numel for c in chunks.values()) == [64, 64]


def test_zero_init_context_refuses_integer_parameter_and_restores_classes():
    class WithCounts(nn.Module):
        def __init__(self):
            super().__init__()
            self.counts = nn.Parameter(torch.tensor([100001, 7, 2**40]), requires_grad=False)
            self.lin = nn.Linear(2, 2)

    init_before = nn.Linear.__init__
    with pytest.raises(cm.InvalidArgumentError, match=r"parameter 'WithCounts.counts' of dtype=torch.int64"):
        with context():
            WithCounts()
    assert nn.Linear.__init__ is init_before


# ---- HybridAdam -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error", [
    (dict(bias_correction="no"), cm.ArgumentTypeError), (dict(bias_correction=1), cm.ArgumentTypeError),
    (dict(adamw_mode=None), cm.ArgumentTypeError), (dict(lr="0.1"), cm.ArgumentTypeError),
    (dict(betas=0.9), cm.ArgumentTypeError), (dict(betas=(0.9, "0.99")), cm.ArgumentTypeError),
    (dict(betas=(True, 0.9)), cm.ArgumentTypeError), (dict(betas=(0.9, 0.99, 0.5)), cm.InvalidArgumentError),
    (dict(lr=float("inf")), cm.InvalidArgumentError), (dict(eps=float("inf")), cm.InvalidArgumentError),
    (dict(weight_decay=float("inf")), cm.InvalidArgumentError), (dict(lr=float("nan")), cm.InvalidArgumentError),
    (dict(bf16_stochastic_round=1), cm.ArgumentTypeError), (dict(bf16_stochastic_round=None), cm.ArgumentTypeError),
    (dict(bf16_stochastic_round=True), cm.InvalidArgumentError),  # (with fp32 state: only with state_dtype="8bit")
])
def test_hybrid_adam_refusals(kwargs, error):
    (argument, value), = kwargs.items()
    with pytest.raises(error, match=f"^{argument}=") as info:
        cm.HybridAdam(nn.Linear(2, 2).parameters(), **kwargs)
    assert isinstance(info.value, TypeError) == (error is cm.ArgumentTypeError)
    assert info.value.argument == argument


def test_optimizer_type_errors():
    module = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="sharded_model='Linear'") as info:
        cm.ShardedOptimizerV2(module, cm.HybridAdam(module.parameters()))
    assert_type_error(info, "sharded_model")
    model = wrap(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="optimizer='list'") as info:
        cm.ShardedOptimizerV2(model, list(model.parameters()))
    assert_type_error(info, "optimizer")
    with pytest.raises(TypeError, match="verbose=1"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), verbose=1)
    assert not model.optimizer_attached


# ---- the loss scaler: every reachable scale stays finite in fp32 -------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    (dict(growth_factor=float("inf")), "growth_factor=inf"),
    (dict(max_scale=float("inf")), "max_scale=inf"),
    (dict(max_scale=1e300), r"max_scale=1e\+300.*2\*\*126"),
    (dict(max_scale=2.0**127, initial_scale=2.0**10), r"max_scale=1.7"),
    (dict(initial_scale=float("inf")), "initial_scale=inf"),
    (dict(min_scale=2.0**-127, initial_scale=1.0), "min_scale="),
    (dict(min_scale=0.0), "min_scale=0.0"),
    (dict(backoff_factor=float("nan")), "backoff_factor=nan"),
])
def test_scaler_knobs_that_break_training_are_refused(kwargs, pattern):
    with pytest.raises(cm.InvalidArgumentError, match=pattern):
        cm.DynamicGradScaler(**kwargs)
    model = wrap(nn.Linear(4, 4), dtype=torch.float16)
    with pytest.raises(cm.InvalidArgumentError, match=pattern):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), **kwargs)
    assert not model.optimizer_attached


def test_scaler_type_errors():
    for kwargs in (dict(initial_scale="big"), dict(growth_interval=2.0), dict(hysteresis=True)):
        with pytest.raises(TypeError):
            cm.DynamicGradScaler(**kwargs)


def test_extreme_allowed_scaler_reaches_only_finite_fp32_scales():
    """The bounds are tight: the most extreme accepted knobs keep scale and 1/scale finite in fp32 over
    any run of growth and back-off."""
    scaler = cm.DynamicGradScaler(initial_scale=1.0, min_scale=2.0**-126, max_scale=2.0**126,
                                  growth_factor=1e300, backoff_factor=1e-300, growth_interval=1, hysteresis=1)
    seen = []
    for overflow in [False] * 3 + [True] * 3 + [False]:
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [2.0**126] * 3 + [2.0**-126] * 3 + [2.0**126]
    for scale in seen:
        as_fp32 = torch.tensor(scale, dtype=torch.float32)
        assert torch.isfinite(as_fp32) and torch.isfinite(1 / as_fp32) and as_fp32 > 0


# ---- set_device_memory_capacity ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,error", [
    (0, cm.InvalidArgumentError), (-1, cm.InvalidArgumentError), (1.5, cm.InvalidArgumentError),
    ("0.5B", cm.InvalidArgumentError), ("1.5B", cm.InvalidArgumentError), ("0KiB", cm.InvalidArgumentError),
    (float("inf"), cm.InvalidArgumentError), (float("nan"), cm.InvalidArgumentError),
    (True, cm.ArgumentTypeError), ([1024], cm.ArgumentTypeError), (b"1KiB", cm.ArgumentTypeError),
])
def test_capacity_must_be_a_positive_whole_byte_count(value, error):
    cm.set_device_memory_capacity(4096)
    with pytest.raises(error, match="^nbytes=") as info:
        cm.set_device_memory_capacity(value)
    assert isinstance(info.value, TypeError) == (error is cm.ArgumentTypeError)
    assert cm.device_memory_capacity() == 4096  # unchanged


@pytest.mark.parametrize("value,nbytes", [(1, 1), (1e9, 10**9), ("1.5KB", 1500), ("0.5KiB", 512),
                                          ("128 KiB", 128 * 1024)])
def test_small_and_whole_capacities_are_accepted(value, nbytes):
    cm.set_device_memory_capacity(value)
    assert cm.device_memory_capacity() == nbytes


def test_capacity_environment_variable_of_zero_is_refused(monkeypatch):
    monkeypatch.setenv("CHUNKMEM_DEVICE_MEMORY", "0B")
    with pytest.raises(cm.InvalidArgumentError, match="CHUNKMEM_DEVICE_MEMORY='0B'"):
        cm.device_memory_capacity()


@pytest.mark.parametrize("argument", ["secondary_partition_size", "gather_node_size"])
def test_group_sizes_that_do_not_fit_one_rank_are_refused_before_packing(argument):
    """Before 2026-11-27 these were refused after the parameters were packed into chunks, and wrapping the module
    again then failed with an AttributeError."""
    torch.manual_seed(0)
    module = TinyGPT()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(cm.InvalidArgumentError, match=argument):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                          **{argument: 2})
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32)  # wraps as new
    assert torch.equal(model.state_dict()["wte.weight"], before["wte.weight"])


@pytest.mark.parametrize("strategy, extra", [(cm.TensorShardStrategy, {"quantized_weights": True}),
                                             (cm.BucketTensorShardStrategy, {})])
def test_the_hierarchical_gather_is_refused_with_gathers_that_are_not_hierarchical(strategy, extra):
    """``gather_node_size`` with quantized gathers or the bucketed strategy: one clear error naming it, and the
    module left as it was (checked where the knobs and the strategy meet: ModelSettings)."""
    torch.manual_seed(0)
    module = TinyGPT()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(cm.InvalidArgumentError, match="gather_node_size=1 is not allowed: expected None with "
                                                      "quantized_weights or BucketTensorShardStrategy"):
        cm.ShardedModelV2(module, strategy(), tensor_placement_policy="cpu", gather_node_size=1, **extra)
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
