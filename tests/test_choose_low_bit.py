"""chunkmem.choose and chunkmem.plan with 8-bit optimizer state (issue 40: "the planner's bytes equal a real run's for
the new families"): every 8-bit candidate, on the device, the host and the disk tier, against a real run of the
optimizer it is planned for (HybridAdam(state_dtype="8bit"); torchao's AdamW8bit(bf16_stochastic_round=True) for
"8bit-bf16", whose bf16 parameters are their own masters): bytes per tier and family, files, bytes moved, read and
written per step, the host peak, the optimizer's get_memory_usage; auto's split of the state between the host and
the disk under a host capacity; two gloo ranks, each rank's bytes and disk traffic; the update's time at the
profile's 8-bit rates; initialize(plan=) and what it refuses; the arguments refused. Times come from test_choose's
fixed profile."""
from __future__ import annotations

import os

import pytest
import torch

import chunkmem as cm
from chunkmem.plan import plan
from chunkmem.plan.cost_model import step_time
from chunkmem.plan.machine_profile import MachineProfile
from distributed import run_ranks
from models import TinyGPT, lm_loss, resting_tier_bytes
from test_choose import CHUNK, IO, build, counted_training, planned, profile

DISK = dict(disk_memory=2**30, chunk_size=CHUNK, buffer_count=2, buffer_size=IO)


def _optimizer(module: torch.nn.Module, state: str) -> torch.optim.Optimizer:
    """The optimizer a candidate of ``state`` is planned for."""
    if state == "8bit-bf16":
        torchao_optim = pytest.importorskip("torchao.optim")
        return torchao_optim.AdamW8bit(module.parameters(), lr=1e-3, bf16_stochastic_round=True)
    return cm.HybridAdam(module.parameters(), lr=1e-3, state_dtype="8bit")


def real_run(candidate: cm.Candidate, batch: torch.Tensor, nvme_path: str, steps: int = 3) -> dict:
    """Build the candidate with ``initialize(plan=)`` and its optimizer, train ``steps`` steps, return what the ledger
    counted (the last step's moves and disk traffic) and the optimizer's ``get_memory_usage(with_disk=True)``."""
    module = build()
    model, optim = cm.initialize(module, _optimizer(module, candidate.optimizer_state), plan=candidate,
                                 nvme_path=nvme_path if candidate.uses_disk else None)
    return {**counted_training(model, optim, batch, steps), "usage": optim.get_memory_usage(with_disk=True)}


def planned_usage(c: cm.Candidate) -> tuple[int, int, int]:
    """``get_memory_usage(with_disk=True)`` from the candidate's bytes (not ``static``): its families per tier, and
    the parameters where they are their own masters (where they rest, the device under ``cuda``)."""
    families = set(c.extra["optim_families"][0])
    usage = [sum(n for f, n in c.tier_bytes.get(tier, {}).items() if f in families)
             for tier in ("device", "host", "disk")]
    if not c.extra["has_master"]:
        usage[0] += c.tier_bytes["device"].get("param", 0)
        usage[1] += c.tier_bytes["host"].get("param", 0)
        usage[2] += c.tier_bytes.get("disk", {}).get("param", 0)
    return tuple(usage)


def assert_equal_to_real(c: cm.Candidate, real: dict) -> None:
    assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c), c.name
    # the host peak: exact except for 'static' (an upper bound by at most a chunk), as with fp32 state
    if c.policy == "static":
        assert real["host_peak"] <= c.host_peak_bytes <= real["host_peak"] + CHUNK, c.name
    else:
        assert real["host_peak"] == c.host_peak_bytes, c.name
        assert real["usage"] == planned_usage(c), c.name


@pytest.mark.parametrize("dtype,state", [(torch.float32, "8bit"), (torch.bfloat16, "8bit"),
                                         (torch.bfloat16, "8bit-bf16")])
