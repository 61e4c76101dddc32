"""ZeroInitContext: parameters go straight into chunks, in dtype, and stay usable."""
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.core.param_guard import slot_of
from models import TinyGPT


def test_parameters_go_into_chunks_in_dtype():
    numel = torch.zeros(1, dtype=torch.long)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=torch.float16, chunk_size=8192, model_numel_tensor=numel):
        model = TinyGPT()
    params = list(model.parameters())
    assert all(p.dtype == torch.float16 for p in params)
    slots = [slot_of(p) for p in params]
    assert all(s is not None for s in slots)
    # counted as created: the lm head's own weight was created (64 x 32) before the tie replaced it
    assert numel.item() == sum(p.numel() for p in params) + 64 * 32
    for slot in slots:  # each parameter is a view into its chunk's host buffer
        flat = slot.chunk.param.shard.tensor
        assert slot.param.data_ptr() == flat.data_ptr() + slot.offset * flat.element_size()
    # the context leaves nn.Module as it found it
    plain = nn.Linear(2, 2)
    assert plain.weight.dtype == torch.float32 and slot_of(plain.weight) is None


def test_each_module_converted_when_its_init_returns():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            seen["inner_dtype_inside_outer_init"] = self.inner.weight.dtype
            self.own = nn.Parameter(torch.ones(3))
            seen["own_dtype_inside_init"] = self.own.dtype

    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.bfloat16):
        probe = Probe()
    assert seen == {"inner_dtype_inside_outer_init": torch.bfloat16, "own_dtype_inside_init": torch.float32}
    assert probe.own.dtype == torch.bfloat16


def test_nn_init_after_creation_writes_into_chunks():
    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float16):
        lin = nn.Linear(8, 8)
    nn.init.constant_(lin.weight, 0.25)
    slot = slot_of(lin.weight)
    assert torch.all(slot.view(slot.chunk.param.shard.tensor) == 0.25)
    model = cm.ShardedModelV2(lin, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    assert torch.all(model.state_dict()["weight"] == 0.25)


def test_classes_defined_inside_the_context_are_converted():
    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float16):
        class Late(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(5))
        late = Late()
    assert late.w.dtype == torch.float16 and slot_of(late.w) is not None


def test_chunk_of_a_replaced_parameter_is_freed_by_the_wrap():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.head = nn.Linear(32, 64, bias=False)  # its own weight fills a chunk of its own ...
            self.head.weight = self.emb.weight          # ... and is then replaced by the tie

        def forward(self, idx):
            return self.head(self.emb(idx))

    with cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=torch.float16,
                            chunk_size=64 * 32 * 2):
        model = Tied()
    replaced = [c for c in slot_of(model.emb.weight).chunk.built_with if c is not slot_of(model.emb.weight).chunk]
    assert len(replaced) == 1 and replaced[0].param.shard.allocated
    wrapped = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    assert wrapped.tier_bytes()["host"] == {"param": sum(c.param.nbytes for c in wrapped.chunks)}
    assert not replaced[0].param.shard.allocated
