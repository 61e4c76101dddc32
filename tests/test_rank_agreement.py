"""Ranks that disagree fail clearly and quickly; a rank left alone in a collective times out.

Two gloo processes build different models (or the same model with another dtype or chunk size): both
must raise the same :class:`~chunkmem.LayoutMismatchError`, naming what differs, within seconds and
before the module is changed. A rank whose partner caught an exception in its forward and carried on
must raise :class:`~chunkmem.CollectiveTimeoutError` within the configured bound. References: the
messages are compared with hand-written text; times with the configured timeout.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.distributed.agreement import LayoutDescription, ParamRecord, mismatch_message
from chunkmem.distributed.collectives import COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT, ShardGroup
from chunkmem.core.param_guard import slot_of
from distributed import run_ranks

AGREEMENT_TIMEOUT = 60.0  # seconds: a disagreement must be reported far sooner
SKIP_TIMEOUT = 3.0  # seconds: the bound in the skipped-forward case


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


class WritingNet(nn.Module):
    """Writes into a parameter of a child after the child is built: inside a sharded ZeroInitContext
    that write gathers the child's chunk (``write``: which parameter, or None for no write)."""

    def __init__(self, width: int = 4, write: str | None = "weight") -> None:
        super().__init__()
        self.fc = nn.Linear(8, width)
        if write is not None:
            with torch.no_grad():
                getattr(self.fc, write)[0] = 0.5


def _outcome(fn) -> dict:
    """What ``fn()`` raised (type name and message) and how long it took, in seconds."""
    began = time.monotonic()
    try:
        fn()
    except cm.ChunkmemError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began}
    return {"error": None, "message": "", "seconds": time.monotonic() - began}


def _wrap(model: nn.Module, **kwargs) -> cm.ShardedModelV2:
    return cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu", **kwargs)


def _disagreeing_worker(rank: int, world: int) -> dict:
    cm.set_collective_timeout(AGREEMENT_TIMEOUT)
    _wrap(Net(), dtype=torch.float32, chunk_size=4096)  # one-time costs (native helpers, lazy imports) first,
    out = {}                                            # so that the ranks start the timed cases together
    torch.manual_seed(0)
    model = Net(width=4 + 4 * rank)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    out["model"] = _outcome(lambda: _wrap(model, dtype=torch.float32, chunk_size=4096))
    out["model_untouched"] = all(slot_of(p) is None and p.dtype == torch.float32 and torch.equal(p, before[name])
                                 for name, p in model.named_parameters())
    out["dtype"] = _outcome(lambda: _wrap(Net(), dtype=(torch.float16, torch.bfloat16)[rank], chunk_size=4096))
    out["chunk_size"] = _outcome(lambda: _wrap(Net(), dtype=torch.float32, chunk_size=(4096, 8192)[rank] * 4))
    out["policy"] = _outcome(lambda: cm.ShardedModelV2(Net(), cm.TensorShardStrategy(), dtype=torch.float32,
                                                       tensor_placement_policy=("cpu", "cuda")[rank]))

    def build_in_context(**net_kwargs) -> None:
        with cm.ZeroInitContext("cpu", cm.TensorShardStrategy(), shard_param=True, dtype=torch.float32,
                                chunk_size=4096):
            WritingNet(**net_kwargs)

    out["init_models"] = _outcome(lambda: build_in_context(width=4 + 4 * rank))
    out["init_writes"] = _outcome(lambda: build_in_context(write=("weight", "bias")[rank]))
    out["init_exit"] = _outcome(lambda: build_in_context(write=("weight", None)[rank]))
    # the same model on both ranks: no error, and the group is still in step after the errors above
    out["same"] = _outcome(lambda: _wrap(Net(), dtype=torch.float32, chunk_size=4096))
    out["same_in_context"] = _outcome(lambda: build_in_context())
    shards = ShardGroup.of(None)
    out["bytes"] = shards.all_gather_bytes(b"r" * (3 * rank + 1), "test bytes")
    cm.set_collective_timeout(None)
    return out


@pytest.fixture(scope="module")
def disagreeing() -> list[dict]:
    return run_ranks(_disagreeing_worker, 2)