def test_every_8bit_candidate_equals_a_real_run_on_the_device_the_host_and_the_disk(dtype, state, tmp_path):
    """Every placement and disk variant with 8-bit state: the codes on disk, the scales and the small parameters'
    moments in host memory, the masters on disk (bf16 "8bit") or none ("8bit-bf16": the parameters are the masters,
    journaled by an atomic step), I/O buffers holding a whole chunk's shard."""
    batch = torch.randn(4, 64)
    static = ((0.5, 0.5),) if dtype == torch.bfloat16 else ()  # (fp32: as bf16 "8bit-bf16", without its time)
    choice = cm.choose(build, batch, 10 * 2**20, dtype=dtype, profile=profile(), optimizer_states=(state,),
                       static_fractions=static, **DISK)
    names = {c.name for c in choice.candidates}
    suffix = "+" + state
    assert {name + suffix for name in ("cuda", "cpu", "cpu+optim@disk", "cpu+param@disk", "cpu+optim@disk+param@disk",
                                       "auto+optim@disk")} <= names
    assert (f"static(0.5,0.5)+optim@disk+param@disk{suffix}" in names) == bool(static)
    assert all(c.optimizer_state == state and c.name.endswith(suffix) for c in choice.candidates)
    assert any("+reuse" in name for name in names) == (state == "8bit" and dtype != torch.float32)
    cm.set_device_memory_capacity(10 * 2**20)
    for c in choice.candidates:
        assert c.fits and c.time is not None, c.name
        assert_equal_to_real(c, real_run(c, batch, str(tmp_path)))
    cpu_disk = {c.name: c for c in choice.candidates}["cpu+optim@disk" + suffix]
    assert "exp_avg_codes" in cpu_disk.tier_bytes["disk"] and "exp_avg_scales" in cpu_disk.tier_bytes["host"]
    assert ("master" in cpu_disk.tier_bytes["disk"]) == (dtype == torch.bfloat16 and state == "8bit")


@pytest.mark.parametrize("dtype,state,host", [(torch.bfloat16, "8bit", 1_250_000),
                                              (torch.bfloat16, "8bit-bf16", 1_100_000),
                                              (torch.float32, "8bit", 900_000)])
def test_auto_splits_8bit_state_between_the_host_and_the_disk_as_a_real_run(dtype, state, host, tmp_path):
    """Under a host capacity that keeps some chunks' 8-bit state on the host and rests the others' codes on disk
    (the streamed step's buffers hold a whole shard each): the split, bytes and peak equal a real run's."""
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, host_memory=host, dtype=dtype, profile=profile(),
                       optimizer_states=(state,), policies=("auto",), reuse_fp16_shard=False, **DISK)
    split = {c.name: c for c in choice.candidates}[f"auto+optim@disk+{state}"]
    assert split.tier_bytes["host"]["exp_avg_codes"] and split.tier_bytes["disk"]["exp_avg_codes"]
    cm.set_device_memory_capacity(10 * 2**20)
    cm.set_host_memory_capacity(host)
    try:
        for c in choice.candidates:
            if c.fits:
                assert_equal_to_real(c, real_run(c, batch, str(tmp_path)))
            else:  # the runtime agrees: it runs out of host memory
                with pytest.raises(cm.HostCapacityError):
                    real_run(c, batch, str(tmp_path))
    finally:
        cm.set_host_memory_capacity(None)


def _two_ranks_worker(rank, world, expected, directory):
    batch = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    cm.set_device_memory_capacity(10 * 2**20)
    nvme_path = os.path.join(directory, f"rank{rank}")
    os.makedirs(nvme_path)
    return {name: real_run(c, batch, nvme_path, steps=2) for name, c in expected.items()}


def test_two_ranks_8bit_bytes_of_each_rank_equal_real_ranks(tmp_path):
    """ZeRO-3 with 8-bit state on two gloo ranks: the ranks hold different block scales and small parameters'
    moments (where the shard boundary falls), and each rank's bytes are the candidate's for that rank, with the
    state on the device, the host or the disk tier (before 2026-11-27 no 8-bit candidate used the disk on several
    ranks: the optimizer refused it)."""
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, ranks=2, dtype=torch.bfloat16, profile=profile(),
                       reuse_fp16_shard=False, optimizer_states=("fp32", "8bit", "8bit-bf16"),
                       policies=("cpu", "static"), **DISK)
    low_bit = {c.name: c for c in choice.candidates if c.optimizer_state != "fp32"}
    for state in ("8bit", "8bit-bf16"):
        assert {name + "+" + state for name in ("cpu", "static(0.5,0.5)", "cpu+optim@disk", "cpu+param@disk",
                                                "cpu+optim@disk+param@disk")} <= set(low_bit), sorted(low_bit)
    assert all(c.fits and c.time is not None and len(c.tier_bytes_per_rank) == 2 for c in choice.candidates)
    assert low_bit["cpu+8bit"].tier_bytes_per_rank[0] != low_bit["cpu+8bit"].tier_bytes_per_rank[1]
    pytest.importorskip("torchao.optim")
    written_by_ranks = {name: [] for name in low_bit}
    for rank, results in enumerate(run_ranks(_two_ranks_worker, 2, low_bit, str(tmp_path))):
        for name, c in low_bit.items():
            real = results[name]
            assert real["tier_bytes"] == c.tier_bytes_per_rank[rank], (rank, name)
            # each rank writes again its own pages of codes around the blocks its shard boundaries cut
            planned_moves = (c.moved_to_device_per_step, c.moved_to_host_per_step, c.disk_read_per_step,
                             c.disk_written_per_rank[rank])
            assert real["moved"] == planned_moves, (rank, name)
            assert real["host_peak"] <= c.host_peak_bytes <= real["host_peak"] + CHUNK, (rank, name)
            written_by_ranks[name].append(real["moved"][3])
    for name, c in low_bit.items():
        assert c.disk_written_per_step == max(written_by_ranks[name]), name
    # not vacuous: with the codes on disk the ranks' writes differ
    assert len(set(written_by_ranks["cpu+optim@disk+8bit"])) == 2


