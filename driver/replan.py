"""Planning again from a compiled program's trace: another rank's plan, another candidate's.

The trace, its fake run, the optimizer's profile and the table of measured packs are the same for every rank
and candidate, so a program planned under another ``CompileConfig`` reuses them and only its passes run.
"""
from __future__ import annotations

from harmony.compiler.ir import Program


def another_rank(program, config):
    """A program to plan under ``config`` (another rank's) from ``program``'s trace, its fake run, its optimizer's
    profile and its table of measured packs (a pack measures the same on every rank: measured once)."""
    other = Program(model=program.model, gm=program.gm, example_batch=program.example_batch, config=config,
                    batch_keys=program.batch_keys)
    other.fake, other.optim_profile = program.fake, program.optim_profile
    other.pack_measurements = program.pack_measurements
    return other
