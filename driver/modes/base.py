"""``Mode``: what the driver asks a parallel mode, answered for one process (driver/modes/__init__.py lists the
modes)."""
from __future__ import annotations

from harmony.base.errors import ConfigError
from harmony.compiler.hardware import Hardware
from harmony.compiler.passmanager import run_passes, split_choices
from harmony.driver import mixed_steps


class Mode:
    """The one-process mode, and what every mode does unless it says otherwise."""

    name = "one process"
    adds: tuple = ()        # (pass name, the pass it comes after): the passes this mode declares

    def __init__(self, options=None):
        self.options = options

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        """Whether a compile with ``options`` in ``world`` (runtime/comm/world.py ``resolve``) is this mode's."""
        return True

    def resolve(self, options, world: dict) -> dict:
        """The ``CompileConfig`` fields this mode sets for this rank: its world, its pass list."""
        return dict(data_parallel=world["data_parallel"], world_size=world.get("world_size"),
                    rank=world.get("rank", 0), passes=self.passes(options.passes))

    def passes(self, entries) -> tuple:
        """``entries`` (``passes=``) with this mode's passes, each after the pass it follows, where not given."""
        entries = tuple(entries)
        for name, after in self.adds:
            names = split_choices(entries)[0]
            if name not in names and after in names:
                at = names.index(after) + 1
                entries = entries[:at] + (name,) + entries[at:]
        return entries

    def check(self, cfg, options) -> None:
        """Refuse, by name and with what to use instead, what this mode does not do."""
        if cfg.shard_state:
            raise ConfigError(f"shard_state={cfg.shard_state!r} splits training state over data-parallel ranks, "
                              f"but this process trains alone: run it under torchrun with data_parallel=None or "
                              f"True, or drop shard_state")

    def plan_rank(self, model, gm, batch, cfg):
        """Set ``cfg`` to what this rank plans for (its device, its share); a ``Balanced`` where the batch is split
        unevenly (its rows and report), else None."""
        if cfg.hardware is not None:
            cfg.hardware = Hardware.of(cfg.hardware).computing_in(cfg.precision, cfg.accounting)
            cfg.plan_for_device(cfg.hardware.devices[0], cfg.hardware)
        return None

    def run_passes(self, program, passes):
        """The pass pipeline for this rank (bf16's device steps weighed first where compile chooses them)."""
        if mixed_steps.wanted(program.config):
            program.config.device_steps, program.config.steps_predicted = mixed_steps.choose(program, passes)
        return run_passes(program, passes)

    def local_tensors(self, plan, tensors: dict) -> dict:
        """The model's parameters and buffers this rank keeps (by name)."""
        return tensors

    def shares(self, plan, tensors: dict, cfg, fill=None):
        """This rank's partitioned state (runtime/partitioned/ ``Shares``), or None."""
        return None

    def guards_model(self, plan) -> bool:
        """Whether the user's model refuses to be read (forward, state_dict) while this mode holds its weights
        elsewhere (other ranks' stages); partitioned shares and weights on disk guard it whatever the mode."""
        return False

    def step_stats(self, sm) -> dict:
        """What this mode adds to ``sm.stats`` after a step."""
        return {}

    def simulate(self, sm, hardware):
        """``sm.simulate(hardware)`` where this mode simulates otherwise than one device; None: one device."""
        return None

    def checkpoint_layout(self, plan) -> str:
        """How this rank's checkpoint holds the state (driver/checkpoint/ranks.py ``MODES``): the whole state."""
        return "whole"

    def saves_state(self, plan) -> bool:
        """Whether this rank writes its state into a checkpoint (not where another rank holds the same and writes
        it: a grid's replicas); its directory holds its RNG and manifest either way."""
        return True

    def ranks_meet(self, cfg, plan) -> bool:
        """Whether this module's ranks make collective calls together (a step, a save, a load), so each such call
        starts with the ranks agreeing on it (driver/handshake.py)."""
        return False

    def report(self, program):
        """A ``PassReport`` this mode puts first in the report, or None."""
        return None
