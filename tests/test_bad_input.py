"""Every bad input raises a clear error naming the argument, the value and what is allowed."""
import pytest
import torch
import torch.nn as nn

import chunkmem as cm


def linear_model(**kwargs):
    kwargs.setdefault("tensor_placement_policy", "cpu")
    return cm.ShardedModelV2(nn.Linear(4, 4), cm.TensorShardStrategy(), **kwargs)


def test_unknown_placement_policy_leaves_module_untouched():
    module = nn.Linear(4, 4)
    with pytest.raises(cm.InvalidArgumentError, match=r"tensor_placement_policy='gpu'.*'cuda', 'cpu', 'auto', 'static'"):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="gpu")
    assert module.weight.dtype == torch.float32 and not hasattr(module.weight, "_chunkmem_slot")


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "0.5"])
def test_gpu_margin_mem_ratio_outside_range(ratio):
    model = linear_model()
    with pytest.raises(cm.InvalidArgumentError, match="gpu_margin_mem_ratio"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), gpu_margin_mem_ratio=ratio)
    assert not model.optimizer_attached


def test_gpu_margin_mem_ratio_without_auto_warns():
    model = linear_model()
    with pytest.warns(UserWarning, match="gpu_margin_mem_ratio=0.5 has no effect"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), gpu_margin_mem_ratio=0.5)


def test_optimizer_needs_a_sharded_model():
    module = nn.Linear(4, 4)
    with pytest.raises(cm.InvalidArgumentError, match="sharded_model='Linear'.*ShardedModelV2"):
        cm.ShardedOptimizerV2(module, cm.HybridAdam(module.parameters()))


def test_unsupported_optimizer_and_foreign_parameters():
    model = linear_model()
    with pytest.raises(cm.InvalidArgumentError, match="optimizer='LBFGS'.*stand-in.*closure"):
        cm.ShardedOptimizerV2(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(cm.ArgumentTypeError, match="optimizer='dict'"):
        cm.ShardedOptimizerV2(model, {"lr": 0.1})
    with pytest.raises(cm.InvalidArgumentError, match="own parameters only"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(nn.Linear(2, 2).parameters()))
    with pytest.raises(cm.InvalidArgumentError, match="without \\['bias'\\]"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam([model.module.weight]))
    cm.ShardedOptimizerV2(model, torch.optim.AdamW(model.parameters()))  # plain AdamW is accepted


def test_second_optimizer_refused():
    model = linear_model()
    cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    with pytest.raises(cm.InvalidArgumentError, match="already has a ShardedOptimizerV2"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(reuse_fp16_shard=True, dtype=torch.float32), "reuse_fp16_shard=True"),
    (dict(dtype=torch.int8), "dtype=torch.int8"),
    (dict(chunk_size=-5), "chunk_size=-5"),
    (dict(chunk_size=8), r"chunk_size=8.*>= 32 bytes .*'weight'"),
    (dict(reduce_scatter_bucket_size_mb=0), "reduce_scatter_bucket_size_mb=0"),
    (dict(gradient_predivide_factor=0.0), "gradient_predivide_factor=0.0"),
    (dict(fp32_reduce_scatter="yes"), "fp32_reduce_scatter='yes'"),
    (dict(process_group="world"), "process_group='world'"),
    (dict(offload_param_frac=0.5), "offload_param_frac"),
    (dict(tensor_placement_policy="static", offload_optim_frac=1.5), "offload_optim_frac=1.5"),
])
def test_sharded_model_arguments(kwargs, pattern):
    module = nn.Linear(4, 4)
    with pytest.raises(cm.InvalidArgumentError, match=pattern):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), **{"tensor_placement_policy": "cpu", **kwargs})
    assert not hasattr(module.weight, "_chunkmem_slot")


def test_shard_strategy_type():
    with pytest.raises(cm.InvalidArgumentError, match="shard_strategy='tensor'"):
        cm.ShardedModelV2(nn.Linear(4, 4), "tensor")
    with pytest.raises(cm.InvalidArgumentError, match="shard_strategy=None"):
        cm.ZeroInitContext(target_device="cpu", shard_strategy=None)