def test_8bit_candidates_fit_where_fp32_ones_do_not():
    """On a device of 700,000 bytes the fp32 state of 'cuda' does not fit and the 8-bit one does; asked for only."""
    batch = torch.randn(4, 64)
    only_fp32 = cm.choose(build, batch, 700_000, dtype=torch.float32, profile=profile(), chunk_size=CHUNK,
                          policies=("cuda",))
    assert [c.name for c in only_fp32.candidates] == ["cuda"] and not only_fp32.candidates[0].fits
    choice = cm.choose(build, batch, 700_000, dtype=torch.float32, profile=profile(), chunk_size=CHUNK,
                       policies=("cuda",), optimizer_states=("fp32", "8bit"))
    assert [(c.name, c.fits) for c in choice.candidates] == [("cuda", False), ("cuda+8bit", True)]
    assert choice.recommended.name == "cuda+8bit"


def test_the_8bit_update_is_timed_at_its_own_rates():
    """The update's seconds: parameters / the profile's rate of that state (fp32 Adam's, the 8-bit update's per
    dtype, the stochastic rounding one's); the disk step's I/O from the 8-bit families' bytes. A slow 8-bit update
    makes the fp32 candidate the faster one; a profile without the figure gives no time and says which is missing."""
    batch = torch.randn(4, 64)
    p = profile()
    choice = cm.choose(build, batch, 10 * 2**20, dtype=torch.bfloat16, profile=p, reuse_fp16_shard=False,
                       policies=("cpu",), optimizer_states=("fp32", "8bit", "8bit-bf16"), **DISK)
    by_name = {c.name: c for c in choice.candidates}
    elements = sum(by_name["cpu"].extra["trainable_shard_numels"])
    assert by_name["cpu"].time.adam == elements / p.adam_elements_per_s["bfloat16"]
    assert by_name["cpu+8bit"].time.adam == elements / p.low_bit_adam_elements_per_s["bfloat16"]
    assert by_name["cpu+8bit-bf16"].time.adam == elements / p.rounded_adam_elements_per_s
    assert choice.recommended.name == "cpu"  # the 8-bit updates are 6 and 7.5 times slower in this profile
    for state in ("", "+8bit", "+8bit-bf16"):
        c = by_name["cpu+optim@disk" + state]
        on_disk = sum(c.tier_bytes["disk"].values())
        assert c.disk_read_per_step == c.disk_written_per_step == on_disk, c.name
        io = on_disk / p.disk_read_bytes_per_s + on_disk / p.disk_write_bytes_per_s  # (no parameters on disk)
        assert c.time.disk == max(io, elements / p.update_rate(torch.bfloat16, c.optimizer_state)), c.name
        assert c.time.adam == 0.0, c.name
        assert c.predict(p, choice.compute_seconds) == c.time
    fast = profile(low_bit_adam_elements_per_s={"bfloat16": 1e12}, rounded_adam_elements_per_s=1e12)
    assert cm.choose(build, batch, 10 * 2**20, dtype=torch.bfloat16, profile=fast, reuse_fp16_shard=False,
                     policies=("cpu",), optimizer_states=("fp32", "8bit-bf16")).recommended.name == "cpu+8bit-bf16"
    bare = profile(low_bit_adam_elements_per_s={}, rounded_adam_elements_per_s=None)
    c = cm.choose(build, batch, 10 * 2**20, dtype=torch.bfloat16, profile=bare, policies=("cpu",),
                  optimizer_states=("8bit",)).candidates[0]
    assert c.fits and c.time is None and "low_bit_adam_elements_per_s['bfloat16']" in c.reason
    assert step_time(bare, 1.0, torch.bfloat16, moved_bytes=0, adam_elements=1, optimizer_state="8bit-bf16") is None