def _same_error_on_both(results: list[dict], case: str) -> str:
    first, second = results[0][case], results[1][case]
    assert first["error"] == second["error"] == "LayoutMismatchError", (first, second)
    assert first["message"] == second["message"]
    assert first["seconds"] < AGREEMENT_TIMEOUT / 4 and second["seconds"] < AGREEMENT_TIMEOUT / 4
    return first["message"]


def test_different_models_fail_clearly_on_every_rank_before_the_module_changes(disagreeing):
    message = _same_error_on_both(disagreeing, "model")
    assert message.startswith("the 2 ranks disagree on the model they shard (ShardedModelV2)")
    assert "parameter 'fc.weight' shape: (4, 8) on rank 0, (8, 8) on rank 1" in message
    assert "parameter 'fc.bias' shape: (4,) on rank 0, (8,) on rank 1" in message
    assert "parameter 'out.weight' shape: (2, 4) on rank 0, (2, 8) on rank 1" in message
    assert "dtype" not in message and "chunk size" not in message
    assert disagreeing[0]["model_untouched"] and disagreeing[1]["model_untouched"]


def test_different_dtypes_fail_clearly(disagreeing):
    message = _same_error_on_both(disagreeing, "dtype")
    assert "dtype: torch.float16 on rank 0, torch.bfloat16 on rank 1" in message
    assert "parameter" not in message


def test_different_chunk_sizes_fail_clearly(disagreeing):
    message = _same_error_on_both(disagreeing, "chunk_size")
    assert message.endswith("chunk size: 4096 elements on rank 0, 8192 elements on rank 1")


def test_different_placement_policies_fail_clearly(disagreeing):
    message = _same_error_on_both(disagreeing, "policy")
    assert message.endswith("tensor_placement_policy: 'cpu' on rank 0, 'cuda' on rank 1")


def test_different_models_inside_zero_init_context_fail_at_the_first_gather(disagreeing):
    message = _same_error_on_both(disagreeing, "init_models")
    assert "(ZeroInitContext: gather of chunk0 for parameter 'Linear.weight')" in message
    assert "parameter 'Linear.weight' shape: (4, 8) on rank 0, (8, 8) on rank 1" in message


def test_different_writes_inside_zero_init_context_fail_before_the_gathers_pair_up(disagreeing):
    message = _same_error_on_both(disagreeing, "init_writes")
    assert ("where they compare: ZeroInitContext: gather of chunk0 for parameter 'Linear.weight' on rank 0, "
            "ZeroInitContext: gather of chunk0 for parameter 'Linear.bias' on rank 1") in message
    message = _same_error_on_both(disagreeing, "init_exit")
    assert ("where they compare: ZeroInitContext: gather of chunk0 for parameter 'Linear.weight' on rank 0, "
            "ZeroInitContext: exit on rank 1") in message


def test_ranks_that_agree_go_on_and_bytes_of_any_length_are_gathered(disagreeing):
    for result in disagreeing:
        assert result["same"]["error"] is None and result["same_in_context"]["error"] is None
        assert result["bytes"] == [b"r", b"rrrr"]


# ---- a rank that carries on after an exception in its forward ----------------------------------


def _skipping_worker(rank: int, world: int, workdir: str) -> dict:
    torch.manual_seed(0)
    # one layer per chunk: the forward gathers chunk0 for fc, then chunk1 for out
    model = _wrap(Net(width=24), dtype=torch.float32, chunk_size=256 * 4)
    assert len(model.chunks) == 2
    model(torch.ones(2, 8))  # both ranks: the first forward also imports what torch loads lazily
    open(os.path.join(workdir, f"warm{rank}"), "w").close()  # both ranks start the timed part together (a
    while not all(os.path.exists(os.path.join(workdir, f"warm{r}")) for r in range(world)):  # loaded machine
        time.sleep(0.01)                                                                    # skews them)
    cm.set_collective_timeout(SKIP_TIMEOUT)
    done = os.path.join(workdir, "rank0_done")
    if rank == 1:
        try:
            model(torch.ones(2, 5))  # wrong width: fc raises after its chunk was gathered
        except RuntimeError:
            pass  # ... and carries on without the rest of the forward
        deadline = time.monotonic() + 10 * SKIP_TIMEOUT
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    began = time.monotonic()
    try:
        model(torch.ones(2, 8))
        result = {"error": None}
    except cm.CollectiveTimeoutError as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "collective": exc.collective,
                  "what": exc.what, "rank": exc.rank, "timeout": exc.timeout, "waited": exc.waited}
    result["seconds"] = time.monotonic() - began
    try:  # the group is unusable now: the next forward says so at once, naming the first failure
        model(torch.ones(2, 8))
        result["next forward"] = None
    except cm.CollectiveError as exc:
        result["next forward"] = str(exc)
    result["dispatch modes left"] = torch.zeros(4).to_sparse().is_sparse  # raised while a trace's mode stayed
    open(done, "w").close()
    cm.set_collective_timeout(None)
    return result


