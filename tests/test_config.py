"""chunkmem.initialize: the ColossalAI tutorial config and DeepSpeed's example ZeRO configs, each against
the same wrappers built by hand (bitwise), plus the errors and warnings of the key checks."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.faces import config as config_module
from chunkmem.errors import NoEffectWarning
from stand_ins import RecordingLowLevelZero

# ---- the configs of the reference documents ----------------------------------------------------------

# Document 003 (the ZeRO tutorial's configuration template; the seed text lost its body, so the keys are
# the ShardedModelV2 / ShardedOptimizerV2 arguments the tutorial and its API reference name, with its
# values: placement 'cuda', reuse_fp16_shard False, gpu_margin_mem_ratio 0.8, initial_scale 2**5).
TUTORIAL = dict(
    zero=dict(
        model_config=dict(
            shard_strategy=cm.TensorShardStrategy(),
            reduce_scatter_bucket_size_mb=25,
            fp32_reduce_scatter=False,
            tensor_placement_policy="cuda",
            gradient_predivide_factor=1.0,
            reuse_fp16_shard=False,
        ),
        optimizer_config=dict(
            gpu_margin_mem_ratio=0.8,
            initial_scale=2**5,
            min_scale=1,
            growth_factor=2,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=2,
            max_scale=2**32,
        ),
    )
)

# Document 002's four example ZeRO-3 configurations, key for key. The page prints them as JSON with a
# trailing "..." (the rest of a DeepSpeed config) and, in 3 and 4, a missing comma after the
# offload_optimizer object; here they are Python dicts without the "...".
DEEPSPEED_1 = {
    "zero_optimization": {
        "stage": 3,
    },
    "fp16": {
        "enabled": True
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 0.001,
            "betas": [
                0.8,
                0.999
            ],
            "eps": 1e-8,
            "weight_decay": 3e-7
        }
    },
}
DEEPSPEED_2 = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu"
        }
    },
}
DEEPSPEED_3 = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu"
        },
        "offload_param": {
            "device": "cpu"
        }
    },
}
DEEPSPEED_4 = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
    },
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def train(model: nn.Module, optim, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).float().pow(2).mean()
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def weights(model: cm.ShardedModelV2) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_training(a_model, a_optim, b_model, b_optim) -> None:
    assert train(a_model, a_optim) == train(b_model, b_optim)
    wa, wb = weights(a_model), weights(b_model)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# ---- the ColossalAI form -----------------------------------------------------------------------------

def test_tutorial_config_matches_the_wrappers_built_by_hand():
    model = make_model()
    optim = cm.HybridAdam(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="gpu_margin_mem_ratio"):  # 0.8 with 'cuda': ShardedOptimizerV2 warns
        m, o = cm.initialize(model, optim, TUTORIAL)
    assert isinstance(m, cm.ShardedModelV2) and isinstance(o, cm.ShardedOptimizerV2)
    assert m.tensor_placement_policy == "cuda" and m.dtype == torch.float16 and not m.reuse_fp16_shard
    assert o.loss_scale == 2**5

    ref = make_model()
    ref_model = cm.ShardedModelV2(ref, cm.TensorShardStrategy(), tensor_placement_policy="cuda")
    with pytest.warns(UserWarning, match="gpu_margin_mem_ratio"):
        ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=1e-3),
                                          gpu_margin_mem_ratio=0.8, initial_scale=2**5)
    assert_same_training(m, o, ref_model, ref_optim)


def test_colossal_form_from_a_json_file_with_strategy_and_dtype_names(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero": {"model_config": {"shard_strategy": "BucketTensorShardStrategy",
                                                          "tensor_placement_policy": "cpu", "dtype": "float32"},
                                         "optimizer_config": {"initial_scale": 64}}}))
    model = make_model()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=1e-2), str(path))
    assert isinstance(m.shard_strategy, cm.BucketTensorShardStrategy)
    assert m.tensor_placement_policy == "cpu" and m.dtype == torch.float32
    ref_model = cm.ShardedModelV2(make_model(), cm.BucketTensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32)
    ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=1e-2), initial_scale=64)
    assert_same_training(m, o, ref_model, ref_optim)


def test_colossal_form_errors_name_the_key_and_leave_the_model_unwrapped():
    model = make_model()
    with pytest.raises(cm.InvalidArgumentError, match=r"zero\.model_config\.placement"):
        cm.initialize(model, None, {"zero": {"model_config": {"placement": "cpu"}}})
    with pytest.raises(cm.InvalidArgumentError, match=r"zero\.model_config\.tensor_placement_policy='gpu'"):
        cm.initialize(model, None, {"zero": {"model_config": {"tensor_placement_policy": "gpu"}}})
    with pytest.raises(cm.InvalidArgumentError, match=r"zero\.model_config\.shard_strategy='Sharded'"):
        cm.initialize(model, None, {"zero": {"model_config": {"shard_strategy": "Sharded"}}})
    with pytest.raises(cm.InvalidArgumentError, match=r"config\.fp16"):
        cm.initialize(model, None, {"zero": {}, "fp16": {"enabled": True}})
    with pytest.raises(cm.InvalidArgumentError, match=r"^optimizer=None"):
        cm.initialize(model, None, {"zero": {"optimizer_config": {"initial_scale": 8}}})
    m, o = cm.initialize(model, None, {"zero": {"model_config": {"dtype": "fp32"}}})  # nothing was wrapped
    assert isinstance(m, cm.ShardedModelV2) and o is None


def test_tutorial_config_with_a_model_built_in_zero_init_context():
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), shard_param=True, dtype=torch.float16):
        model = make_model()
    with pytest.warns(UserWarning, match="gpu_margin_mem_ratio"):
        m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=1e-3), TUTORIAL)
    assert m.dtype == torch.float16 and o.loss_scale == 2**5
    losses = train(m, o, steps=2)
    assert all(math.isfinite(x) for x in losses)


def test_deepspeed_dtype_that_contradicts_the_init_context_names_the_precision_keys():
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), dtype=torch.bfloat16):
        model = make_model()
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, config={"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})
    assert info.value.argument == "fp16.enabled/bf16.enabled" and "bfloat16" in str(info.value)


# ---- the DeepSpeed form ------------------------------------------------------------------------------

def test_deepspeed_example_1_stage3_fp16_adamw():
    m, o = cm.initialize(make_model(), config=DEEPSPEED_1)
    assert m.tensor_placement_policy == "cuda" and m.dtype == torch.float16
    group = o.param_groups[0]
    assert isinstance(o.optim, cm.HybridAdam)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["adamw_mode"]) == (
        0.001, (0.8, 0.999), 1e-8, 3e-7, True)
    ref_model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float16)
    ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=0.001, betas=(0.8, 0.999),
                                                               eps=1e-8, weight_decay=3e-7),
                                      initial_scale=2**16)  # DeepSpeed's default initial_scale_power
    assert o.loss_scale == 2**16
    assert_same_training(m, o, ref_model, ref_optim)


def _family_bytes(model: cm.ShardedModelV2) -> dict[str, dict[str, int]]:
    return model.tier_bytes()


def test_deepspeed_example_2_offloads_the_optimizer_state_only():
    model = make_model()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=1e-2), DEEPSPEED_2)
    assert m.dtype == torch.float32  # neither fp16 nor bf16 enabled
    chunk_bytes = m.chunk_numel * 4
    n = len(m.chunks)
    # the host also keeps the copy of the parameters its Adam writes (DeepSpeed's fp32 partition on the CPU):
    # giving it back between steps cost a re-pinning and a copy back from the GPU every step
    assert m.tier_bytes() == {"device": {"param": n * chunk_bytes},
                              "host": {"param": n * chunk_bytes, "exp_avg": n * chunk_bytes,
                                       "exp_avg_sq": n * chunk_bytes}}
    ref_model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), tensor_placement_policy="static",
                                  dtype=torch.float32, offload_param_frac=0.0, offload_optim_frac=1.0)
    ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=1e-2))
    assert_same_training(m, o, ref_model, ref_optim)


def test_deepspeed_example_3_offloads_parameters_and_optimizer_state():
    model = make_model()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=1e-2), DEEPSPEED_3)
    assert m.tensor_placement_policy == "cpu"
    assert m.tier_bytes()["device"] == {}
    ref_model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32)
    ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=1e-2))
    assert_same_training(m, o, ref_model, ref_optim)


def test_deepspeed_example_4_nvme_uses_the_disk_tier(tmp_path):
    """Passes once ShardedModelV2 has the disk tier (offload_optimizer= / offload_param= / nvme_path=)."""
    config = json.loads(json.dumps(DEEPSPEED_4))
    for section in ("offload_optimizer", "offload_param"):  # /nvme_data does not exist here
        config["zero_optimization"][section]["nvme_path"] = str(tmp_path)
    model = make_model()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=1e-2), config)
    ref_model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32)
    ref_optim = cm.ShardedOptimizerV2(ref_model, cm.HybridAdam(ref_model.parameters(), lr=1e-2))
    assert_same_training(m, o, ref_model, ref_optim)  # the disk tier moves bytes, never changes values


def test_ratio_maps_to_a_static_optimizer_fraction():
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), config)
    assert m.tensor_placement_policy == "static"
    assert (m.settings.placement.offload_param_frac, m.settings.placement.offload_optim_frac) == (0.0, 0.5)
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}  # parameters only
    model = make_model()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters()), config)
    placement = m.settings.placement
    assert (m.tensor_placement_policy, placement.offload_param_frac, placement.offload_optim_frac) == ("static", 1.0, 0.0)
    n, chunk_bytes = len(m.chunks), m.chunk_numel * 4
    assert m.tier_bytes() == {"device": {"exp_avg": n * chunk_bytes, "exp_avg_sq": n * chunk_bytes},
                              "host": {"param": n * chunk_bytes}}
    assert all(math.isfinite(x) for x in train(m, o, steps=2))


def test_deepspeed_fp16_section_sets_the_loss_scaler_and_bf16_the_dtype():
    config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "fp16": {"enabled": True, "initial_scale_power": 7, "loss_scale_window": 50, "hysteresis": 3,
                       "min_loss_scale": 2}}
    _, o = cm.initialize(make_model(), config=config)
    s = o.grad_scaler
    assert (o.loss_scale, s.growth_interval, s.hysteresis, s.min_scale) == (128.0, 50, 3, 2)
    m, o = cm.initialize(make_model(), config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                               "optimizer": {"type": "AdamW"}})
    assert m.dtype == torch.bfloat16 and o.grad_scaler is None


@pytest.mark.parametrize("config, path, allowed", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device", "'cpu', 'none', 'nvme'"),
    ({"zero_optimization": {"stage": 3, "offlod_param": {}}}, "zero_optimization.offlod_param", "'offload_param'"),
    ({"zero_optimization": {"stage": 3}, "train_batch": 8}, "train_batch", "'train_batch_size'"),
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage", "1, 2 or 3"),
    ({}, "zero_optimization.stage", "1, 2 or 3"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "bf16.enabled", "false when fp16.enabled is true"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": False}},
     "zero_optimization.mics_shard_size", "divisor >= 2 of the 1 data-parallel ranks"),
    ({"zero_optimization": {"stage": 3, "cpu_offload": True}}, "zero_optimization.cpu_offload", "offload_optimizer"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", "a directory path"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio", "device is 'cpu'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "needs stage 3"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale", "0"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale_window": 0}},
     "fp16.loss_scale_window", ""),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lion"}}, "optimizer.type", "'AdamW'"),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": -1.0}}},
     "optimizer.params.lr", ">= 0"),
    ({"zero_optimization": {"stage": 3}, "schedule": {"type": "WarmupLR"}}, "schedule", "'scheduler'"),
])
def test_bad_keys_name_the_key_path_and_the_allowed_values(config, path, allowed):
    model = make_model()
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, config=config)
    assert info.value.argument == path
    assert allowed in str(info.value)
    m, _ = cm.initialize(model, config={"zero_optimization": {"stage": 3}})  # the model was left as it was
    assert isinstance(m, cm.ShardedModelV2)


def test_optimizer_given_twice_is_a_contradiction():
    model = make_model()
    with pytest.raises(cm.InvalidArgumentError, match="^optimizer="):
        cm.initialize(model, torch.optim.Adam(model.parameters()), DEEPSPEED_1)


def test_keys_without_effect_warn_by_name():
    config = {"train_batch_size": 8, "gradient_clipping": 1.0, "scheduler": {"type": "WarmupLR"},
              "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 10**9, "contiguous_gradients": True,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                          "pipeline_read": False, "pipeline_write": True},
                                    "offload_param": {"device": "cpu", "max_in_cpu": 10**9}}}
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), config)
    named = sorted(str(w.message).split()[2] for w in caught if issubclass(w.category, NoEffectWarning))
    assert named == ["scheduler", "train_batch_size", "zero_optimization.offload_optimizer.pin_memory",
                     "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_param.max_in_cpu",
                     "zero_optimization.stage3_max_reuse_distance"]
    assert m.tensor_placement_policy == "cpu"


def test_prefetch_bucket_live_parameters_and_persistence_map_onto_the_model(tmp_path):
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 3 * 10**4, "stage3_param_persistence_threshold": 1e5,
            "model_persistence_threshold": 10**6}
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoEffectWarning)
        m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
    assert m.settings.prefetch_numel == 3 * 10**4  # the smaller bound
    assert m.runtime.executor.prefetch_chunks == 3 * 10**4 // m.layout.chunk_numel
    assert (m.settings.persistence_threshold, m.settings.model_persistence_threshold) == (10**5, 10**6)
    with pytest.warns(NoEffectWarning, match="persistence_threshold.*disk tier"):
        disk = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                "stage3_param_persistence_threshold": 100}
        model = make_model()
        m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": disk})
    assert m.settings.persistence_threshold == 0
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.stage3_prefetch_bucket_size=-1"):
        cm.initialize(make_model(), config={"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}})
    plain = make_model()
    with pytest.warns(NoEffectWarning, match="stage3_prefetch_bucket_size.*stage 3 only"):
        cm.initialize(plain, cm.HybridAdam(plain.parameters()),
                      {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 100}})


def test_bad_json_file_names_the_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{\"zero_optimization\": {\"stage\": 3,}")
    with pytest.raises(cm.InvalidArgumentError, match="a valid JSON file"):
        cm.initialize(make_model(), config=path)
    with pytest.raises(cm.InvalidArgumentError, match="a readable JSON file"):
        cm.initialize(make_model(), config=tmp_path / "missing.json")
    with pytest.raises(cm.ArgumentTypeError, match="config"):
        cm.initialize(make_model(), config=[1])


# ---- stages 1 and 2 (LowLevelZeroOptimizer) -----------------------------------------------------------

def test_stage_1_and_2_argument_mapping(monkeypatch):
    monkeypatch.setattr(config_module, "LowLevelZeroOptimizer", RecordingLowLevelZero)
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "overlap_comm": True,
                                    "offload_optimizer": {"device": "cpu"}},
              "fp16": {"enabled": True, "initial_scale_power": 10}, "gradient_clipping": 1.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    model = make_model()
    m, o = cm.initialize(model, config=config)
    assert m is model and next(model.parameters()).dtype == torch.float16
    assert isinstance(o.optimizer, cm.HybridAdam) and o.optimizer.param_groups[0]["lr"] == 0.01
    assert o.kwargs == dict(initial_scale=1024.0, clip_grad_norm=1.5, partition_grad=True, cpu_offload=True,
                            reduce_bucket_size=4096, overlap_communication=True)
    model = make_model()
    _, o = cm.initialize(model, torch.optim.Adam(model.parameters()), {"zero_optimization": {"stage": 1}})
    assert o.kwargs == dict(clip_grad_norm=1.0, partition_grad=False, cpu_offload=False)  # DeepSpeed's default
    model = make_model()
    _, o = cm.initialize(model, torch.optim.Adam(model.parameters()), {"zero_optimization": {"stage": 1},
                                                                       "gradient_clipping": 0.0})
    assert o.kwargs == dict(clip_grad_norm=0.0, partition_grad=False, cpu_offload=False)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_and_2_train_like_the_optimizer_built_by_hand(stage):
    """Passes once chunkmem.LowLevelZeroOptimizer exists (built in parallel with this config)."""
    config = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "gradient_clipping": 1.0}
    m, o = cm.initialize(make_model(), config=config)
    ref = make_model()
    ref_optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(ref.parameters(), lr=0.01), clip_grad_norm=1.0,
                                         partition_grad=stage == 2)
    assert type(o) is cm.LowLevelZeroOptimizer and o.__class__ is type(ref_optim)
    assert train(m, o) == train(ref, ref_optim)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_elastic_checkpoint_is_the_engines_and_checked_here():
    model = make_model()
    with pytest.warns(NoEffectWarning, match="elastic_checkpoint.*pass elastic= to chunkmem.load_checkpoint"):
        cm.initialize(model, cm.HybridAdam(model.parameters()),
                      {"zero_optimization": {"stage": 3, "elastic_checkpoint": True}})
    with pytest.raises(cm.ArgumentTypeError, match=r"^zero_optimization\.elastic_checkpoint='no'"):
        cm.initialize(make_model(), config={"zero_optimization": {"stage": 3, "elastic_checkpoint": "no"}})
    from chunkmem.configs.loop_settings import LoopSettings
    assert LoopSettings.from_config({"train_batch_size": 2}, 1).elastic_checkpoint is True
    rigid = {"train_batch_size": 2, "zero_optimization": {"elastic_checkpoint": False}}
    assert LoopSettings.from_config(rigid, 1).elastic_checkpoint is False
    with pytest.raises(cm.ArgumentTypeError, match="elastic_checkpoint"):
        LoopSettings.from_config({"train_batch_size": 2, "zero_optimization": {"elastic_checkpoint": 1}}, 1)


def test_overlap_comm_at_stage_3_leaves_reductions_in_flight():
    for overlap, expected in ((True, 2), (False, 0), (None, 0)):
        zero = {"stage": 3, "offload_param": {"device": "cpu"}}
        if overlap is not None:
            zero["overlap_comm"] = overlap
        model = make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoEffectWarning)
            m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
        assert m.reductions_in_flight == expected


def test_mics_shard_size_maps_onto_shard_groups():
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "mics_shard_size": -1}
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
    assert m.shard_group_size == 1 and m.replicas is None  # one process: its one group
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.mics_shard_size=2.*divisor"):
        cm.initialize(make_model(), config={"zero_optimization": dict(zero, mics_shard_size=2)})
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.mics_shard_size=2.*stage 1 or 2"):
        plain = make_model()
        cm.initialize(plain, torch.optim.AdamW(plain.parameters()), {"zero_optimization": {"stage": 2, "mics_shard_size": 2}})


def test_zero_quantized_gradients_maps_at_stage_3_only():
    model = make_model()
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "zero_quantized_gradients": True}
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
    assert m.quantized_gradients is True
    with pytest.raises(cm.ArgumentTypeError, match=r"^zero_optimization\.zero_quantized_gradients='yes'"):
        cm.initialize(make_model(), config={"zero_optimization": dict(zero, zero_quantized_gradients="yes")})
    plain = make_model()
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.zero_quantized_gradients=True.*stage 1"):
        cm.initialize(plain, torch.optim.AdamW(plain.parameters()),
                      {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}})


def test_zero_quantized_weights_keys_map_at_stage_3():
    for keys, expected in (({"zero_quantized_weights": True}, True),
                           ({"zero_quantized_nontrainable_weights": True}, "nontrainable"),
                           ({"zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True}, True),
                           ({}, False)):
        model = make_model()
        zero = {"stage": 3, "offload_param": {"device": "cpu"}, **keys}
        m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
        assert m.quantized_weights == expected
    with pytest.raises(cm.ArgumentTypeError, match=r"^zero_optimization\.zero_quantized_weights=1"):
        cm.initialize(make_model(), config={"zero_optimization": {"stage": 3, "zero_quantized_weights": 1}})
    plain = make_model()
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.zero_quantized_weights=True.*stage 1"):
        cm.initialize(plain, torch.optim.AdamW(plain.parameters()),
                      {"zero_optimization": {"stage": 1, "zero_quantized_weights": True}})


def test_zero_hpz_partition_size_maps_onto_the_secondary_partition():
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "zero_hpz_partition_size": 1}
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": zero})
    assert m.secondary_partition_size == 1
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.zero_hpz_partition_size=2.*below it"):
        cm.initialize(make_model(), config={"zero_optimization": dict(zero, zero_hpz_partition_size=2)})
    plain = make_model()
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.zero_hpz_partition_size=2.*stage 1"):
        cm.initialize(plain, torch.optim.AdamW(plain.parameters()),
                      {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})


def test_mics_hierarchical_params_gather_takes_the_node_size_from_local_world_size(monkeypatch):
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "mics_hierarchical_params_gather": True}
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.mics_hierarchical_params_gather.*"
                                                      r"LOCAL_WORLD_SIZE"):
        cm.initialize(make_model(), config={"zero_optimization": zero})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(cm.InvalidArgumentError, match=r"^zero_optimization\.mics_hierarchical_params_gather=8.*"
                                                      r"below it"):  # one process: no node to span
        cm.initialize(make_model(), config={"zero_optimization": zero})
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()),
                         {"zero_optimization": dict(zero, mics_hierarchical_params_gather=False)})
    assert m.settings.sharding.gather_node_size is None


# ---- data_types.grad_accum_dtype ---------------------------------------------------------------------

def _gradient_sum_dtype(stage: int, data_types: dict | None) -> torch.dtype:
    """What a bf16 model's gradients of two backwards are summed in, wrapped as the config says: read off the
    chunks' gradient memory (stage 3: bytes on the ledger per element; stages 1, 2: the stores' dtype)."""
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}
    if data_types is not None:
        config["data_types"] = data_types
    m, o = cm.initialize(make_model(), config=config)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        o.backward(m(x).float().pow(2).mean())
    if stage == 3:
        grad_bytes = sum(n for tier in ("device", "host") for family, n in m.tier_bytes()[tier].items()
                         if family == "grad")
        per_element = grad_bytes // sum(c.shard_numel for c in m.chunks if c.trainable)
        return {4: torch.float32, 2: torch.bfloat16}[per_element]
    (dtype,) = {c.grad.dtype for c in o.chunks}
    return dtype


@pytest.mark.parametrize("stage", [2, 3])
def test_data_types_grad_accum_dtype_sets_what_gradients_of_several_backwards_are_summed_in(stage):
    """DeepSpeed's key: absent, null or 'fp32', 16-bit gradients of several backwards are summed in fp32
    (chunkmem's default); the model's dtype ('bf16', or DeepSpeed's other spellings of it) keeps the sum in it."""
    assert _gradient_sum_dtype(stage, None) == torch.float32
    assert _gradient_sum_dtype(stage, {"grad_accum_dtype": None}) == torch.float32
    assert _gradient_sum_dtype(stage, {"grad_accum_dtype": "fp32"}) == torch.float32
    assert _gradient_sum_dtype(stage, {"grad_accum_dtype": "bf16"}) == torch.bfloat16
    assert _gradient_sum_dtype(stage, {"grad_accum_dtype": "bfloat16"}) == torch.bfloat16
    model = make_model()
    m, _ = cm.initialize(model, cm.HybridAdam(model.parameters()), {"zero_optimization": {"stage": 3},
                                                                   "fp16": {"enabled": True},
                                                                   "data_types": {"grad_accum_dtype": "half"}})
    assert m.settings.grad_accum_dtype == torch.float16


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision, value, error, allowed", [
    ({}, "fp16", cm.InvalidArgumentError, "'fp32' (the model trains in fp32"),
    ({"bf16": {"enabled": True}}, "fp16", cm.InvalidArgumentError, "'fp32' or the model's dtype 'bf16'"),
    ({"fp16": {"enabled": True}}, "bf16", cm.InvalidArgumentError, "'fp32' or the model's dtype 'fp16'"),
    ({"bf16": {"enabled": True}}, "int8", cm.InvalidArgumentError, "'fp32', 'fp16' or 'bf16'"),
    ({"bf16": {"enabled": True}}, "BF16", cm.InvalidArgumentError, "'fp32', 'fp16' or 'bf16'"),
    ({"bf16": {"enabled": True}}, 16, cm.ArgumentTypeError, "'fp32', 'fp16' or 'bf16'"),
])
def test_a_bad_grad_accum_dtype_names_the_key_and_leaves_the_model(stage, precision, value, error, allowed):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(error) as info:
        cm.initialize(model, optimizer, {"zero_optimization": {"stage": stage}, **precision,
                                         "data_types": {"grad_accum_dtype": value}})
    assert info.value.argument == "data_types.grad_accum_dtype" and info.value.value == value
    assert allowed in str(info.value)
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, optimizer, {"zero_optimization": {"stage": stage}, "data_types": {"param_dtype": "bf16"}})
    assert info.value.argument == "data_types.param_dtype"