def test_initialize_takes_an_8bit_candidate_and_refuses_another_state(tmp_path):
    """initialize(plan=) builds an 8-bit disk candidate with its optimizer (torchao's, and HybridAdam's with 8-bit
    state, for "8bit-bf16" both with bf16_stochastic_round=True); it refuses an optimizer that does not keep the state
    planned: fp32 moments, fp32 masters for "8bit-bf16", bf16 masters for a bf16 "8bit"."""
    torchao_optim = pytest.importorskip("torchao.optim")
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, dtype=torch.bfloat16, profile=profile(), policies=("cpu",),
                       reuse_fp16_shard=False, optimizer_states=("8bit", "8bit-bf16"), **DISK)
    by_name = {c.name: c for c in choice.candidates}
    c = by_name["cpu+optim@disk+8bit-bf16"]
    for n, make in enumerate((lambda p: torchao_optim.AdamW8bit(p, bf16_stochastic_round=True),
                              lambda p: cm.HybridAdam(p, state_dtype="8bit", bf16_stochastic_round=True))):
        module = build()
        (tmp_path / str(n)).mkdir()
        model, optim = cm.initialize(module, make(module.parameters()), plan=c, nvme_path=str(tmp_path / str(n)))
        optim.backward(model(batch).float().mean())
        optim.step()
        assert resting_tier_bytes(model) == c.tier_bytes and model.disk_file_bytes() == c.disk_file_bytes
    refused = [(by_name["cpu+8bit-bf16"], lambda p: cm.HybridAdam(p), "optimizer.*bf16_stochastic_round=True"),
               (by_name["cpu+8bit-bf16"], lambda p: cm.HybridAdam(p, state_dtype="8bit"),
                "bf16_stochastic_round.*True"),
               (by_name["cpu+8bit-bf16"], lambda p: torchao_optim.AdamW8bit(p), "bf16_stochastic_round.*True"),
               (by_name["cpu+8bit"], lambda p: torchao_optim.AdamW8bit(p, bf16_stochastic_round=True),
                "bf16_stochastic_round.*False.*fp32 masters"),
               (by_name["cpu+8bit"], lambda p: cm.HybridAdam(p, state_dtype="8bit", bf16_stochastic_round=True),
                r"optimizer \(HybridAdam\).bf16_stochastic_round=True .*False.*fp32 masters"),
               (by_name["cpu+8bit"], lambda p: cm.HybridAdam(p), "optimizer.*8-bit")]
    for candidate, make, message in refused:
        module = build()
        with pytest.raises(cm.InvalidArgumentError, match=message):
            cm.initialize(module, make(module.parameters()), plan=candidate)


