"""``harmony.compile``: an ordinary ``nn.Module`` in, a ``ScheduledModule`` that trains it under a budget out.

The face: the options are checked here and handed to the compile driver (driver/compile.py), and every
method of ``ScheduledModule`` delegates to the driver in a few lines.
"""
from __future__ import annotations

import torch

from harmony.base.errors import ConfigError
from harmony.compiler.config import Config
from harmony.compiler.hardware import Hardware
from harmony.compiler.ir import Program
from harmony.compiler.printer import schedule_code
from harmony.compiler.verify import state_sizes
from harmony.driver import checkpoint
from harmony.driver import compile as driver
from harmony.driver.assemble import assemble
from harmony.driver.evaluate import evaluate
from harmony.driver.guard import Guard, guarded
from harmony.driver.guard import close as close_module
from harmony.driver.handshake import CALLS, agree
from harmony.driver.step import accept_partial_step, train_step
from harmony.driver.usermodel import sync_model
from harmony.runtime.simulate import simulate


def compile(model: torch.nn.Module, example_batch, *, memory_budget=None, microbatches: int | None = None,
            optimizer: type | None = None, config: Config | None = None, **options) -> "ScheduledModule":
    """Plan and build a training step for ``model`` that fits ``memory_budget`` per device.

    >>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="512MiB", microbatches=8)
    >>> loss = sm(x, y)          # forward, backward and optimizer update of one whole batch

    ``example_batch``: one batch as the model's forward takes it (a tensor, a tuple, or a dict or any Mapping such
    as a Hugging Face ``BatchEncoding``, of tensors whose dimension 0 is the batch): the largest batch it will take,
    since ``sm`` trains and evaluates every batch up to its shapes (fewer rows, shorter sequences) with the plan made
    for it, and refuses a larger one. Its items that are not tensors (``use_cache=False``, an int, None) are
    constants of the trace (driver/constants.py). ``memory_budget``: bytes per device, an int or a string such as
    ``"512MiB"`` (default 1 GiB). ``microbatches``: how many the batch is cut
    into, a divisor of its size (default 1). ``optimizer``: a ``torch.optim.Optimizer`` class (default AdamW).

    Every other option is a field of ``harmony.Config``, documented in its groups (harmony/compiler/config.py):
    ``TrainConfig`` (optimizer_kwargs, loss_fn), ``LossConfig`` (loss_weighting), ``MemoryConfig``
    (host_memory_budget, optimizer_on, weights_on, recompute), ``DiskConfig`` (offload_dir, ...), ``ParallelConfig``
    (data_parallel, compression, balance, shard_state, ...), ``NumericsConfig`` (precision, loss_scaling) and
    ``PlanConfig`` (policy, passes, device,
    hardware, ...). Give them as keywords, ``harmony.compile(model, batch, precision="bf16")``, or as one object,
    ``config=harmony.Config(precision="bf16")``; keywords given beside ``config`` replace its fields. A bad value
    is a ``ConfigError`` naming it.
    """
    given = dict(memory_budget=memory_budget, microbatches=microbatches, optimizer=optimizer)
    options = Config.of(config, **{k: v for k, v in given.items() if v is not None}, **options)
    return driver.compile(model, example_batch, options, ScheduledModule)


