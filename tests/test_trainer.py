"""HarmonyTrainer (harmony/integrations/transformers.py): Hugging Face's Trainer with each step run by Harmony.

Tiny GPT-2s built from configs (random weights, nothing downloaded), a few steps each, two microbatches of 4 rows a
step under a budget that swaps. Every label row starts with -100: Trainer counts a batch's label tokens before
the model shifts them (16 a row where the loss has 15), Harmony counts the tokens the loss sees; with the first
label ignored the two counts agree, and HarmonyTrainer's steps are Trainer's to the bit.
"""
from __future__ import annotations

import os

import harmony  # noqa: F401  (before torch: it sets the OpenMP and allocator variables)
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from harmony.errors import CheckpointError, ConfigError, InputError  # noqa: E402
from harmony.integrations.transformers import HarmonyTrainer  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

VOCAB, SEQ, BUDGET = 64, 16, "1MiB"


def gpt2(dropout: float):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def dataset(rows: int, seed: int) -> list[dict]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": torch.cat([torch.tensor([-100]), r[1:]])} for r in ids]


def arguments(out, **changes) -> TrainingArguments:
    kw = dict(max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
              learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=0.5, logging_steps=1,
              report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no")
    return TrainingArguments(str(out), **{**kw, **changes})


def make(cls, out, dropout=0.1, train_rows=32, harmony_config=None, **changes):
    extra = {"harmony_config": {"memory_budget": BUDGET, **(harmony_config or {})}} if cls is HarmonyTrainer else {}
    return cls(model=gpt2(dropout), args=arguments(out, **changes), train_dataset=dataset(train_rows, 1),
               eval_dataset=dataset(8, 2), **extra)


def logged(trainer, key="loss") -> dict[int, dict]:
    return {e["step"]: e for e in trainer.state.log_history if key in e}


def weights(trainer) -> dict:
    return trainer.sm.state_dict() if isinstance(trainer, HarmonyTrainer) else trainer.model.state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


@pytest.mark.slow
def test_steps_clipping_schedule_and_evaluation_are_trainers_to_the_bit(tmp_path):
    """No dropout: HarmonyTrainer's loss, grad_norm, learning rate and weights after every step are a plain Trainer's
    (gradient accumulation over 2 batches of 4, clipping to 0.5, cosine with warm-up, fused AdamW), and so is the
    evaluation's loss."""
    ours = make(HarmonyTrainer, tmp_path / "h", dropout=0.0, max_steps=4)
    theirs = make(Trainer, tmp_path / "t", dropout=0.0, max_steps=4)
    ours.train()
    theirs.train()
    cfg = ours.sm.program.config
    assert (cfg.clip_grad_norm, cfg.microbatches, cfg.optimizer) == (0.5, 2, torch.optim.AdamW)
    assert ours.args.per_device_train_batch_size == 8 and ours.args.gradient_accumulation_steps == 1
    mine, eager = logged(ours), logged(theirs)
    assert sorted(mine) == sorted(eager) == [1, 2, 3, 4]
    for step in mine:
        for key in ("loss", "grad_norm", "learning_rate"):
            assert mine[step][key] == eager[step][key], (step, key, mine[step], eager[step])
    assert all(mine[s]["grad_norm"] > 0.5 for s in mine)         # every step clipped
    assert len({mine[s]["learning_rate"] for s in mine}) == 4      # the schedule moved
    assert_same_weights(weights(ours), weights(theirs))
    assert ours.evaluate()["eval_loss"] == theirs.evaluate()["eval_loss"]
    ours.end()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """6 steps with dropout, evaluated and saved every 3 (mid-epoch: 4 steps an epoch); its first checkpoint."""
    out = tmp_path_factory.mktemp("full")
    trainer = make(HarmonyTrainer, out, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3)
    trainer.train()
    yield trainer, out
    trainer.end()


@pytest.mark.slow
def test_logs_loss_grad_norm_lr_and_harmonys_memory_and_traffic(full_run):
    trainer, _ = full_run
    logs = logged(trainer)
    assert sorted(logs) == [1, 2, 3, 4, 5, 6]
    assert logs[6]["grad_norm"] == trainer.sm.stats["grad_norm"] and all(e["grad_norm"] > 0 for e in logs.values())
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    cosine = transformers.get_cosine_schedule_with_warmup(sgd, num_warmup_steps=1, num_training_steps=6)
    expected = []
    for _ in range(6):
        expected.append(cosine.get_last_lr()[0])
        sgd.step()
        cosine.step()
    assert [logs[s]["learning_rate"] for s in sorted(logs)] == expected
    budget = 2**20
    for e in logs.values():
        assert e["harmony_budget_bytes"] == budget and 0 < e["harmony_peak_bytes"] <= budget
        assert e["harmony_h2d_bytes"] > 0 and e["harmony_d2h_bytes"] > 0        # weights swapped under the budget
    assert sorted(logged(trainer, "eval_loss")) == [3, 6]


@pytest.mark.slow
def test_checkpoints_hold_harmonys_state_and_load_with_from_pretrained(full_run):
    trainer, out = full_run
    ckpt = out / "checkpoint-6"
    assert (ckpt / "harmony" / "manifest.json").exists() and (ckpt / "model.safetensors").exists()
    assert not (ckpt / "optimizer.pt").exists()     # Harmony's optimizer state is in harmony/
    again = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    assert_same_weights(again.state_dict(), weights(trainer))


@pytest.mark.slow
def test_resume_from_checkpoint_is_bitwise_the_uninterrupted_run(full_run, tmp_path):
    """From checkpoint-3 of the run with dropout: the same data order (mid-epoch, then the next epoch's shuffle),
    dropout masks, learning rates, losses and grad norms, and the same weights to the bit after step 6."""
    full, out = full_run
    resumed = make(HarmonyTrainer, out, eval_strategy="steps", eval_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.sm.steps == 6
    first, second = logged(full), logged(resumed)
    for step in (4, 5, 6):
        assert second[step] == first[step], step
    assert logged(resumed, "eval_loss")[6]["eval_loss"] == logged(full, "eval_loss")[6]["eval_loss"]
    assert_same_weights(weights(resumed), weights(full))
    resumed.end()


@pytest.mark.parametrize("harmony_config, changes, kwargs, match", [
    ({"clip_grad_norm": 1.0}, {}, {}, "max_grad_norm"),
    ({"optimizer": torch.optim.SGD}, {}, {}, "optim="),
    ({"optimizer_kwargs": {"lr": 1.0}}, {}, {}, "learning_rate"),
    ({"parallel": "pipeline"}, {}, {}, "pipeline"),
    ({"precision": "fp16"}, {"bf16": True}, {}, "precision"),
    ("512KiB", {}, {}, "harmony.Config"),
    (None, {"per_device_eval_batch_size": 16}, {}, "per_device_eval_batch_size"),
    (None, {"torch_compile": True}, {}, "torch_compile"),
    (None, {"activation_checkpointing": True}, {}, "recompute"),
    (None, {}, {"model_init": lambda: None}, "compiled once"),
])
def test_what_harmony_cannot_honour_is_refused_before_anything_runs(tmp_path, harmony_config, changes, kwargs,
                                                                       match):
    with pytest.raises(ConfigError, match=match):
        HarmonyTrainer(model=gpt2(0.0), args=arguments(tmp_path, **changes), train_dataset=dataset(8, 1),
                       harmony_config=harmony_config, **kwargs)


@pytest.mark.parametrize("changes, harmony_config, expected", [
    ({"bf16": True, "gradient_accumulation_steps": 4, "max_grad_norm": 0.3}, None,
     {"precision": "bf16", "microbatches": 4, "clip_grad_norm": 0.3}),
    ({"max_grad_norm": 0.0, "gradient_accumulation_steps": 1}, {"microbatches": 2, "memory_budget": "2MiB"},
     {"precision": "fp32", "microbatches": 2, "clip_grad_norm": None, "memory_budget": 2 * 2**20}),
    ({"fp16": True}, {"loss_scaling": {"init_scale": 2.0**10}},
     {"precision": "fp16", "microbatches": 2, "loss_scaling": {"init_scale": 2.0**10}}),
])
def test_trainers_arguments_become_harmonys_options(tmp_path, changes, harmony_config, expected):
    trainer = HarmonyTrainer(model=gpt2(0.0), args=arguments(tmp_path, **changes), train_dataset=dataset(8, 1),
                             harmony_config=harmony_config)
    options = trainer._options()
    assert {k: getattr(options, k) for k in expected} == expected
    rows = 4 * (changes.get("gradient_accumulation_steps") or 2)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (rows, 1)
    assert not trainer.args.fp16 and trainer.accelerator.scaler is None     # Harmony scales fp16's loss itself


@pytest.mark.slow
def test_an_fp16_step_skipped_for_overflow_leaves_the_learning_rate(tmp_path):
    """Harmony skips the steps whose gradients overflow at a loss scale of 2**20 and lowers the scale; Trainer's
    scheduler steps only after the step that was taken, as it does after GradScaler."""
    trainer = make(HarmonyTrainer, tmp_path, dropout=0.0, max_steps=4, fp16=True, warmup_steps=0,
                   harmony_config={"loss_scaling": {"init_scale": 2.0**20}})
    trainer.train()
    logs = logged(trainer)
    skipped = trainer.sm.stats["skipped_steps"]
    assert 0 < skipped < 3 and trainer.sm.program.config.precision == "fp16"
    lrs = [logs[s]["learning_rate"] for s in sorted(logs)]
    assert lrs[:skipped + 1] == [1e-3] * (skipped + 1) and lrs[skipped + 1] < 1e-3, lrs
    trainer.end()


@pytest.mark.slow
def test_a_batch_longer_than_the_loaders_first_is_refused_saying_to_give_example_batch(tmp_path):
    """Dynamic padding: compiled with the first batch (8 rows of 8 tokens), the next (16 tokens) is an InputError
    before anything changes, whose note names example_batch=."""
    rows = [{"input_ids": r[:8] if i < 8 else r} for i, r in enumerate(torch.randint(0, VOCAB, (16, SEQ)))]

    def pad(samples):
        ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
        return {"input_ids": ids, "labels": ids}

    args = arguments(tmp_path, max_steps=2, train_sampling_strategy="sequential")
    trainer = HarmonyTrainer(model=gpt2(0.0), args=args, train_dataset=rows, data_collator=pad,
                             harmony_config={"memory_budget": BUDGET})
    with pytest.raises(InputError, match="larger than the compiled example batch") as e:
        trainer.train()
    assert any("example_batch=" in note for note in e.value.__notes__)
    assert trainer.sm.steps == 1 and trainer.state.global_step == 1
    trainer.end()


def test_a_checkpoint_without_harmonys_state_is_refused(tmp_path):
    trainer = HarmonyTrainer(model=gpt2(0.0), args=arguments(tmp_path), train_dataset=dataset(8, 1))
    plain = tmp_path / "checkpoint-2"       # as a plain Trainer (or save_only_model=True) leaves it
    plain.mkdir()
    with pytest.raises(CheckpointError, match="not saved by HarmonyTrainer"):
        trainer.train(resume_from_checkpoint=str(plain))
    assert trainer.sm is None       # nothing was compiled


def _accuracy(p) -> dict:
    """Next-token accuracy over the labels that count (``compute_metrics``)."""
    guess, labels = p.predictions[:, :-1].argmax(-1), p.label_ids[:, 1:]
    return {"accuracy": float((guess == labels)[labels != -100].mean())}


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_predict_and_compute_metrics_run_the_trained_model_in_eval_mode(tmp_path, tier):
    """The logits are the trained model's in eval mode (dropout off) to the bit, whether Harmony keeps the weights
    on the host or in files (read back with sm.sync_model()), and training goes on after as before."""
    kw = {"weights_on": "disk", "optimizer_on": "host", "offload_dir": str(tmp_path)} if tier == "disk" else {}
    clip = 0.0 if tier == "disk" else 0.5       # (a pack wholly on disk steps before the global norm is known)
    trainer = HarmonyTrainer(model=gpt2(0.1), args=arguments(tmp_path, max_steps=2, max_grad_norm=clip),
                             train_dataset=dataset(32, 1),
                             eval_dataset=dataset(8, 2), compute_metrics=_accuracy,
                             harmony_config={"memory_budget": BUDGET, **kw})
    trainer.train()
    assert (set(trainer.sm.plan.by_pack("master_on").values()) == {"disk"}) == (tier == "disk")
    trained = {n: t.clone() for n, t in trainer.sm.state_dict().items()}
    reference = gpt2(0.1)
    reference.load_state_dict(trained)
    reference.eval()
    rows = dataset(8, 2)
    with torch.no_grad():
        logits = reference(input_ids=torch.stack([r["input_ids"] for r in rows])).logits
    out = trainer.predict(rows)
    assert torch.equal(torch.from_numpy(out.predictions), logits)
    assert out.metrics["test_accuracy"] == _accuracy(out)["accuracy"]
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] == out.metrics["test_accuracy"] and metrics["eval_loss"] == out.metrics["test_loss"]
    rows = dataset(8, 3)
    trainer.sm.train()
    loss = trainer.sm({k: torch.stack([r[k] for r in rows]) for k in rows[0]})    # and training goes on
    assert trainer.sm.steps == 3 and torch.isfinite(loss)
    trainer.end()


def test_import_harmony_loads_no_transformers():
    import subprocess
    import sys

    code = "import harmony, harmony.integrations, sys; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def _two_ranks(rank, world, out):
    """One rank of a torchrun job (the process group is the test's; the environment is what torchrun sets): 4 steps
    with dropout, evaluated and saved every 2; then the same trainer resumed from checkpoint-2 (harmony.load into
    the module that trained on to step 4, so whatever it did not restore would show)."""
    import hashlib

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    trainer = make(HarmonyTrainer, out, train_rows=24, max_steps=4, eval_strategy="steps", eval_steps=2,
                   save_strategy="steps", save_steps=2)
    runs = {}
    for name, resume in (("full", None), ("resumed", os.path.join(out, "checkpoint-2"))):
        trainer.train(resume_from_checkpoint=resume)
        cfg = trainer.sm.program.config
        runs[name] = dict(digest=hashlib.sha256(b"".join(t.numpy().tobytes() for t in weights(trainer).values()))
                          .hexdigest(), logs=logged(trainer), steps=trainer.sm.steps,
                          evals={s: e["eval_loss"] for s, e in logged(trainer, "eval_loss").items()},
                          example=trainer.example_batch["input_ids"].tolist(), world=cfg.world_size,
                          dp=cfg.data_parallel, mode=str(trainer.args.parallel_mode))
    rows = dataset(8, 2)
    predicted = trainer.predict(rows).predictions          # each rank its share, gathered on every rank
    reference = gpt2(0.1)
    reference.load_state_dict(weights(trainer))
    reference.eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.stack([r["input_ids"] for r in rows])).logits.numpy()
    runs["predicted"] = sorted(row.tobytes() for row in predicted) == sorted(row.tobytes() for row in logits)
    trainer.sm.close()
    return runs


@pytest.mark.slow
def test_two_ranks_train_data_parallel_and_resume_bitwise(tmp_path):
    from test_collectives import spawn_ok

    res = spawn_ok(2, _two_ranks, str(tmp_path))
    for rank in (0, 1):
        full, resumed = res[rank]["full"], res[rank]["resumed"]
        assert (full["world"], full["dp"], full["mode"]) == (2, True, "ParallelMode.DISTRIBUTED")
        assert full["steps"] == resumed["steps"] == 4
        assert full["digest"] == resumed["digest"] == res[0]["full"]["digest"]     # every rank, both runs
        assert full["logs"] == resumed["logs"] and sorted(full["logs"]) == [1, 2, 3, 4]
        assert full["evals"] == resumed["evals"] and sorted(full["evals"]) == [2, 4]
    assert res[0]["full"]["example"] != res[1]["full"]["example"]        # each rank its own share of the data
    assert res[0]["predicted"] and res[1]["predicted"]       # predict(): the trained model's logits, every row
    assert (tmp_path / "checkpoint-2" / "harmony" / "manifest.json").exists()