def test_a_rank_left_alone_in_a_collective_times_out_naming_it(tmp_path):
    result = run_ranks(_skipping_worker, 2, str(tmp_path))[0]
    assert result["error"] == "CollectiveTimeoutError", result
    assert SKIP_TIMEOUT <= result["waited"] <= result["seconds"] < SKIP_TIMEOUT + 5
    assert (result["collective"], result["what"], result["rank"], result["timeout"]) == (
        "all_gather", "chunk1 parameters", 0, SKIP_TIMEOUT)
    assert result["message"].startswith("all_gather of chunk1 parameters on rank 0 of 2 did not complete within 3.")
    assert "The bound is 3 s (chunkmem.set_collective_timeout or CHUNKMEM_COLLECTIVE_TIMEOUT)" in result["message"]
    assert result["next forward"].startswith("a forward after a failed collective (all_gather of chunk1 parameters")
    assert "the process group is unusable" in result["next forward"]
    assert result["dispatch modes left"]


# ---- settings and messages, in one process ---------------------------------------------------------


def test_collective_timeout_setting_and_environment(monkeypatch):
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert cm.collective_timeout() == DEFAULT_COLLECTIVE_TIMEOUT == 600.0
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "2.5")
    assert cm.collective_timeout() == 2.5
    cm.set_collective_timeout(7)
    try:
        assert cm.collective_timeout() == 7.0
        for bad in (0, -1, float("nan"), float("inf"), "10", True):
            with pytest.raises(cm.InvalidArgumentError, match=r"^seconds=.* is not allowed: expected a finite "
                                                              r"number of seconds > 0"):
                cm.set_collective_timeout(bad)
            assert cm.collective_timeout() == 7.0  # unchanged
    finally:
        cm.set_collective_timeout(None)
    assert cm.collective_timeout() == 2.5
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "ten")
    with pytest.raises(cm.InvalidArgumentError, match="^CHUNKMEM_COLLECTIVE_TIMEOUT='ten' is not allowed"):
        cm.collective_timeout()


def _description(step: str, dtype: str, params: list[tuple[str, tuple[int, ...], bool]]) -> LayoutDescription:
    record = ParamRecord()
    for entry in params:
        record.add(*entry)
    return LayoutDescription(step, [("dtype", dtype), ("chunk size", "64 elements")], record)


def test_mismatch_message_groups_ranks_by_value():
    a = _description("S", "torch.float16", [("w", (2, 2), True), ("b", (2,), True)])
    b = _description("S", "torch.bfloat16", [("w", (2, 2), True), ("b", (2,), False), ("c", (1,), True)])
    assert LayoutDescription.decode(a.encode()).digest() == a.digest() != b.digest()
    assert mismatch_message([a, a, b, a]) == (
        "the 4 ranks disagree on the model they shard (S); every rank must build the same model with the same "
        "settings. dtype: torch.float16 on ranks 0-1, 3, torch.bfloat16 on rank 2; number of parameters: "
        "2 on ranks 0-1, 3, 3 on rank 2; parameter 'b' requires_grad: True on ranks 0-1, 3, False on rank 2; "
        "parameter #2 in packing order: none on ranks 0-1, 3, 'c' (1,) on rank 2")
