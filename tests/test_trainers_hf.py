"""Hugging Face Trainer and Accelerate driving chunkmem's ZeRO-3 model and optimizer (skipped without
transformers or accelerate), each against the same run of the plain module: per-step losses and gradient
norms (Trainer's log_history), final weights, save_model -> from_pretrained, resume_from_checkpoint,
gradient clipping, gradient accumulation, Accelerate's save_state/load_state, and two processes over gloo."""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

import chunkmem as cm
from chunkmem.optim.sharded_optimizer import ShardedOptimizerV2
from distributed import run_ranks

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

from chunkmem.integrations.transformers import ChunkmemAccelerator, ChunkmemTrainer  # noqa: E402

STAGE3 = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
          "gradient_clipping": 0.0}  # the clipping is the trainer's (max_grad_norm / clip_grad_norm_)
LR = 1e-2

@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps one process-wide state (mixed precision, distributed type); each test starts anew."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _llama(tied=False):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=tied))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16):
        self.ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model_and_optimizer(chunkmem, tied=False, config=STAGE3, optimizer=True):
    torch.manual_seed(0)
    model = _llama(tied)
    optim = torch.optim.AdamW(model.parameters(), lr=LR) if optimizer else None
    if chunkmem:
        model, optim = cm.initialize(model, optim, config)
    return model, optim


def _trainer(cls, model, optim, out, *, steps=4, own_optimizer=False, per_device_train_batch_size=4, **args):
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=per_device_train_batch_size,
                             max_steps=steps, logging_steps=1,
                             save_strategy=args.pop("save_strategy", "no"), report_to="none", seed=0,
                             disable_tqdm=True, dataloader_pin_memory=False, learning_rate=LR, **args)
    optimizers = (None, None) if own_optimizer else (optim, get_linear_schedule_with_warmup(optim, 0, 8))
    return cls(model=model, args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(8), optimizers=optimizers)


def _logged(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _assert_close_runs(ours, theirs):
    """Losses and gradient norms within fp32 reassociation (the chunked reductions sum in another order)."""
    assert len(ours) == len(theirs)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)


def _assert_close_weights(ours, theirs, atol=1e-6):
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].float(), value.float(), rtol=1e-5,
                                   atol=atol * max(1.0, value.abs().max().item()), msg=lambda m, k=key: f"{k}: {m}")


# ---- Trainer, one process -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _plain_trainer_run(max_grad_norm, accumulation, tied=False):
    """The plain module under the plain Trainer (computed once per setting): logged losses and norms, final
    weights, eval loss."""
    with tempfile.TemporaryDirectory() as out:
        plain = _trainer(Trainer, *_model_and_optimizer(False, tied=tied), out, max_grad_norm=max_grad_norm,
                         gradient_accumulation_steps=accumulation)
        plain.train()
        return _logged(plain), plain.model.state_dict(), plain.evaluate()["eval_loss"]


@pytest.mark.parametrize("cls", [ChunkmemTrainer, Trainer],
                         ids=["ChunkmemTrainer", "Trainer"])
@pytest.mark.parametrize("max_grad_norm, accumulation", [(0.0, 1), (1.0, 1), (0.01, 2)],
                         ids=["no-clip", "default-clip", "clip0.01-accumulate2"])
def test_trainer_trains_as_the_plain_module(cls, max_grad_norm, accumulation, tmp_path):
    """Trainer's default max_grad_norm=1.0 clips here (the norms are above 1); 0.01 clips every step."""
    plain_logged, plain_weights, plain_eval = _plain_trainer_run(max_grad_norm, accumulation)
    model, optim = _model_and_optimizer(True)
    # the plain Trainer reads the label names off the model's class, the wrapper's here: it needs them named
    # (else evaluate() computes no loss); ChunkmemTrainer reads them off the wrapped module's class
    labels = {"label_names": ["labels"]} if cls is Trainer else {}
    ours = _trainer(cls, model, optim, tmp_path, max_grad_norm=max_grad_norm,
                    gradient_accumulation_steps=accumulation, **labels)
    ours.train()
    _assert_close_runs(_logged(ours), plain_logged)
    if max_grad_norm:
        assert all(norm > max_grad_norm for _, norm in plain_logged)  # clipping did act
    _assert_close_weights(model.state_dict(), plain_weights)
    # evaluation: model.eval(), a no_grad forward, the loss (Trainer finds the labels of the wrapped module)
    torch.testing.assert_close(ours.evaluate()["eval_loss"], plain_eval, rtol=1e-5, atol=0)


