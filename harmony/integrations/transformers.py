"""``HarmonyTrainer``: Hugging Face's ``transformers.Trainer``, each optimizer step run by a ``harmony.compile`` module.

>>> trainer = HarmonyTrainer(model=model, args=TrainingArguments("out", bf16=True, lr_scheduler_type="cosine"),
...                          train_dataset=train, eval_dataset=val,
...                          harmony_config=harmony.Config(memory_budget="2GiB"))
>>> trainer.train()                      # and trainer.train(resume_from_checkpoint=True) after a stop

Trainer keeps its loop (data, sharding under torchrun, callbacks, logging, evaluation and checkpoint schedules);
the model is compiled at the first step (or evaluation) and every place Trainer would run the model, clip, step
the optimizer or save its state goes through the compiled module instead (docs/trainer.md has the table). Needs
``transformers`` 5 and ``accelerate`` (``pip install -e ".[trainer]"``); ``import harmony`` never loads them.
"""
from __future__ import annotations

import copy
import os

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME

from harmony.api import compile as harmony_compile
from harmony.base.errors import CheckpointError, ConfigError, InputError
from harmony.compiler.config import Config
from harmony.driver.checkpoint import load, save
from harmony.integrations.pretrained import save_pretrained

STATE_DIR = "harmony"       # Harmony's training state, inside each of Trainer's checkpoint-N folders

# TrainingArguments Harmony cannot honour: (field, is it set, why, what to do instead)
_REFUSED = [
    ("torch_compile", bool, "Harmony runs the step itself (a schedule dynamo cannot capture)", "leave it off"),
    ("gradient_checkpointing", bool, "Harmony plans recompute itself", "leave it off; harmony_config's "
     "recompute= chooses (docs/memory.md)"),
    ("activation_checkpointing", bool, "Harmony plans recompute itself", "leave it off; harmony_config's "
     "recompute= chooses (docs/memory.md)"),
    ("bf16_full_eval", bool, "evaluation runs on the trained weights as Harmony keeps them", "leave it off"),
    ("fp16_full_eval", bool, "evaluation runs on the trained weights as Harmony keeps them", "leave it off"),
    ("deepspeed", bool, "Harmony places and shards the state itself", "use harmony_config's shard_state="),
    ("fsdp", bool, "Harmony places and shards the state itself", "use harmony_config's shard_state="),
    ("neftune_noise_alpha", lambda v: v is not None, "its hook is not part of the traced model", "leave it unset"),
    ("n_gpu", lambda v: (v or 0) > 1, "one process drives several GPUs (nn.DataParallel)", "start one process per "
     "device with torchrun"),
]
# harmony_config fields Trainer's own arguments set
_FROM_ARGS = {"optimizer_kwargs": "learning_rate, weight_decay, adam_beta1/2, adam_epsilon or optim",
              "param_groups": "Trainer's decay/no-decay groups, or optimizers=(your_optimizer, None)",
              "clip_grad_norm": "max_grad_norm", "clip_norm_type": "max_grad_norm (2-norm)"}


