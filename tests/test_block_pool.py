"""The block pool that serves chunk buffers when the CPU holds both tiers: reuse by byte size, memory
lent to and taken back from a device copy's storage in place, the same numbers with and without it."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import chunkmem as cm
from chunkmem.core import block_pool, native_build
from chunkmem.core.block_pool import BlockPool
from chunkmem.core.param_guard import slot_of
from models import TinyGPT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the pool serves CPU-only machines")


def test_given_back_block_is_reused_for_the_same_byte_size():
    pool = BlockPool()
    pool.use_sizes([4000, 2000])
    a = pool.empty(1000, torch.float32)
    ptr = a.data_ptr()
    assert ptr % 4096 == 0 and pool.blocks_mapped == 1
    pool.give_back(a)
    del a
    assert pool.cached_bytes == 4000
    b = pool.empty(2000, torch.float16)  # same 4000 bytes, another dtype
    assert b.data_ptr() == ptr and b.dtype == torch.float16 and b.numel() == 2000
    assert pool.cached_bytes == 0 and pool.blocks_mapped == 1
    c = pool.empty(1000, torch.float16)  # another size: a new mapping
    assert c.data_ptr() != ptr and pool.blocks_mapped == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_blocks_are_private_memory_a_forked_child_writes_its_own_copy():
    pool = BlockPool()
    block = pool.empty(1024, torch.float32).fill_(1.0)
    pid = os.fork()
    if pid == 0:  # the child: write, then leave at once
        block.fill_(2.0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert torch.equal(block, torch.ones(1024))


def test_only_sizes_of_live_chunks_are_kept():
    pool = BlockPool()
    pool.use_sizes([4096])
    pool.use_sizes([4096, 8192])  # two chunks share a size
    a, b, c = pool.empty(1024, torch.float32), pool.empty(2048, torch.float32), pool.empty(512, torch.float32)
    for t in (a, b, c):
        pool.give_back(t)
    del a, b, c
    assert pool.cached_bytes == 4096 + 8192  # the 2048-byte block: no chunk has that size
    pool.stop_using_sizes([4096, 8192])
    assert pool.cached_bytes == 4096  # 8192 had one chunk; 4096 still has one
    pool.stop_using_sizes([4096])
    assert pool.cached_bytes == 0
    d = pool.empty(1024, torch.float32)
    pool.give_back(d)
    assert pool.cached_bytes == 0


def test_block_still_viewed_elsewhere_is_not_reused():
    pool = BlockPool()
    pool.use_sizes([4096])
    a = pool.empty(1024, torch.float32)
    a.fill_(3.0)
    ptr, kept = a.data_ptr(), a[10:20]
    pool.give_back(a)
    del a
    assert pool.cached_bytes == 0
    b = pool.empty(1024, torch.float32)
    b.fill_(-1.0)
    assert b.data_ptr() != ptr and torch.equal(kept, torch.full((10,), 3.0))


def test_lend_and_take_back_keep_the_storage_and_its_views():
    if block_pool.HELPER.get() is None:
        pytest.skip(f"native helper unavailable: {block_pool.load_error()}")
    pool = BlockPool()
    pool.use_sizes([1024])
    device = torch.empty(256, dtype=torch.float32)
    device.untyped_storage().resize_(0)
    storage = device.untyped_storage()
    holder = pool.lend(storage, 1024)
    assert storage.nbytes() == 1024 and holder.untyped_storage().nbytes() == 0
    view = device[8:16]  # a view made while the memory is lent, like one autograd saves in forward
    device.copy_(torch.arange(256.0))
    assert torch.equal(view, torch.arange(8.0, 16.0))
    lent_ptr = device.data_ptr()
    pool.take_back(storage, holder)
    assert storage.nbytes() == 0 and pool.cached_bytes == 1024
    with pytest.raises(RuntimeError, match="storage of size 0"):
        device[8:16]  # a released copy fails loudly, as after a resize to 0 bytes
    again = pool.lend(storage, 1024)
    assert device.data_ptr() == lent_ptr and storage.nbytes() == 1024
    device.fill_(7.0)
    assert torch.equal(view, torch.full((8,), 7.0))
    pool.take_back(storage, again)


def _train(steps, placement, dtype=torch.float32):
    torch.manual_seed(0)
    net = TinyGPT(vocab=64, d=32, layers=2, seq=16)
    model = cm.ShardedModelV2(copy.deepcopy(net), cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              dtype=dtype, chunk_size=4096 * 4)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2.0**8)
    g = torch.Generator().manual_seed(1)
    losses, mapped = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
        optim.backward(loss)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        blocks = model.runtime.memory.blocks
        mapped.append(None if blocks is None else blocks.blocks_mapped)
    return losses, model.state_dict(), mapped


@pytest.mark.parametrize("placement,dtype", [("cpu", torch.float32), ("auto", torch.float32),
                                             ("cpu", torch.float16)])
def test_training_is_bitwise_the_same_without_the_pool_and_maps_nothing_new_after_the_first_step(
        monkeypatch, placement, dtype):
    if block_pool.HELPER.get() is None:
        pytest.skip(f"native helper unavailable: {block_pool.load_error()}")
    pooled_losses, pooled_params, mapped = _train(6, placement, dtype)
    # From the third step on (auto has then traced and planned), every buffer is a reused block.
    assert mapped[0] > 0 and mapped[3:] == [mapped[2]] * 3
    monkeypatch.setenv(block_pool.DISABLE_ENV, "1")
    plain_losses, plain_params, none = _train(6, placement, dtype)
    assert none == [None] * 6
    assert pooled_losses == plain_losses
    assert pooled_params.keys() == plain_params.keys()
    assert all(torch.equal(pooled_params[k], plain_params[k]) for k in pooled_params)


def test_no_compiler_means_no_pool_with_a_warning_and_training_still_works(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(block_pool, "HELPER", block_pool.HELPER.fresh())
    with pytest.warns(RuntimeWarning, match="block pool is unavailable"):
        assert block_pool.pool_for_this_machine() is None
    assert "no-such-compiler" in block_pool.load_error()
    losses, _, mapped = _train(2, "cpu")
    assert mapped == [None, None] and all(loss == loss for loss in losses)


def test_repack_unmaps_the_replaced_chunks_blocks_and_empty_cache_unmaps_the_rest():
    if block_pool.HELPER.get() is None:
        pytest.skip(f"native helper unavailable: {block_pool.load_error()}")
    torch.manual_seed(0)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=False, dtype=torch.float32, chunk_size=4096 * 4):
        net = TinyGPT(vocab=64, d=32, layers=2, seq=16)
    context_sizes = {slot_of(p).chunk.param.nbytes for p in net.parameters()}
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=8192 * 4)  # another size: a re-pack
    blocks = model.runtime.memory.blocks
    assert context_sizes == {4096 * 4} and blocks.cached_bytes == 0
    assert all(blocks.cached_blocks(n) == 0 for n in context_sizes)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optim.backward(F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1)))
        optim.step()
        optim.zero_grad(set_to_none=True)
    # cpu placement: the device copies, the staging and the gradients are freed after every step
    assert model.cached_bytes() == blocks.cached_bytes > 0
    assert model.cached_bytes() % (8192 * 4) == 0
    assert model.memory_stats()["block_pool"] == {"cached_bytes": model.cached_bytes(),
                                                  "blocks_mapped": blocks.blocks_mapped}
    model.empty_cache()
    assert model.cached_bytes() == 0 and model.memory_stats()["block_pool"]["cached_bytes"] == 0


def test_a_buffer_can_take_the_start_of_a_larger_block_which_goes_back_whole():
    pool = BlockPool()
    pool.use_sizes([8192])
    small = pool.empty(1000, torch.float32, block_nbytes=8192)
    ptr = small.data_ptr()
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 8192 and pool.blocks_mapped == 1
    pool.give_back(small)
    del small
    assert pool.cached_blocks(8192) == 1 and pool.cached_bytes == 8192
    full = pool.empty(2048, torch.float32)  # the same block serves a buffer of its own size
    assert full.data_ptr() == ptr and pool.blocks_mapped == 1


def test_a_trimmed_last_chunk_stages_on_the_device_tier_through_the_full_size_blocks():
    """Placement cpu: the last chunk holds only its parameters; its device copy and gradient staging take
    chunk-size blocks (no blocks of its size kept for them), while the ledger counts its own bytes."""
    if block_pool.HELPER.get() is None:
        pytest.skip(f"native helper unavailable: {block_pool.load_error()}")
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(vocab=64, d=32, layers=2, seq=16), cm.TensorShardStrategy(),
                              tensor_placement_policy="cpu", dtype=torch.float32, chunk_size=4096 * 4)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
    numels = [c.numel for c in model.chunks]
    tail_bytes, full_bytes = numels[-1] * 4, 4096 * 4
    assert numels[:-1] == [4096] * (len(numels) - 1) and tail_bytes < full_bytes
    assert model.runtime.memory.device_block_nbytes == full_bytes
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optim.backward(F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1)))
        optim.step()
        optim.zero_grad(set_to_none=True)
    blocks = model.runtime.memory.blocks
    # after the step only the gradients were freed: one block of the last chunk's size (its gradient), and
    # chunk-size blocks for the others' gradients and for the device copies and staging of all of them
    assert blocks.cached_blocks(tail_bytes) == 1
    assert blocks.cached_bytes == tail_bytes + full_bytes * blocks.cached_blocks(full_bytes)
    assert blocks.cached_blocks(full_bytes) >= len(numels) - 1 + 1
    # the ledger counts what the chunks asked for: a period with the last chunk's copy and staging is
    # below two full chunks
    periods = model.memory_stats()["periods"]
    last = len(numels) - 1
    with_tail = [p["device_model_bytes"] for p in periods if p["chunks"] == [last]]
    assert with_tail and max(with_tail) <= 2 * tail_bytes