def test_trainer_builds_its_own_optimizer_and_schedule(tmp_path):
    """optimizers=(None, None): Trainer's AdamW (weight-decay groups from args) and linear schedule; for a
    chunkmem model ChunkmemTrainer puts chunkmem's step around that AdamW."""
    plain = _trainer(Trainer, _llama_seeded(), None, tmp_path / "plain", own_optimizer=True, weight_decay=0.1,
                     warmup_steps=1)
    plain.train()
    model, none = _model_and_optimizer(True, optimizer=False)
    assert none is None
    ours = _trainer(ChunkmemTrainer, model, None, tmp_path / "ours", own_optimizer=True, weight_decay=0.1,
                    warmup_steps=1)
    ours.train()
    assert isinstance(ours.optimizer.optimizer, ShardedOptimizerV2)
    _assert_close_runs(_logged(ours), _logged(plain))
    _assert_close_weights(model.state_dict(), plain.model.state_dict())


def _llama_seeded(tied=False):
    torch.manual_seed(0)
    return _llama(tied)


def test_save_model_writes_what_from_pretrained_loads(tmp_path):
    """Tied embeddings: the plain Trainer's safetensors path would refuse the shared tensor."""
    model, optim = _model_and_optimizer(True, tied=True)
    trainer = _trainer(ChunkmemTrainer, model, optim, tmp_path / "run", steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert {"config.json", "model.safetensors", "training_args.bin"} <= set(os.listdir(tmp_path / "saved"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ours = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, ours[key]), key


class _StopAfter(TrainerCallback):
    """Ends the run after ``step`` optimizer steps, as if it were killed there."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("chunkmem", [False, True], ids=["plain", "chunkmem"])
def test_resume_from_checkpoint_continues_bit_for_bit(chunkmem, tmp_path):
    """A run killed after step 3 (checkpoints every 2 steps), resumed by a fresh Trainer over a freshly
    wrapped model from checkpoint-2, logs the same losses and ends with the same weights as the run that was
    never interrupted, bit for bit, as the plain Trainer's resume does (the parametrization shows it)."""
    cls = ChunkmemTrainer if chunkmem else Trainer
    straight = _trainer(cls, *_model_and_optimizer(chunkmem), tmp_path / "straight")
    straight.train()
    killed = _trainer(cls, *_model_and_optimizer(chunkmem), tmp_path / "killed", save_strategy="steps", save_steps=2)
    killed.add_callback(_StopAfter(3))
    killed.train()
    assert sorted(os.listdir(tmp_path / "killed")) == ["checkpoint-2"]
    resumed = _trainer(cls, *_model_and_optimizer(chunkmem), tmp_path / "killed", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "killed" / "checkpoint-2"))
    assert _logged(resumed) == _logged(straight)
    ours, theirs = resumed.model.state_dict(), straight.model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("scale_power", [
    8, 20],
    ids=["no-skip", "skips"])
def test_fp16_goes_through_the_loss_scaler_and_skipped_steps_keep_the_schedule(scale_power, tmp_path):
    """A chunkmem fp16 model under ChunkmemTrainer trains as chunkmem's own loop (optim.backward; a step the
    scaler skips does not advance the schedule), bit for bit; every row is the same, so batch order is moot."""
    config = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": scale_power, "hysteresis": 1}}
    model, optim = _model_and_optimizer(True, config=config)
    trainer = _trainer(ChunkmemTrainer, model, optim, tmp_path / "fp16", steps=5, max_grad_norm=0.0)
    trainer.train_dataset.ids[:] = trainer.train_dataset.ids[0]
    trainer.train()
    batch = trainer.train_dataset.ids[:4]

    model2, optim2 = _model_and_optimizer(True, config=config)
    schedule = get_linear_schedule_with_warmup(optim2, 0, 8)
    losses, skipped = [], 0
    for _ in range(5):
        loss = model2(input_ids=batch, labels=batch).loss
        optim2.backward(loss)
        losses.append(loss.item())
        if optim2.step():
            schedule.step()
        else:
            skipped += 1
        optim2.zero_grad()
    assert (skipped > 0) == (scale_power > 8)  # 2**20: two of the five steps overflow
    assert [loss for loss, _ in _logged(trainer)] == pytest.approx(losses, rel=0, abs=0)
    ours, theirs = model.state_dict(), model2.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_what_is_refused_names_the_alternative(tmp_path):
    zero2_model, zero2 = _model_and_optimizer(True, config={"zero_optimization": {"stage": 2}})
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=1)
    with pytest.raises(cm.UnsupportedOperationError, match="LowLevelZeroOptimizer.*Use stage 3"):
        ChunkmemTrainer(model=zero2_model, args=args, train_dataset=_Tokens(), optimizers=(zero2, None))
    model, _ = _model_and_optimizer(True, optimizer=False)
    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer above set up Accelerate without it
    with pytest.raises(cm.UnsupportedOperationError, match="mixed precision.*chunkmem's config"):
        ChunkmemAccelerator(mixed_precision="bf16").prepare(model)


# ---- Accelerate, one process ----------------------------------------------------------------------------