class HarmonyTrainer(Trainer):
    """``transformers.Trainer`` whose steps, evaluation and checkpoints run through ``harmony.compile``.

    Takes Trainer's arguments, and:

    - ``harmony_config``: a ``harmony.Config`` (or a dict of its fields): ``memory_budget``, tiers
      (``host_memory_budget``, ``optimizer_on``, ``weights_on``, ...), ``compression``, ``shard_state``, ...
    - ``example_batch``: the largest batch a step takes (one collated batch of
      ``per_device_train_batch_size x gradient_accumulation_steps`` rows). Default: the training loader's first
      batch, which is right where all batches have one length; with dynamic padding give one padded to the longest.

    From ``TrainingArguments``: the optimizer Trainer builds (``optim``, ``learning_rate``, ``weight_decay``, its
    decay groups) or the one given as ``optimizers=(optimizer, None)``; the scheduler ``lr_scheduler_type`` makes,
    built on ``sm.optimizer``; ``max_grad_norm`` as ``clip_grad_norm``; ``bf16``/``fp16`` as ``precision``;
    ``gradient_accumulation_steps`` as Harmony's microbatches (where ``harmony_config`` gives none): Trainer's loop
    then sees one batch of ``per_device_train_batch_size x gradient_accumulation_steps`` rows per step
    (``trainer.args`` says so) and Harmony cuts it. ``trainer.sm`` is the compiled module once built.

    ``evaluate()`` runs ``sm.evaluate`` (the loss, within the budget); ``compute_metrics`` and ``predict()``, which
    need the model's outputs, run ``trainer.model`` on the trained weights (``sm.sync_model()``), eagerly.
    ``save_model`` and checkpoints write a Hugging Face model pack by pack (``integrations/pretrained.py``).
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *rest, harmony_config=None,
                 example_batch=None, **kwargs):
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        self.precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.harmony_config = _config_of(harmony_config, self.precision)
        _refuse(args, kwargs, rest)
        own = copy.copy(args)     # the user's arguments stay as given; Trainer's loop runs on these
        self.accumulation = args.gradient_accumulation_steps
        own.per_device_train_batch_size = args.per_device_train_batch_size * self.accumulation
        own.gradient_accumulation_steps = 1
        own.fp16 = False          # Harmony scales the loss itself (precision="fp16"); Accelerate's scaler would not
        rows = own.per_device_train_batch_size if example_batch is None else _rows(example_batch)
        if args.per_device_eval_batch_size > rows:
            raise ConfigError(f"per_device_eval_batch_size={args.per_device_eval_batch_size} is more rows than a "
                              f"training step's {rows}: Harmony evaluates batches up to the compiled one; set "
                              f"per_device_eval_batch_size<={rows}")
        if self.harmony_config.precision not in ("fp32", self.precision):
            raise ConfigError(f"harmony_config precision={self.harmony_config.precision!r} but TrainingArguments ask "
                              f"for {self.precision}: set bf16=True or fp16=True in TrainingArguments instead")
        self.sm = None
        self.example_batch = example_batch
        self._first_batch = example_batch is None      # the example is the loader's first batch
        self._window: dict = {}
        super().__init__(model, own, *rest, **kwargs)

    # -- the compiled module -------------------------------------------------------------------------------------
    def harmony_module(self):
        """The compiled module (``trainer.sm``), compiled on first use with Trainer's optimizer and the example."""
        if self.sm is None:
            optimizer = super().create_optimizer(self.model)      # Trainer's, or the one given in optimizers=
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(f"HarmonyTrainer needs a torch.optim.Optimizer to compile with, got "
                                  f"{type(optimizer).__name__}: choose another TrainingArguments(optim=...)")
            options = self._options()
            self.sm = harmony_compile(self.model, self._example(), optimizer=optimizer, config=options)
            self.optimizer = self.sm.optimizer        # Trainer's lr scheduler and logging read this one
        return self.sm

    def _options(self) -> Config:
        cfg, args, given = self.harmony_config, self.args, self.precision
        fields = dict(precision=given, clip_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
                      microbatches=cfg.microbatches if cfg.microbatches > 1 else self.accumulation)
        if cfg.device == "cpu" and args.device.type != "cpu":
            fields["device"] = str(args.device)
        return Config.of(cfg, **fields)

    def _example(self):
        if self.example_batch is None:
            with torch.random.fork_rng(devices=[]):     # the loader's first batch, leaving the RNG as it was
                self.example_batch = next(iter(self.get_train_dataloader()))
        return self.example_batch

    # -- Trainer's extension points ------------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        """Harmony places the weights (on the host, streamed to the device), not Trainer."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.harmony_module()       # no DDP wrapper: Harmony all-reduces the gradients itself

    def create_optimizer(self, model=None):
        self.optimizer = self.harmony_module().optimizer     # Trainer wraps this one (Accelerate) on each train()
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        sm = self.harmony_module()
        stale = self.lr_scheduler is None and [s for s in sm.schedulers if getattr(s, "_harmony_trainer", False)]
        for s in stale or ():       # a second train(): Trainer builds its scheduler again
            sm.schedulers.remove(s)
        scheduler = super().create_scheduler(num_training_steps, optimizer=sm.optimizer)
        if scheduler not in sm.schedulers:
            scheduler._harmony_trainer = True
            sm.add_scheduler(scheduler)      # harmony.save and harmony.load keep its state
        return scheduler

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One optimizer step: Harmony's forward, backward and update of the whole batch (its own microbatches;
        Trainer's ``num_items_in_batch`` is not needed: Harmony counts the batch's label tokens itself)."""
        sm = self.harmony_module()
        sm.train()
        scale = sm.loss_scale
        try:
            loss = sm(inputs)
        except InputError as e:
            if self._first_batch:
                e.add_note("HarmonyTrainer compiled with the training loader's first batch as the example: where a "
                           "later batch is longer, pass example_batch= one padded to the longest (docs/trainer.md)")
            raise
        stats, w = sm.stats, self._window
        if scale is not None:     # fp16: a step skipped for inf/nan gradients (its scale lowered) leaves the lr
            # where it was, as Trainer does when GradScaler skips one (Trainer reads Accelerate's flag, as Accelerate)
            self.optimizer._is_overflow = sm.loss_scale < scale
        w["steps"] = w.get("steps", 0) + 1
        w["peak"] = max(w.get("peak", 0), stats["measured_peak"])
        w["h2d"] = w.get("h2d", 0) + stats["h2d_bytes"]
        w["d2h"] = w.get("d2h", 0) + stats["d2h_bytes"]
        return loss.detach().to(self.args.device)

    def _clip_grad_norm(self, model):
        return self.sm.stats.get("grad_norm")      # the norm before clipping, measured in the step

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm     # None without max_grad_norm: Harmony measures the norm where it clips

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop. The model's outputs are wanted (``predict()``, ``compute_metrics``): the trained weights
        are read into ``trainer.model`` first (``sm.sync_model()``, on every rank), which runs them eagerly."""
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        if not loss_only:
            self._trained_model()
        return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The loss alone (``evaluate()`` without ``compute_metrics``): ``sm.evaluate``, within the memory budget.
        With the outputs: Trainer's own step on ``trainer.model`` in eval mode, holding the trained weights."""
        sm = self.harmony_module()
        if prediction_loss_only:
            return sm.evaluate(inputs).detach().to(self.args.device), None, None
        eager = sm.model
        training = eager.training
        eager.eval()
        try:
            return super().prediction_step(eager, inputs, prediction_loss_only, ignore_keys)
        finally:
            eager.train(training)

    def _trained_model(self):
        """``trainer.model`` with the trained weights (until the next step), on the device Trainer's inputs go to."""
        sm = self.harmony_module()
        sm.sync_model()         # weights on disk, or in the ranks' shares, into the model
        where = {p.device for p in sm.model.parameters()} | {b.device for b in sm.model.buffers()}
        if any(not _same_device(d, self.args.device) for d in where):
            raise ConfigError(f"HarmonyTrainer.predict() and compute_metrics run trainer.model with the trained "
                              f"weights, which Harmony keeps on {sorted(str(d) for d in where)}, while Trainer's "
                              f"inputs go to {self.args.device}: evaluate the loss alone (no compute_metrics, "
                              f"trainer.evaluate()), or run the model yourself after trainer.train()")
        return sm.model

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Trainer's logs, and with each training loss Harmony's figures since the last one: the peak bytes it
        measured on the device, its budget, and the bytes a step moved to and from the device."""
        w = self._window
        if "loss" in logs and w.get("steps"):
            logs.update(harmony_peak_bytes=w["peak"], harmony_budget_bytes=self.sm.stats["budget"],
                        harmony_h2d_bytes=w["h2d"] / w["steps"], harmony_d2h_bytes=w["d2h"] / w["steps"])
            w.clear()
        super().log(logs, *args, **kwargs)

    def train(self, *args, **kwargs):
        out = super().train(*args, **kwargs)
        self.sm.sync_model()      # weights kept on disk between steps back into trainer.model (every rank calls)
        return out

    def end(self):
        """At the very end of a script: close ``trainer.sm`` (its threads, its offload files), then Trainer's end
        (trackers, the process group)."""
        if self.sm is not None:
            self.sm.close()
        super().end()

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained weights in ``save_pretrained``'s layout. A Hugging Face model's are written pack by pack from
        where Harmony keeps them (``harmony.integrations.pretrained.save_pretrained``: no process holds the whole
        model), with Trainer's processing class and arguments beside them; another model (a PEFT one: its adapters)
        is saved by Trainer from ``sm.state_dict()``."""
        if self.sm is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if isinstance(self.model, PreTrainedModel):
            save_pretrained(self.sm, output_dir)       # every rank: under shard_state="full" each gathers with rank 0
            if self.args.should_save:
                self._save_beside_model(output_dir)
        else:
            state = self.sm.state_dict()     # every rank: under shard_state="full" it gathers the ranks' shares
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_beside_model(self, output_dir: str) -> None:
        """What Trainer's ``_save`` writes beside the model: the processing class (or the collator's tokenizer)
        and the training arguments."""
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(self.sm, os.path.join(output_dir, STATE_DIR))   # weights, optimizer, schedulers, step, RNG: every rank

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        _harmony_state(resume_from_checkpoint)     # the weights come with it, in _load_optimizer_and_scheduler

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            load(self.harmony_module(), _harmony_state(checkpoint))

    def _load_best_model(self) -> None:
        super()._load_best_model()     # into trainer.model, then from it into the compiled module
        self.sm.load_state_dict(self.model.state_dict())