@pytest.mark.parametrize("text", ["lots", "2 GiBs", "-1", "1.5 XB", ""])
def test_capacity_string_that_does_not_parse(text, monkeypatch):
    with pytest.raises(cm.InvalidArgumentError, match="nbytes="):
        cm.set_device_memory_capacity(text)
    monkeypatch.setenv("CHUNKMEM_DEVICE_MEMORY", text)
    if text:
        with pytest.raises(cm.InvalidArgumentError, match="CHUNKMEM_DEVICE_MEMORY="):
            cm.device_memory_capacity()


def test_scaler_arguments():
    model = linear_model(dtype=torch.float16)
    for kwargs, pattern in [(dict(initial_scale=0), "initial_scale=0"), (dict(hysteresis=0), "hysteresis=0"),
                            (dict(growth_factor=1.0), "growth_factor=1.0"), (dict(backoff_factor=2), "backoff_factor=2"),
                            (dict(min_scale=4, initial_scale=2), "initial_scale=2"),
                            (dict(growth_interval=1.5), "growth_interval=1.5")]:
        with pytest.raises(cm.InvalidArgumentError, match=pattern):
            cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), **kwargs)


def test_hybrid_adam_arguments():
    params = nn.Linear(2, 2).parameters()
    for kwargs, pattern in [(dict(lr=-1), "lr=-1"), (dict(betas=(0.9, 1.0)), "betas="), (dict(eps=-1e-8), "eps="),
                            (dict(weight_decay=-0.1), "weight_decay=")]:
        with pytest.raises(cm.InvalidArgumentError, match=pattern):
            cm.HybridAdam(params, **kwargs)


def test_zero_init_context_arguments():
    with pytest.raises(cm.InvalidArgumentError, match="target_device='tpu'"):
        cm.ZeroInitContext(target_device="tpu", shard_strategy=cm.TensorShardStrategy())
    with pytest.raises(cm.InvalidArgumentError, match="dtype=torch.float64"):
        cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(cm.InvalidArgumentError, match="CUDA is not available"):
            cm.ZeroInitContext(target_device="cuda", shard_strategy=cm.TensorShardStrategy())


def test_context_dtype_mismatch():
    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.bfloat16):
        module = nn.Linear(4, 4)
    with pytest.raises(cm.InvalidArgumentError, match="dtype=torch.float16.*torch.bfloat16"):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float16)


def test_clip_arguments():
    model = linear_model()
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    with pytest.raises(cm.InvalidArgumentError, match="max_norm=0"):
        optim.clip_grad_norm(0)


def test_wrong_types_above_are_type_errors():
    """The wrong-type cases of this file raise a TypeError (still an InvalidArgumentError); wrong values
    do not."""
    module = nn.Linear(4, 4)
    for call in (lambda: cm.ShardedModelV2(module, "tensor"),
                 lambda: cm.ShardedModelV2(module, cm.TensorShardStrategy(), fp32_reduce_scatter="yes"),
                 lambda: cm.ShardedOptimizerV2(module, cm.HybridAdam(module.parameters())),
                 lambda: cm.ZeroInitContext(target_device="cpu", shard_strategy=None),
                 lambda: cm.DynamicGradScaler(growth_interval=1.5)):
        with pytest.raises(TypeError) as info:
            call()
        assert isinstance(info.value, cm.ChunkmemError) and isinstance(info.value, cm.InvalidArgumentError)
    for call in (lambda: cm.ShardedModelV2(module, cm.TensorShardStrategy(), chunk_size=-5),
                 lambda: cm.DynamicGradScaler(initial_scale=0)):
        with pytest.raises(cm.InvalidArgumentError) as info:
            call()
        assert not isinstance(info.value, TypeError)
    assert not hasattr(module.weight, "_chunkmem_slot")
