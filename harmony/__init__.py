"""Harmony: train models bigger than your hardware comfortably holds.

>>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="512MiB", microbatches=8)
>>> loss = sm(x, y)
>>> print(sm.report())
"""
from harmony.base.process import ask_for_huge_pages, ask_idle_threads_to_sleep

ask_for_huge_pages()          # before this process's first tensor, if it is still to come
ask_idle_threads_to_sleep()   # before torch loads OpenMP, if it is still to come

from harmony import errors  # noqa: E402
from harmony.api import ScheduledModule, compile
from harmony.compiler.config import (
    Config,
    DiskConfig,
    MemoryConfig,
    NumericsConfig,
    ParallelConfig,
    PlanConfig,
    TrainConfig,
)
from harmony.compiler.hardware import Device, Hardware
from harmony.compiler.loss_weighting import LossConfig
from harmony.driver.checkpoint import load, save
from harmony.driver.materialize import empty_weights, from_state_dict, materialize

__all__ = ["compile", "ScheduledModule", "Config", "TrainConfig", "LossConfig", "MemoryConfig", "DiskConfig",
           "ParallelConfig", "NumericsConfig", "PlanConfig", "Hardware", "Device", "errors", "save", "load",
           "empty_weights", "from_state_dict", "materialize"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "viz":   # drawings and reports load on first use
        import harmony.viz as viz
        return viz
    raise AttributeError(f"module 'harmony' has no attribute {name!r}")