def _same_device(a: torch.device, b: torch.device) -> bool:
    """One device: "cpu" is "cpu:0" (Trainer's device under torchrun), "cuda:0" is "cuda" where that is device 0."""
    index = (lambda d: 0 if d.index is None else d.index) if a.type != "cpu" else (lambda d: 0)
    return a.type == b.type and index(a) == index(b)


def _rows(batch) -> int:
    """Rows of a batch as compile takes it: a Mapping of tensors, a tuple of them, or one tensor."""
    if hasattr(batch, "values"):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return batch.shape[0]


def _harmony_state(checkpoint: str) -> str:
    path = os.path.join(checkpoint, STATE_DIR)
    if not (os.path.exists(path) or os.path.exists(path + ".old")):
        raise CheckpointError(f"{checkpoint} has no {STATE_DIR}/ folder: it was not saved by HarmonyTrainer, so it "
                              f"holds no optimizer state Harmony can resume from (save_only_model=True leaves it out "
                              f"too). Load its weights with from_pretrained and train from step 0 instead")
    return path


def _config_of(given, precision: str) -> Config:
    if given is None or isinstance(given, Config):
        cfg = given or Config()
    elif isinstance(given, dict):      # TrainingArguments' precision first: loss_scaling= is checked against it
        cfg = Config.of(None, **{"precision": precision, **given})
    else:
        raise ConfigError(f"harmony_config={given!r}: give a harmony.Config or a dict of its fields")
    default = Config()
    for name, instead in _FROM_ARGS.items():
        if getattr(cfg, name) != getattr(default, name):
            raise ConfigError(f"harmony_config {name}= is set by Trainer under HarmonyTrainer: use {instead}")
    if cfg.optimizer is not default.optimizer:
        raise ConfigError("harmony_config optimizer= is Trainer's under HarmonyTrainer: use TrainingArguments(optim=) "
                          "or HarmonyTrainer(optimizers=(your_optimizer, None))")
    if cfg.parallel == "pipeline":
        raise ConfigError("harmony_config parallel='pipeline' is not built for HarmonyTrainer: Trainer gives every "
                          "rank its own share of the data; use data parallel (the default under torchrun)")
    return cfg


def _refuse(args, kwargs: dict, rest: tuple) -> None:
    for name, is_set, why, instead in _REFUSED:
        if is_set(getattr(args, name, None)):
            raise ConfigError(f"TrainingArguments({name}=...) under HarmonyTrainer: {why}; {instead}")
    if rest:
        raise ConfigError("HarmonyTrainer takes Trainer's arguments after model and args by keyword")
    for name, why in (("model_init", "the model is compiled once"),
                      ("compute_loss_func", "Harmony trains on the loss the model returns (or harmony_config "
                       "loss_fn=)")):
        if kwargs.get(name) is not None:
            raise ConfigError(f"HarmonyTrainer({name}=...): {why}")
    if (kwargs.get("optimizers") or (None, None))[1] is not None:
        raise ConfigError("HarmonyTrainer(optimizers=(optimizer, scheduler)): a scheduler built on your optimizer "
                          "cannot drive Harmony's; pass optimizers=(optimizer, None) and lr_scheduler_type=")
