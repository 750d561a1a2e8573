"""Parallel modes as objects (driver/modes/): a mode added in one place is picked up by the driver, the pass
pipeline and the report, and the built-in modes are chosen as the options say."""
from __future__ import annotations

import logging
import sys
import types

import pytest

import harmony
from harmony.compiler.ir import PassReport, PassResult
from harmony.driver import modes
from harmony.driver.modes.base import Mode
from models import CASES, training_state_bytes


def _toy_pass() -> types.ModuleType:
    """A pass that only counts the schedule's ops, loaded by name as ``harmony.passes.toy`` would be."""
    toy = types.ModuleType("harmony.passes.toy")
    toy.NAME, toy.REQUIRES, toy.PROVIDES = "toy", {"schedule"}, {"toy"}

    def run(program, choice):
        ops = sum(n.op == "call_function" for n in program.schedule.nodes)
        return PassResult(program, PassReport("toy: ops counted", totals={"schedule_ops": ops}))
    toy.run = run
    return toy


class Toy(Mode):
    """One process, with the toy pass after the schedule pass and a report section of its own."""

    name = "toy"
    adds = (("toy", "schedule"),)

    @classmethod
    def applies(cls, options, world):
        return not world["data_parallel"] and options.parallel is None

    def report(self, program):
        return PassReport("toy mode: one process", totals={"packs": len(program.plan.packs)})

    def step_stats(self, sm):
        return {"toy_steps": sm.steps}


def test_a_mode_added_in_one_module_is_picked_up_by_the_driver_a_pass_and_the_report(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "harmony.passes.toy", _toy_pass())
    monkeypatch.setattr(modes, "MODES", list(modes.MODES))
    modes.register(Toy)
    model, data = CASES["gpt"]()
    with caplog.at_level(logging.INFO, logger="harmony"):
        sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=2)
    assert isinstance(sm.mode, Toy)
    names = [h[0] for h in sm.history]
    assert names[names.index("schedule") + 1] == "toy"             # declared by the mode, placed by it
    report = sm.report()
    assert report.index("toy mode: one process") < report.index("toy: ops counted")   # the mode's section first
    sm(*data[0])
    assert sm.stats["toy_steps"] == 1
    assert "compiling GPT as toy" in caplog.text and "pass toy: toy: ops counted" in caplog.text
    sm.close()


@pytest.mark.parametrize("options, world, mode", [
    ({}, dict(data_parallel=False), "Mode"),
    ({}, dict(data_parallel=True, world_size=2), "DataParallel"),
    ({"shard_state": True}, dict(data_parallel=True, world_size=2), "ShardedOptimizer"),
    ({"shard_state": "full"}, dict(data_parallel=True, world_size=2), "Partitioned"),
    ({"parallel": "pipeline"}, dict(data_parallel=True, world_size=2), "Pipeline"),
])
def test_the_built_in_modes_are_chosen_as_the_options_say(options, world, mode):
    cfg = harmony.Config(**options)
    assert type(modes.of(cfg, world)).__name__ == mode


def test_each_mode_declares_its_passes_where_they_go():
    from harmony.compiler.passmanager import DEFAULT_PIPELINE
    from harmony.driver.modes.data import Partitioned
    from harmony.driver.modes.pipeline import Pipeline
    assert Pipeline().passes(DEFAULT_PIPELINE)[1] == "stage"
    assert Pipeline().passes(("partition", "stage", "schedule")) == ("partition", "stage", "schedule")
    assert Partitioned().passes(DEFAULT_PIPELINE)[-1] == "shard"
    assert Partitioned().passes(("partition", "schedule")) == ("partition", "schedule")   # nothing to rewrite
    assert Mode().passes(DEFAULT_PIPELINE) == DEFAULT_PIPELINE