def test_plan_counts_bf16_parameters_as_their_own_masters():
    """plan(optimizer_state="8bit-bf16"): no master family, bf16 small-parameter moments, for every placement equal
    to a real run of AdamW8bit(bf16_stochastic_round=True) (its tier bytes and get_memory_usage); 4 bytes a
    parameter fewer than "8bit" (and 2 per small parameter's moment)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    batch = torch.randint(0, 64, (2, 16))
    kwargs = dict(dtype=torch.bfloat16, chunk_size=1 << 16, loss_fn=lambda out, x: lm_loss(out, x))
    kwargs["policies"] = ("cuda", "cpu")  # (auto: in the candidates above)
    plans = plan(lambda: TinyGPT(d=64), batch, 64 * 2**20, optimizer_state="8bit-bf16", **kwargs)
    masters = plan(lambda: TinyGPT(d=64), batch, 64 * 2**20, optimizer_state="8bit", **kwargs)
    cm.set_device_memory_capacity(64 * 2**20)
    for placement in ("cuda", "cpu"):
        model = cm.ShardedModelV2(TinyGPT(d=64), cm.TensorShardStrategy(), tensor_placement_policy=placement,
                                  dtype=torch.bfloat16, chunk_size=1 << 16)
        optim = cm.ShardedOptimizerV2(model, torchao_optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True))
        for _ in range(2):
            optim.backward(lm_loss(model(batch), batch))
            optim.step()
            optim.zero_grad()
        p = plans[placement]
        assert p.tier_bytes == resting_tier_bytes(model), placement
        tier = "device" if placement == "cuda" else "host"
        state = sum(n for f, n in p.tier_bytes[tier].items() if f.startswith("exp_avg"))
        own = state + p.tier_bytes[tier]["param"]  # the parameters are the masters
        assert optim.get_memory_usage() == ((own, 0) if tier == "device" else (0, own)), placement
        elements = sum(c.shard_numel for c in model.chunks if c.trainable)
        assert masters[placement].total(tier) - p.total(tier) == 4 * elements + 2 * (
            masters[placement].tier_bytes[tier]["exp_avg_fp32"] - p.tier_bytes[tier]["exp_avg_fp32"]), placement


def test_bad_optimizer_states_are_named():
    batch = torch.randn(4, 64)
    for value, error in [("8bit", cm.InvalidArgumentError), ((), cm.InvalidArgumentError),
                         (("fp32", "int8"), cm.InvalidArgumentError), ((8,), cm.ArgumentTypeError)]:
        with pytest.raises(error, match="optimizer_states"):
            cm.choose(build, batch, 2**20, profile=profile(), optimizer_states=value)
    for kwargs, words in [(dict(dtype=torch.float16), "optimizer_states.*8bit-bf16.*dtype=torch.bfloat16"),
                          (dict(dtype=torch.bfloat16, reuse_fp16_shard=True),
                           "optimizer_states.*reuse_fp16_shard=False")]:
        with pytest.raises(cm.InvalidArgumentError, match=words):
            cm.choose(build, batch, 2**20, profile=profile(), optimizer_states=("fp32", "8bit-bf16"), **kwargs)
    with pytest.raises(cm.InvalidArgumentError, match="optimizer_state.*8bit-bf16.*dtype=torch.bfloat16"):
        plan(build, batch, 2**20, dtype=torch.float32, optimizer_state="8bit-bf16")
    with pytest.raises(cm.InvalidArgumentError, match="optimizer_state.*'fp32', '8bit', '8bit-bf16'"):
        plan(build, batch, 2**20, optimizer_state="4bit")


def test_profile_8bit_rates_round_trip_and_bad_values():
    p = profile()
    assert MachineProfile.from_dict(p.to_dict()) == p
    assert p.update_rate(torch.float16, "8bit") == 2.5e8 and p.update_rate(torch.bfloat16, "8bit-bf16") == 2e8
    old = {k: v for k, v in p.to_dict().items()
           if k not in ("low_bit_adam_elements_per_s", "rounded_adam_elements_per_s")}
    assert MachineProfile.from_dict(old).update_rate(torch.float32, "8bit") is None  # a profile saved before
    with pytest.raises(cm.InvalidArgumentError, match="low_bit_adam_elements_per_s"):
        profile(low_bit_adam_elements_per_s={"int8": 1e9})
    with pytest.raises(cm.InvalidArgumentError, match="low_bit_adam_elements_per_s"):
        profile(low_bit_adam_elements_per_s={"float32": 0.0})
    with pytest.raises(cm.InvalidArgumentError, match="rounded_adam_elements_per_s"):
        profile(rounded_adam_elements_per_s=-1.0)


def test_command_line_plans_8bit_states(capsys, tmp_path):
    import json

    from chunkmem.plan.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().to_dict()))
    common = ["--preset", "tiny", "--seq-len", "8", "--batch-size", "1", "--device-memory", "64MiB", "--dtype", "bf16"]
    main(common + ["--candidates", "--profile", str(path), "--static-fractions", "", "--optimizer-states",
                   "fp32,8bit-bf16"])
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line.split()]
    assert {"cpu", "cpu+reuse", "cpu+8bit-bf16", "auto+8bit-bf16"} <= set(rows)
    assert not any(row.endswith("reuse+8bit-bf16") for row in rows)
    main(common + ["--optimizer-states", "8bit-bf16"])
    out = capsys.readouterr().out
    assert "exp_avg_codes" in out and "master" not in out
    with pytest.raises(cm.InvalidArgumentError, match="optimizer_state"):
        main(common[:-1] + ["fp16", "--optimizer-states", "8bit-bf16"])