class ScheduledModule(torch.nn.Module):
    """A compiled training step: ``sm(*batch)`` runs forward, backward and the optimizer update.

    ``.code`` is the schedule as Python, ``.report()`` what every pass did, ``.history``
    the schedule after each pass, ``.stats`` the last step's measured memory and traffic.

    One call at a time: a step, an evaluation, a checkpoint or a state dict called from another thread while one
    runs waits for it to end (driver/guard.py); after ``close()`` each raises ``ClosedError``.
    """

    def __init__(self, program: Program, device="cpu"):
        super().__init__()
        self.guard = Guard()
        assemble(self, program, device)    # runtime, tiers, optimizers, shapes (driver/assemble.py)

    @property
    def code(self) -> str:
        return schedule_code(self.program)

    @property
    def graph(self):
        return self.program.schedule

    @property
    def history(self):
        return self.program.history

    @property
    def plan(self):
        return self.program.plan

    @property
    def optimizer_kwargs(self) -> dict:
        """The arguments every optimizer was built with (``fused=True`` added where torch has it: runtime/optim.py)."""
        return dict(self.program.config.optimizer_kwargs)

    def train(self, mode: bool = True) -> "ScheduledModule":
        """``sm.eval()`` / ``sm.train()``: in eval mode ``sm(...)`` evaluates (``evaluate``). Only this module's
        flag changes: the model passed to compile keeps its own modes (a step runs it in training mode)."""
        self.training = bool(mode)
        return self

    @guarded("sm.evaluate(...)")
    def evaluate(self, *batch, **named) -> torch.Tensor:
        """The batch's loss as ``model.eval()`` under ``torch.no_grad()`` computes it, forward only, within the same
        memory budget, on the weights as training left them; the mean over microbatches, in fp32. Takes the batch
        as ``sm(...)`` does. No gradient, step, buffer update or RNG draw that training would see; an error is
        rolled back. The evaluation schedule is built on the first call and kept (driver/evaluate.py)."""
        return evaluate(self, batch, named)

    @guarded("sm(...)")
    def forward(self, *batch, **named):
        """One training step on the batch (``sm(x, y)``, ``sm(**batch)``, or ``sm(batch)`` for a dict or Mapping);
        it evaluates instead (``evaluate``) in eval mode (``sm.eval()``) or where gradients are off
        (``torch.no_grad()``, ``torch.inference_mode()``)."""
        driver.refuse_under_torch_compile()        # torch.compile(sm): the model goes in compiled instead
        if not self.training or not torch.is_grad_enabled():
            return self.evaluate(*batch, **named)
        return train_step(self, batch, named)     # one step as a transaction (driver/step.py)

    def compile(self, *args, **kwargs):
        """Refused (``ConfigError``): compile the model instead, ``harmony.compile(torch.compile(model), ...)``."""
        driver.refuse_torch_compile("sm.compile()")

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale the next step multiplies the loss by; None without loss scaling."""
        scaler = getattr(self.runtime, "scaler", None)
        return None if scaler is None else scaler.scale.item()

    def simulate(self, hardware=None, device: int = 0):
        """One step simulated on ``hardware``: a ``Hardware``, a preset name, or None (this machine under the
        budget, at the speed factor the module was compiled for). A pipeline rank simulates its whole node
        (its mode's ``simulate``): a ``NodeSimulation`` with a row per device."""
        if self.predicted is None:
            raise ConfigError("this module has no schedule to simulate; compile with the default passes")
        node = self.mode.simulate(self, hardware)     # a pipeline rank: its whole node, a row per device
        if node is not None:
            return node
        if hardware is None or isinstance(hardware, str):
            cfg = self.program.config
            hardware = Hardware.preset(hardware) if hardware else \
                Hardware.this_machine(cache_dir=cfg.cache_dir).logical([cfg.memory_budget], [cfg.speed_factor],
                                                                       cfg.link_bandwidth or None)
        return simulate(self.graph, self.plan, hardware, device, memory=self.predicted,
                        sizes=state_sizes(self.program))

    @guarded("sm.state_dict()", reads=True)
    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The model's parameters and buffers by its names, as ``model.state_dict()``, read wherever they live."""
        return checkpoint.module_state_dict(self, destination, prefix, keep_vars)

    @guarded("sm.load_state_dict()")
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Set the model's weights from ``state_dict`` (the model's names) wherever they live; optimizer state stays."""
        return checkpoint.load_module_state_dict(self, state_dict, strict, assign)

    @guarded("sm.training_state_dict()", reads=True)
    def training_state_dict(self) -> dict:
        """The training state (weights, optimizer state, hyperparameters, step, RNG), referencing live tensors."""
        return checkpoint.training_state_dict(self)

    @guarded("sm.load_training_state_dict()")
    def load_training_state_dict(self, state: dict) -> None:
        """Restore ``training_state_dict()``'s state in place; a mismatch raises ``CheckpointError``."""
        checkpoint.load_training_state_dict(self, state)

    def report(self, fmt: str = "text") -> str:
        from harmony.viz.report import render  # deferred: harmony.viz loads on first use (harmony/__init__.py)
        return render(self, fmt)

    def add_scheduler(self, scheduler):
        """Register a scheduler built on ``sm.optimizer`` (``torch.optim.lr_scheduler``): ``harmony.save`` and
        ``harmony.load`` keep its state with the module's. Returns it."""
        if getattr(scheduler, "optimizer", None) is not self.optimizer:
            raise ConfigError(f"{type(scheduler).__name__} is not built on this module's optimizer: make it with "
                              f"sm.optimizer, e.g. torch.optim.lr_scheduler.LambdaLR(sm.optimizer, f)")
        self.schedulers.append(scheduler)
        return scheduler

    @guarded("sm.sync_model()")
    def sync_model(self) -> list[str]:
        """Read the weights that live elsewhere between steps (on disk, in other ranks' shares under
        ``shard_state="full"``, on other pipeline ranks) into the model passed to compile, whose forward and
        state_dict refuse until then (driver/usermodel.py); returns their names. Every rank calls it."""
        if getattr(getattr(self.runtime, "state", None), "shares", None) is not None \
                or getattr(self.plan, "stage", None) is not None:     # it gathers from every rank
            agree(self, CALLS[3])
        return sync_model(self)

    @guarded("sm.accept_partial_step()")
    def accept_partial_step(self) -> dict | None:
        """After a step that failed once some packs had stepped (``TornStepError``): train on with those updates
        kept. Returns {"stepped": packs, "not_stepped": packs, "params": names}, or None if there was none."""
        return accept_partial_step(self)

    def close(self):
        """Release the runtime (its threads, pinned buffers, offload files) once a call running in another thread
        has ended; every later step, evaluation, checkpoint or state dict raises ``ClosedError``."""
        close_module(self)