def _accelerate_loop(accelerator_cls, chunkmem, *, out, micro_steps=6, save_at=None, resume_at=None, clip=0.05):
    """The loop of Accelerate's documentation: prepare, accumulate (2 micro-batches a step), backward,
    clip_grad_norm_ on the step's micro-batch, step, schedule, zero_grad; save_state after micro-batch
    ``save_at``; with ``resume_at``, load_state and skip the batches already seen."""
    model, optim = _model_and_optimizer(chunkmem)
    schedule = get_linear_schedule_with_warmup(optim, 2, 8)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(3))
    accelerator = accelerator_cls(gradient_accumulation_steps=2)
    model, optim, loader, schedule = accelerator.prepare(model, optim, loader, schedule)
    batches, done = loader, 0
    if resume_at is not None:
        accelerator.load_state(str(out))
        batches, done = accelerator.skip_first_batches(loader, resume_at), resume_at
    losses, norms = [], []
    model.train()
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), clip).item())
            optim.step()
            schedule.step()
            optim.zero_grad()
        losses.append(loss.item())
        done += 1
        if done == save_at:
            accelerator.save_state(str(out))
        if done == micro_steps:
            break
    weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    return losses, norms, weights, accelerator, model


@functools.lru_cache(maxsize=None)
def _plain_accelerate_run():
    with tempfile.TemporaryDirectory() as out:
        return _accelerate_loop(Accelerator, False, out=out)[:3]


@pytest.mark.parametrize("accelerator_cls", [ChunkmemAccelerator, Accelerator],
                         ids=["ChunkmemAccelerator", "Accelerator"])
def test_accelerate_loop_trains_saves_and_resumes_as_the_plain_module(accelerator_cls, tmp_path):
    plain_losses, plain_norms, plain_weights = _plain_accelerate_run()
    assert all(norm > 0.05 for norm in plain_norms)  # the clipping acts
    losses, norms, weights, accelerator, model = _accelerate_loop(accelerator_cls, True, out=tmp_path / "state",
                                                                  save_at=2)
    _assert_close_runs(list(zip(losses, losses)), list(zip(plain_losses, plain_losses)))
    _assert_close_runs(list(zip(norms, norms)), list(zip(plain_norms, plain_norms)))
    _assert_close_weights(weights, plain_weights)

    # the documented export: unwrap_model(...).save_pretrained(state_dict=get_state_dict(...)), loads plainly
    accelerator.unwrap_model(model).save_pretrained(str(tmp_path / "export"), state_dict=dict(weights),
                                                    save_function=accelerator.save)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())

    # save_state after the first optimizer step, load_state into a fresh wrap: the rest bit for bit
    resumed, _, resumed_weights, _, _ = _accelerate_loop(accelerator_cls, True, out=tmp_path / "state", resume_at=2)
    assert resumed == losses[2:]
    assert all(torch.equal(resumed_weights[k], weights[k]) for k in weights)


# ---- two processes: Trainer under ZeRO-3 over gloo --------------------------------------------------------

def _two_rank_trainer(rank, world, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    model, optim = _model_and_optimizer(True, tied=True)
    # per device 2 x 2 ranks: the plain run's batch of 4; use_cpu: Accelerate's gloo data parallelism on CPUs
    trainer = _trainer(ChunkmemTrainer, model, optim, out, per_device_train_batch_size=2, use_cpu=True,
                       max_grad_norm=1.0, save_strategy="steps", save_steps=2)
    assert trainer.args.world_size == 2 and trainer.model is model
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))
    weights = model.state_dict()
    # a fresh wrap on both ranks resumes from the checkpoint the two of them wrote
    model, optim = _model_and_optimizer(True, tied=True)
    resumed = _trainer(ChunkmemTrainer, model, optim, os.path.join(out, "resumed"), per_device_train_batch_size=2,
                       use_cpu=True, max_grad_norm=1.0)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed_weights = model.state_dict()
    return _logged(trainer), _logged(resumed), eval_loss, weights, all(
        torch.equal(resumed_weights[k], weights[k]) for k in weights)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo data parallelism on CPUs (use_cpu=True)")
def test_two_processes_train_as_one_with_the_same_global_batch(tmp_path):
    (logged0, resumed0, eval0, weights0, same0), (logged1, resumed1, eval1, _, same1) = run_ranks(
        _two_rank_trainer, 2, str(tmp_path / "run"))
    assert logged0 == logged1 and eval0 == eval1  # Trainer logs the mean over the ranks
    assert resumed0 == logged0 and resumed1 == logged1 and same0 and same1  # resumed bit for bit
    plain_logged, plain_weights, plain_eval = _plain_trainer_run(1.0, 1, tied=True)
    _assert_close_runs(logged0, plain_logged)
    torch.testing.assert_close(eval0, plain_eval, rtol=1e-5, atol=0)
    # the gradient is the mean of two half-batch means, another summation order; Adam's normalised update turns
    # a rounding difference of a near-zero gradient into a visible one: a thousandth of the learning rate
    _assert_close_weights(weights0, plain_weights, atol=1e-3 * LR)
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(torch.equal(v, weights0[k]) for k, v in saved.state_dict().items())
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(
        os.listdir(tmp_path / "run" / "checkpoint-2"))
