"""chunkmem's Lightning strategy (``chunkmem.integrations.lightning.ChunkmemStrategy``) against plain Lightning.

The LightningModule (``lightning_script.LitGPT``: a tiny GPT with tied weights, a parameter of the module
used in ``training_step``, AdamW, a step-wise schedule) trains under the Trainer's default strategy and
under ``ChunkmemStrategy``, fp32, with ``gradient_clip_val`` below the gradients' norm at every step:

* one process: the per-step losses and the final weights are plain Lightning's within fp32 reassociation
  (stages 3 and 2); validate / predict after fit reuse the wrapped model;
* ``save_checkpoint`` then ``fit(ckpt_path=...)`` with a fresh Trainer and module continues bit for bit like
  the uninterrupted run (as plain Lightning does);
* two processes (gloo; Lightning runs ``lightning_script.py`` again for the second rank): the mean of the
  ranks' losses is the plain one-process run's with the same global batch, the weights are its weights,
  and the resume is bitwise there too;
* what it cannot do is refused with an error naming the setting.

Plain and chunkmem runs see the same data: the strategy is in the DDP family, so Lightning gives its
training dataloader a ``DistributedSampler`` (shuffled with seed 0, split over the ranks); the plain runs get
that sampler explicitly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import chunkmem as cm  # noqa: E402
from chunkmem.integrations.lightning import ChunkmemStrategy  # noqa: E402
from lightning_script import CLIP, SAMPLES, SEQ, STAGE3, VOCAB, LitGPT, dataset, trainer  # noqa: E402
from models import TinyGPT  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "lightning_module.py")


class _RecordingNorms(LitGPT):
    """The plain run also records the gradients' norm before clipping (to show that clipping acts)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def _plain(batch: int, epochs: int = 2):  # noqa: ANN202
    """Plain Lightning, one process, on the data order the chunkmem runs get."""
    data = dataset()
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    model = _RecordingNorms()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer("auto", epochs).fit(model, loader)
    return model


def _chunkmem(config: dict, batch: int, epochs: int = 2, ckpt_path: str | None = None, **kwargs):  # noqa: ANN202
    model = LitGPT()
    run = trainer(ChunkmemStrategy(config), epochs, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, DataLoader(dataset(), batch_size=batch), ckpt_path=ckpt_path)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]  # no false order warning
    return model, run


