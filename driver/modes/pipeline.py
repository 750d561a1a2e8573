"""``parallel="pipeline"`` from the user's side: the world it plans for, the state each rank keeps, what it holds.

Under ``torchrun --nproc_per_node N train.py`` every rank calls ``harmony.compile(model, batch,
parallel="pipeline", ...)`` with the same model and the whole batch; the stage pass (passes/stage.py) places
the packs across the ranks and each rank keeps only its packs' weights and optimizer state: the other
parameters of the model hold placeholders on that rank (its forward and ``state_dict`` refuse, as under
``weights_on="disk"``), so the node holds one copy of the training state in all.
"""
from __future__ import annotations

import torch

from harmony.base.errors import ConfigError, HarmonyError
from harmony.compiler.passmanager import run_passes, split_choices
from harmony.driver.modes.base import Mode
from harmony.driver.modes.pipeline_plan import choose_group, simulate_rank_node
from harmony.passes import compress
from harmony.passes.stage import check_config
from harmony.runtime.comm.tied import tied_stats
from harmony.runtime.placeholders import is_placeholder, withhold


def local_tensors(plan, tensors: dict) -> dict:
    """This rank's packs' parameters and buffers; every other one of the model holds a placeholder here."""
    mine = {n for s in plan.packs for n in s.params + s.buffers}
    with torch.no_grad():
        for n, t in tensors.items():
            if n not in mine:
                withhold(t)
    return {n: t for n, t in tensors.items() if n in mine}


def state_bytes(sm) -> dict:
    """Bytes of training state this rank holds between steps: its weights and buffers (host masters or device
    copies, each storage once) and its optimizers' state. Summed over the ranks: one copy of the model's."""
    seen: set = set()

    def size(t) -> int:
        if not isinstance(t, torch.Tensor) or is_placeholder(t) or t.device.type == "meta":
            return 0
        s = t.untyped_storage()
        if s.data_ptr() in seen or not s.nbytes():
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()
    state = sm.runtime.state
    weights = sum(size(t.data) for t in state.tensors.values())
    optim = sum(size(v) for opt in sm.optimizers for st in opt.state.values() for v in st.values())
    return dict(state_weight_bytes=weights, state_optim_bytes=optim)


def run_pipeline_passes(program, passes):
    """``run_passes`` for a pipeline rank: ``pipeline_group="auto"`` chosen first (driver/modes/pipeline_plan.py); a
    rank that fails tells the others where they wait for it (the stage pass's agreement on the plan, or the meeting once
    every rank has compiled), so none waits for its timeout."""
    try:
        if program.config.pipeline_group == "auto":
            program.config.pipeline_group, program.config.group_predicted = choose_group(program, passes)
        program = run_passes(program, passes)
    except HarmonyError as e:
        if not getattr(e, "harmony_echo", False):     # (a check that heard another rank's failure met every rank)
            compress.report_failure(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        raise
    compress.check_same_plan("compiled")
    return program


class Pipeline(Mode):
    """``parallel="pipeline"``: this rank's packs of a pipeline over the node's ranks."""

    name = "pipeline"
    adds = (("stage", "partition"), ("tied", "compress"))

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        return options.parallel == "pipeline"

    def resolve(self, options, world: dict) -> dict:
        """Its world, not data parallel, the stage pass after the partition."""
        if options.data_parallel:
            raise ConfigError("parallel='pipeline' with data_parallel=True is not supported yet: use "
                              "data_parallel=None, or parallel=None for data parallelism")
        return dict(super().resolve(options, world), data_parallel=False)

    def check(self, cfg, options) -> None:
        check_config(cfg)

    def run_passes(self, program, passes):
        if "stage" not in split_choices(passes)[0]:     # cut short before the stage pass: nothing to meet for
            return super().run_passes(program, passes)
        return run_pipeline_passes(program, passes)

    def local_tensors(self, plan, tensors: dict) -> dict:
        return tensors if plan.stage is None else local_tensors(plan, tensors)

    def checkpoint_layout(self, plan) -> str:
        return "whole" if plan.stage is None else "pipeline"     # each rank its packs' state

    def ranks_meet(self, cfg, plan) -> bool:
        return plan.stage is not None and (cfg.world_size or 1) > 1

    def guards_model(self, plan) -> bool:
        return plan.stage is not None

    def step_stats(self, sm) -> dict:
        return dict(state_bytes(sm), **tied_stats(sm.runtime)) if sm.plan.stage is not None else {}

    def simulate(self, sm, hardware):
        if sm.plan.stage is None:
            return None
        return simulate_rank_node(sm, hardware)  # the whole node, a row per device
