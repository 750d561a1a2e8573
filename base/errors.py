"""Every error Harmony raises on bad input. Each says what went wrong, where, and what to do next."""


class HarmonyError(Exception):
    """Base class of every Harmony error."""


class TraceError(HarmonyError):
    """The model could not be traced into a graph (names the user's source line)."""


class BudgetError(HarmonyError):
    """No plan fits the memory budget. ``min_budget`` is the smallest budget (bytes) that works, if known, for the
    option ``option`` names (``"memory_budget"``, or ``"host_memory_budget"`` where the host's is too small)."""

    def __init__(self, message: str, min_budget: int | None = None, option: str = "memory_budget"):
        super().__init__(message)
        self.min_budget = min_budget
        self.option = option

    def __reduce__(self):          # pickled whole: a balance plan's error travels from rank 0 to every rank
        return type(self), (self.args[0], self.min_budget, self.option)


class ConfigError(HarmonyError):
    """An argument to ``harmony.compile`` is invalid (unknown pass or policy, bad microbatch count, ...)."""


class InputError(HarmonyError):
    """A batch does not match the model or the compiled plan."""


class PassError(HarmonyError):
    """A compiler pass failed; the message names the pass and the passes run before it."""


class DeviceOutOfMemory(HarmonyError):
    """The runtime measured more live bytes on a device than its budget allows."""


class CommunicationError(HarmonyError):
    """A collective across ranks failed or timed out (a peer died or stalled); names the op, rank and timeout."""


class CheckpointError(HarmonyError):
    """A checkpoint could not be saved or loaded (full disk, unwritable path, damaged or mismatched files)."""


class TornStepError(HarmonyError):
    """A step failed after the optimizer had updated some packs but not others; names them, and refuses to train on
    or save that mix until a checkpoint is loaded or ``sm.accept_partial_step()`` keeps it."""


class StepAbortedError(HarmonyError):
    """Another rank's training step failed, so every rank rolled this step back (data parallel, ZeRO, a pipeline,
    ``balance=``): names the ranks that failed and their errors (``errors``: rank -> its error's text). The
    module is as before the step on every rank; call ``sm(...)`` again on every rank to train on. (Not a
    ``CommunicationError``: the ranks met and the process group is whole.)"""

    def __init__(self, message: str, errors: dict | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})

    def __reduce__(self):
        return type(self), (self.args[0], self.errors)


class OffloadError(HarmonyError):
    """The disk tier failed: its directory could not be made, or a pack's optimizer state not written or read
    (a full disk, an unwritable path). Names the file and what to do."""


class ClosedError(HarmonyError):
    """A call on a module after ``sm.close()``, which released its runtime: compile the model again."""


__all__ = ["HarmonyError", "TraceError", "BudgetError", "ConfigError", "InputError", "PassError", "DeviceOutOfMemory",
           "CommunicationError", "CheckpointError", "OffloadError", "TornStepError", "StepAbortedError",
           "ClosedError"]
