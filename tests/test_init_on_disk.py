"""ZeroInitContext(nvme_path=...): a model built straight onto the disk tier (DeepSpeed's
zero.Init(remote_device="nvme")) holds only the chunks being filled in host memory, reads and writes its
parameters as usual, and trains bitwise like the same model built in host memory."""
import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.core.param_guard import slot_of
from chunkmem.core.tiers import Tier
from models import Block, TinyGPT, batches, lm_loss

CHUNK_BYTES = 4096 * 4  # fp32: 4096 elements, several chunks for TinyGPT(d=32)
PIECE = 8192


def _context(path=None, dtype=torch.float32):
    if path is not None:
        path.mkdir(exist_ok=True)
    return cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), dtype=dtype,
                              chunk_size=CHUNK_BYTES, nvme_path=None if path is None else str(path))


def _wrap_and_train(net, path, steps=3):
    path.mkdir()
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              offload_param="disk", offload_optimizer="disk", nvme_path=str(path),
                              buffer_size=PIECE)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
    losses = []
    for tokens in batches(steps):
        loss = lm_loss(model(tokens), tokens)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_chunks_rest_on_disk_as_they_fill_and_only_the_open_ones_are_in_host_memory(tmp_path):
    host_after_block = []

    class RecordingBlock(Block):
        def __init__(self, d):
            super().__init__(d)
            host_after_block.append(context.memory.ledger.tier_bytes(Tier.HOST, ("param",)))

    torch.manual_seed(0)
    context = _context(tmp_path / "init")
    with context:
        blocks = nn.ModuleList(RecordingBlock(32) for _ in range(6))
    chunks = context.chunks
    assert len(chunks) >= 4
    # while building: at most the open chunk of parameters in host memory (one kind: trainable)
    assert max(host_after_block) <= CHUNK_BYTES
    # closed: every chunk on disk, nothing in host memory, one file region per chunk
    assert all(c.param.shard.on_disk for c in chunks)
    assert context.memory.ledger.tier_bytes(Tier.HOST) == 0  # the I/O buffers too
    assert context.memory.ledger.tier_bytes(Tier.DISK) == len(chunks) * CHUNK_BYTES
    assert context.memory.disk.file_bytes >= len(chunks) * CHUNK_BYTES
    # the values are those of the same modules built in plain PyTorch
    torch.manual_seed(0)
    plain = nn.ModuleList(Block(32) for _ in range(6))
    for (name, p), q in zip(blocks.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_a_model_built_on_disk_trains_bitwise_like_one_built_in_host_memory(tmp_path):
    torch.manual_seed(0)
    context = _context(tmp_path / "init")
    with context:
        on_disk = TinyGPT(d=32, layers=4)
        assert slot_of(on_disk.blocks[0].fc1.weight).chunk.param.shard.on_disk
        nn.init.normal_(on_disk.blocks[0].fc1.weight, std=0.5)  # a write after creation, into a chunk on disk
        nn.init.normal_(on_disk.side.weight, std=0.5)
    torch.manual_seed(0)
    with _context():
        in_memory = TinyGPT(d=32, layers=4)
        nn.init.normal_(in_memory.blocks[0].fc1.weight, std=0.5)
        nn.init.normal_(in_memory.side.weight, std=0.5)
    assert slot_of(on_disk.side.weight).chunk.param.shard.on_disk
    scratch = context.memory.disk.path
    assert os.path.isdir(scratch)
    model_a, losses_a = _wrap_and_train(in_memory, tmp_path / "a")
    model_b, losses_b = _wrap_and_train(on_disk, tmp_path / "b")
    assert not os.path.exists(scratch)  # the context's files went with the wrap
    assert all(c.param.shard.on_disk for c in model_b.chunks) and model_b.chunks[0].memory is not context.memory
    assert losses_a == losses_b
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_a_model_built_on_disk_can_be_trained_from_host_memory(tmp_path):
    torch.manual_seed(0)
    with _context(tmp_path / "init"):
        net = TinyGPT(d=32)
    torch.manual_seed(0)
    reference = TinyGPT(d=32)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    assert model.runtime.memory.disk is None and not any(c.param.shard.on_disk for c in model.chunks)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_bad_arguments_are_refused_before_anything_is_created(tmp_path):
    target = tmp_path / "nothing"
    target.mkdir()
    with pytest.raises(cm.ArgumentTypeError, match="nvme_path"):
        cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), nvme_path=3)
    assert os.listdir(target) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_building_onto_the_disk_tier_needs_the_cpu_as_target(tmp_path):
    with pytest.raises(cm.InvalidArgumentError, match="target_device"):
        cm.ZeroInitContext(target_device="cuda", shard_strategy=cm.TensorShardStrategy(), nvme_path=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_parameter_larger_than_the_chunk_size_gets_a_file_region_of_its_own_size(tmp_path):
    torch.manual_seed(0)
    context = _context(tmp_path / "init")
    with context:
        net = nn.Sequential(nn.Linear(32, 32), nn.Linear(128, 96), nn.Linear(32, 32))
    sizes = [c.numel for c in context.chunks]
    assert max(sizes) > 4096 and all(c.param.shard.on_disk for c in context.chunks)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(128, 96), nn.Linear(32, 32))
    for p, q in zip(net.parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach())
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())


def _two_rank_build(rank, world, workdir):
    """Each rank builds the model onto its own disk tier, keeping its shard of every chunk there; a write
    after creation (``nn.init``) gathers, changes and writes back this rank's part of the file region."""
    path = os.path.join(workdir, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    context = cm.ZeroInitContext(target_device="cpu", shard_strategy=cm.TensorShardStrategy(), shard_param=True,
                                 dtype=torch.float32, chunk_size=CHUNK_BYTES, nvme_path=path)
    with context:
        net = TinyGPT(d=32, layers=4)
        nn.init.normal_(net.side.weight, std=0.5)
        parked_when_written = slot_of(net.blocks[1].fc1.bias).chunk.param.shard.on_disk
        with torch.no_grad():
            net.blocks[1].fc1.bias.add_(1.0)
    on_disk = parked_when_written and all(c.param.shard.on_disk for c in context.chunks)
    shard_bytes = context.memory.ledger.tier_bytes(Tier.DISK)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    return {"on_disk": on_disk, "shard_bytes": shard_bytes, "chunk_bytes": sum(c.numel * 4 for c in context.chunks),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def test_several_ranks_build_onto_their_disk_tiers_with_the_values_of_one_process(tmp_path):
    from distributed import run_ranks
    ranks = run_ranks(_two_rank_build, 2, str(tmp_path))
    torch.manual_seed(0)
    with _context():
        net = TinyGPT(d=32, layers=4)
        nn.init.normal_(net.side.weight, std=0.5)
        with torch.no_grad():
            net.blocks[1].fc1.bias.add_(1.0)
    want = {k: v.clone() for k, v in net.state_dict().items()}
    for out in ranks:
        assert out["on_disk"] and out["shard_bytes"] * 2 == out["chunk_bytes"]  # each rank: half of every chunk
        assert out["state"].keys() == want.keys()
        assert all(torch.equal(out["state"][k], want[k]) for k in want)
