"""TiledLinear (DeepSpeed's memory-centric tiling): equal to nn.Linear, fetched tile by tile so that a
device tier smaller than the whole weight trains it, DeepSpeed's tile boundaries, bad input refused."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.faces.tiled_linear import split_points


@pytest.mark.parametrize("in_splits, out_splits, bias", [(1, 1, True), (3, 4, True), (5, 2, False), (2, 1, True)])
def test_output_and_gradients_equal_nn_linear(in_splits, out_splits, bias):
    torch.manual_seed(0)
    linear = nn.Linear(37, 23, bias=bias)
    tiled = cm.TiledLinear(37, 23, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear)
    x = torch.randn(4, 5, 37, requires_grad=True)
    y = torch.randn(4, 5, 23)
    want = linear(x)
    got = tiled(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad_x_want, = torch.autograd.grad((want * y).sum(), x)
    grad_x_got, = torch.autograd.grad((got * y).sum(), x)
    torch.testing.assert_close(grad_x_got, grad_x_want, rtol=1e-6, atol=1e-6)
    if not bias:
        assert all(t.bias is None for row in tiled.linears for t in row)
    else:
        assert [[t.bias is not None for t in row] for row in tiled.linears] == \
               [[i == in_splits - 1 for i in range(in_splits)]] * out_splits


def test_split_input_and_uncombined_output():
    torch.manual_seed(0)
    linear = nn.Linear(10, 6)
    tiled = cm.TiledLinear(10, 6, in_splits=2, out_splits=3, input_is_already_split=True, combine_out_splits=False,
                           init_linear=linear)
    x = torch.randn(3, 10)
    blocks = tiled([x[:, :5], x[:, 5:]])
    assert [b.shape[-1] for b in blocks] == [2, 2, 2]
    torch.testing.assert_close(torch.cat(blocks, -1), linear(x), rtol=1e-6, atol=1e-6)


def test_tile_boundaries_are_deepspeeds_uniform_partition():
    # deepspeed.runtime.utils.partition_uniform: the first n % parts blocks are one larger
    assert split_points(37, 3) == [0, 13, 25, 37]
    assert split_points(10, 4) == [0, 3, 6, 8, 10]
    assert split_points(8, 8) == list(range(9))


class Net(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 256)
        self.head = head

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def test_a_device_tier_smaller_than_the_weight_trains_it_tile_by_tile():
    torch.manual_seed(0)
    linear = nn.Linear(256, 256)  # 256 KiB of fp32 weight
    weight_bytes = 256 * 256 * 4
    tiled = cm.TiledLinear(256, 256, in_splits=2, out_splits=4, init_linear=linear)  # 8 tiles of 32 KiB
    plain = Net(copy.deepcopy(tiled))
    data = [(torch.randn(8, 16), torch.randn(8, 256)) for _ in range(3)]
    cm.set_device_memory_capacity(weight_bytes // 2)

    whole = Net(copy.deepcopy(linear))
    with pytest.raises(cm.DeviceCapacityError):  # the untiled layer needs its whole weight on the device
        cm.ShardedModelV2(whole, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                          chunk_size=weight_bytes)

    model = cm.ShardedModelV2(copy.deepcopy(plain), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=weight_bytes // 8)
    optim = cm.ShardedOptimizerV2(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    for x, y in data:
        optim.backward(nn.functional.mse_loss(model(x), y))
        optim.step()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_optim.step()
        plain_optim.zero_grad()
    peak = model.memory_stats()["totals"]["peak_device_bytes"]
    assert 0 < peak <= weight_bytes // 2  # chunk memory on the device tier never held the whole weight
    state = model.state_dict()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_copy_params_from_writes_chunk_managed_tiles():
    torch.manual_seed(0)
    linear = nn.Linear(12, 8)
    model = cm.ShardedModelV2(Net(cm.TiledLinear(256, 8, in_splits=2)), cm.TensorShardStrategy(),
                              tensor_placement_policy="cpu", dtype=torch.float32)
    wide = nn.Linear(256, 8)
    model.module.head.copy_params_from(wide)
    x = torch.randn(3, 256)
    with cm.GatheredParameters(list(model.parameters())):
        torch.testing.assert_close(model.module.head(x), wide(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(cm.InvalidArgumentError) as caught:
        model.module.head.copy_params_from(linear)
    assert caught.value.argument == "other"


@pytest.mark.parametrize("kwargs, argument", [
    (dict(in_splits=0), "in_splits"), (dict(in_splits=38), "in_splits"), (dict(out_splits=24), "out_splits"),
    (dict(bias="yes"), "bias"), (dict(linear_cls=3), "linear_cls"),
])
def test_bad_arguments_are_named(kwargs, argument):
    with pytest.raises(cm.InvalidArgumentError) as caught:
        cm.TiledLinear(37, 23, **kwargs)
    assert caught.value.argument == argument