@pytest.fixture(scope="module")
def plain():
    return _plain(batch=8)


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted chunkmem run (stage 3, one process) and its full weights."""
    model, run = _chunkmem(STAGE3, batch=8)
    return model.losses, run.strategy.lightning_module_state_dict(), run, model


def _assert_close_weights(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == torch.float32, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=atol, msg=key)


def test_one_process_trains_as_plain_lightning(plain, straight):
    assert min(plain.norms) > CLIP  # the clipping acts at every step
    losses, weights, run, _ = straight
    assert len(losses) == len(plain.losses) == 2 * SAMPLES // 8
    assert losses == pytest.approx(plain.losses, rel=1e-5)
    _assert_close_weights(weights, plain.state_dict())
    assert isinstance(run.strategy.model, cm.ShardedModelV2)
    assert isinstance(run.optimizers[0], cm.ShardedOptimizerV2)


def test_zero_stage_2_trains_as_plain_lightning(plain):
    model, run = _chunkmem({"zero_optimization": {"stage": 2}}, batch=8)
    assert isinstance(run.optimizers[0], cm.LowLevelZeroOptimizer)
    assert model.losses == pytest.approx(plain.losses, rel=1e-5)
    _assert_close_weights(run.strategy.lightning_module_state_dict(), plain.state_dict())


class _BuiltInConfigureModel(LitGPT):
    """The GPT made in ``configure_model`` (the strategy's ``tensor_init_context``), as large models are."""

    def __init__(self) -> None:
        super().__init__()
        del self.gpt

    def configure_model(self) -> None:
        if not hasattr(self, "gpt"):
            torch.manual_seed(0)
            self.gpt = TinyGPT(vocab=VOCAB, seq=SEQ)


def test_a_model_made_in_configure_model_trains_as_plain_lightning(plain):
    model = _BuiltInConfigureModel()
    run = trainer(ChunkmemStrategy(STAGE3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(model, DataLoader(dataset(), batch_size=8))
    assert model.losses == pytest.approx(plain.losses, rel=1e-5)


@pytest.mark.parametrize("stage", [3, 2])
def test_clipping_by_value_is_plain_lightnings(stage):
    want = LitGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer("auto", 1, gradient_clip_val=0.01, gradient_clip_algorithm="value").fit(
            want, DataLoader(dataset(), batch_size=8, sampler=DistributedSampler(dataset(), num_replicas=1, rank=0)))
    got, run = _chunkmem({"zero_optimization": {"stage": stage}}, batch=8, epochs=1, gradient_clip_val=0.01,
                         gradient_clip_algorithm="value")
    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    _assert_close_weights(run.strategy.lightning_module_state_dict(), want.state_dict())


def test_validate_and_predict_after_fit_use_the_wrapped_model(plain, straight):
    _, weights, run, model = straight
    loader = DataLoader(dataset(), batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run.validate(model, loader, verbose=False)[0]["val_loss"]
        want = trainer("auto").validate(plain, loader, verbose=False)[0]["val_loss"]
        predicted = torch.cat(run.predict(model, loader))
    assert got == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(predicted, torch.cat([plain(b[0]) for b in loader]).detach(), rtol=1e-4, atol=1e-5)
    assert run.strategy.model.module is model  # still chunkmem's after fit and the later stages


def test_save_checkpoint_then_fit_ckpt_path_resumes_bit_for_bit(straight, tmp_path):
    losses, weights, _, _ = straight
    first, run = _chunkmem(STAGE3, batch=8, epochs=1)
    run.save_checkpoint(tmp_path / "first.ckpt")
    saved = torch.load(tmp_path / "first.ckpt", weights_only=False)
    assert saved["state_dict"].keys() == LitGPT().state_dict().keys()  # the plain module's keys, full, fp32
    assert saved["optimizer_states"][0]["state"]  # torch's AdamW layout
    resumed, run = _chunkmem(STAGE3, batch=8, ckpt_path=tmp_path / "first.ckpt")
    assert first.losses + resumed.losses == losses
    got = run.strategy.lightning_module_state_dict()
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    # the checkpoint is plain Lightning's: the plain module loads it
    plain_module = LitGPT.load_from_checkpoint(tmp_path / "first.ckpt", weights_only=False)
    assert all(torch.equal(plain_module.state_dict()[k], v) for k, v in saved["state_dict"].items())


def test_two_processes_train_as_one_with_the_global_batch(tmp_path):
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK")}
    # a session of its own: Lightning starts rank 1 from rank 0, and a timeout ends both
    script = subprocess.Popen([sys.executable, os.path.join(HERE, "lightning_script.py"), str(out), str(tmp_path), "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = script.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        raise
    assert script.returncode == 0 and out.exists(), stderr[-4000:]
    with open(out) as f:
        got = json.load(f)
    ranks = got["ranks"]
    assert len(ranks) == 2
    plain = _plain(batch=8)  # each rank's batch is 4
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["full"], ranks[1]["full"])]
    assert mean == pytest.approx(plain.losses, rel=1e-5)
    weights = {k: torch.tensor(v) for k, v in got["weights"]["full"].items()}
    # Two ranks sum the batch in another order, and Adam divides tiny gradients by their own size: plain
    # Lightning's DDP on two processes ends 1.3e-5 away from this one-process run too (and chunkmem's two
    # ranks within 5e-7 of plain DDP's)
    _assert_close_weights(weights, plain.state_dict(), atol=5e-5)
    for rank in ranks:  # the resume at two processes is bit for bit too
        assert rank["first"] + rank["resumed"] == rank["full"]
    assert got["weights"]["resumed"] == got["weights"]["full"]


def test_sixteen_bit_configs_train(tmp_path):
    for config in ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "initial_scale_power": 8}},
                   {"zero": {"model_config": {"dtype": "bf16", "tensor_placement_policy": "cpu"},
                             "optimizer_config": {}}}):
        model, run = _chunkmem(config, batch=8, epochs=1)
        assert len(model.losses) == 4 and all(torch.isfinite(torch.tensor(model.losses)))
        assert model.losses[-1] < model.losses[0]
        weights = run.strategy.lightning_module_state_dict()
        assert all(v.dtype == torch.float32 for v in weights.values())  # the fp32 masters


def _fit_error(strategy: ChunkmemStrategy, model: L.LightningModule | None = None, **kwargs) -> BaseException:
    run = trainer(strategy, 1, **{"gradient_clip_val": CLIP, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(cm.ChunkmemError) as error:
            run.fit(model or LitGPT(), DataLoader(dataset(), batch_size=8))
    return error.value


class _TwoOptimizers(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # Lightning itself takes several optimizers only so

    def configure_optimizers(self):  # noqa: ANN201
        return [torch.optim.AdamW(self.gpt.parameters()), torch.optim.SGD([self.logit_scale], lr=0.1)]


def test_what_cannot_work_is_refused_naming_the_setting():
    with pytest.raises(cm.InvalidArgumentError, match="precision.*16-mixed.*32-true"):
        L.Trainer(strategy=ChunkmemStrategy(STAGE3), accelerator="cpu", devices=1, precision="16-mixed")
    error = _fit_error(ChunkmemStrategy(dict(STAGE3, gradient_clipping=1.0)))  # the Trainer clips at CLIP too
    assert isinstance(error, cm.InvalidArgumentError) and error.argument == "gradient_clipping"
    error = _fit_error(ChunkmemStrategy(dict(STAGE3, gradient_accumulation_steps=4)))
    assert isinstance(error, cm.InvalidArgumentError) and "accumulate_grad_batches=1" in str(error)
    error = _fit_error(ChunkmemStrategy(STAGE3), _TwoOptimizers(), gradient_clip_val=None)
    assert "2 optimizers" in str(error)
    zero2 = LitGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(ChunkmemStrategy({"zero_optimization": {"stage": 2}}), 1, limit_train_batches=1).fit(
            zero2, DataLoader(dataset(), batch_size=8))
    error = _fit_error(ChunkmemStrategy({"zero_optimization": {"stage": 2}}), zero2)
    assert "second fit" in str(error) and "ckpt_path" in str(error)
    error = _fit_error(ChunkmemStrategy({"zero_optimization": {"stage": 0}}))
    assert isinstance(error, cm.InvalidArgumentError) and error.argument == "zero_optimization.stage"


EXAMPLE_TINY = ["--vocab", "32", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16",
                "--batch-size", "4", "--epochs", "2", "--epoch-steps", "4", "--warmup", "2", "--lr", "1e-2", "--quiet"]


def test_the_example_trains_and_resumes_bit_for_bit(tmp_path):
    spec = importlib.util.spec_from_file_location("lightning_module_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    straight = example.main(EXAMPLE_TINY)
    losses = straight["losses"]
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2]) - 0.2
    assert isinstance(straight["trainer"].strategy.model, cm.ShardedModelV2) and straight["val_loss"] is not None
    first = example.main(EXAMPLE_TINY + ["--stop-after", "1", "--save", str(tmp_path / "run.ckpt")])
    assert first["losses"] == losses[:4]
    resumed = example.main(EXAMPLE_TINY + ["--resume", str(tmp_path / "run.ckpt")])
    assert resumed["losses"] == losses[4:]
