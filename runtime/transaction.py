"""A training step is a transaction: it commits whole, or leaves the module as it was before it.

``Runtime.run`` opens a ``Transaction`` per step. If anything raises inside the step (the user's
model, a bad batch, ``KeyboardInterrupt``, a failed disk read), ``roll_back`` waits for the work in
flight (copies, host optimizer steps, disk writes), drops the step's gradients, releases every hold
the step took on the device (so the meter is back at its pre-step level), takes back any the step
had let go, and forgets the step's activations, losses and random states. The exception goes on
to the user with a note saying what happened.

What cannot be undone is an optimizer update: ``torch.optim`` changes weights and state in place,
and keeping a copy of every pack's state before it steps would double the host traffic of every
step to protect against a rare failure. So updates are made as late as the schedule allows anyway
(a pack steps right after its last backward, overlapped with the next pack's), and:

* ``SIGINT`` (Ctrl-C) that arrives once the first pack has begun to step is held until the step
  has finished, then delivered: the step completes and counts, and the user's handler (by
  default ``KeyboardInterrupt``) runs after it.
* any other failure after the first update leaves an exact record (``Runtime.torn``: which packs
  stepped and which did not). The module then refuses to train on or save that mix
  (``TornStepError``) until the user loads a checkpoint or accepts it.
* a failure after every pack stepped (a disk write that failed at the end of the step, whose
  state is kept in host memory) leaves a complete update: the step counts.
"""
from __future__ import annotations

import signal
import threading
import traceback
from collections import Counter

import torch

from harmony.base.units import fmt_bytes
from harmony.runtime.comm.communicator import existing
from harmony.runtime.comm.jobwide import Aborted, aborted_error

# what runs over several ranks as one outcome of the job (runtime/comm/jobwide.py): a step; a pipeline's evaluation
# (its status is active only there: data-parallel ranks evaluate alone)
JOBWIDE = ("step", "evaluation")

ROLLED_BACK, COMMITTED, TORN = "rolled back", "committed", "torn"


class Transaction:
    """One step's record: the device holds before it, the packs whose optimizer step began, held signals."""

    def __init__(self, rt, step_packs: list[int], what: str = "step"):
        self.rt = rt
        self.what = what                               # "step", or "evaluation" (a forward-only schedule)
        self.step_packs = step_packs                   # every pack the schedule steps, in order
        self.refs = Counter({k: n for k, n in rt.state.refs.items() if n > 0})
        self.live = rt.meter.live
        self.stepped: list[int] = []                   # packs whose update began, in order (a host update that
                                                       # waits in the StepGate counts when the gate runs it)
        self.outcome: str | None = None
        self._held: tuple | None = None                # (signum, frame) of a SIGINT held until the step ends
        self._previous = None                          # the SIGINT handler to restore

    # -- while the step runs --------------------------------------------------------------------
    def stepping(self, pack: int) -> None:
        """The optimizer is about to update ``pack``: from here on Ctrl-C waits for the step to finish."""
        if not self.stepped:
            self._hold_interrupts()
        self.stepped.append(pack)

    def unstep(self, pack: int) -> None:
        """``pack``'s update, counted when it was queued, did not run (the job aborted the step first)."""
        if pack in self.stepped:
            self.stepped.reverse()
            self.stepped.remove(pack)
            self.stepped.reverse()

    def _hold_interrupts(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return                                     # signal handlers run on the main thread only
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):                     # ignored or the OS default: nothing to hold
            return
        self._previous = previous

        def hold(signum, frame):
            if self._held is not None:                 # a second Ctrl-C: the user insists, stop now
                self._restore()
                previous(signum, frame)
                return
            self._held = (signum, frame)
        signal.signal(signal.SIGINT, hold)

    def _restore(self) -> tuple | None:
        held, self._held = self._held, None
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return held

    # -- the end of the step ----------------------------------------------------------------------
    def commit(self) -> None:
        """The step finished: deliver a Ctrl-C held during its updates, now that they are complete."""
        self.outcome = COMMITTED
        previous = self._previous
        held = self._restore()
        if held is not None:
            try:
                previous(*held)
            except BaseException as e:
                e.add_note("harmony: Ctrl-C arrived while the optimizer was updating the parameters; the step was "
                           "finished first and counts in sm.steps, so the module holds one whole update")
                raise

    def roll_back(self, error: BaseException) -> BaseException | None:
        """Return the runtime to its state before the step; note on ``error`` what happened. Over several ranks,
        every rank's collectives of the step are met first (runtime/comm/jobwide.py): returns the error to raise
        instead of ``error`` where another rank's step failed (``StepAbortedError``), else None."""
        held = self._restore()
        rt, state = self.rt, self.rt.state
        status = getattr(rt, "status", None) if self.what in JOBWIDE else None
        if status is not None and not status.active:
            status = None
        if status is not None and not isinstance(error, Aborted):
            status.failed = True        # the collectives still queued on this rank's threads say so
        _clear_frames(error)
        failed = _settle(rt)
        if status is not None:          # the rest of the step's collectives, as meets: the peers learn it there
            failed[1].extend(_replay(status, rt))
        stepped = list(dict.fromkeys(self.stepped))
        for t in state.tensors.values():
            if isinstance(t, torch.nn.Parameter):
                t.grad = None
        state.parked.clear()
        if getattr(state, "params_disk", None) is not None:
            state.params_disk.parked.clear()
        if getattr(state, "shares", None) is not None:    # shard_state="full"
            state.shares.stats.update(dict.fromkeys(state.shares.stats, 0))   # the next step counts its own
            if state.shares.carry is not None:
                state.shares.carry.drop()    # copies carried to the next forward: every rank gathers anew
        self._restore_holds()
        rt.rng.clear()
        rt.losses, rt.batch = [], {}
        rt.__dict__.pop("shared_loss", None)
        if rt.gate is not None:
            rt.gate.deferred, rt.gate.open = [], False
        if rt.on_demand is not None:     # its record of what each op allocates is the last whole step's
            rt.on_demand.current = []
        rt.meter.reset_peak()
        whole = set(stepped) == set(self.step_packs) and not failed[0]
        self.outcome = ROLLED_BACK if not stepped else COMMITTED if whole else TORN
        if self.outcome == TORN:
            rt.torn = torn_record(rt, stepped, self.step_packs)
        instead = None
        if status is not None and status.seen:      # every rank met the failure: what each had done, told to all
            instead, others = self._agree(status, error, stepped)
            if others:
                failed[1].append(others)
        error.add_note(self._note(rt, stepped, held, failed[1]))
        if instead is not None:
            instead.__notes__ = list(error.__notes__)
        return instead

    def _agree(self, status, error: BaseException, stepped: list[int]) -> tuple[BaseException | None, str]:
        """The ranks' outcomes exchanged: a step torn anywhere (or committed on some ranks only) is torn on every
        rank; the error this rank raises instead where its own step did not fail."""
        rt = self.rt
        try:
            got = status.settle(error, self.outcome)
        except BaseException as e:    # noqa: BLE001 (the step's own error is the one to raise)
            return None, f"{type(e).__name__}: {e}"
        outcomes = [o for _, o in got]
        if len(set(outcomes)) > 1 or TORN in outcomes:
            where = ", ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes))
            if self.outcome != TORN:
                rt.torn = torn_record(rt, stepped, self.step_packs)
            rt.torn["ranks"] = where
            self.outcome = TORN
        elif self.outcome == ROLLED_BACK and self.what == "step":   # as if it had not happened: the all-reduces too
            comm = existing(rt)
            if comm is not None:
                comm.undo_step()
        return (aborted_error(status, got, self.what) if isinstance(error, Aborted) else None), ""

    def _restore_holds(self) -> None:
        state = self.rt.state
        order = {"grads": 0, "optim": 1, "params": 2}     # gradients are gone; state then weights go back
        for (kind, name), n in sorted(state.refs.items(), key=lambda kv: order.get(kv[0][0], 3)):
            for _ in range(n - self.refs.get((kind, name), 0)):
                state.release(kind, [name])
        for (kind, name), n in self.refs.items():          # holds the step had let go (weights it carried)
            for _ in range(n - state.refs.get((kind, name), 0)):
                state.wait(state.fetch(kind, [name]))
        state.land()      # the state the releases sent back is on the host before the error reaches the user

    def _note(self, rt, stepped, held, cleanup_errors) -> str:
        extra = "" if not cleanup_errors else \
            f" (while rolling back: {'; '.join(cleanup_errors[:3])})"
        if held is not None:
            extra += "; a Ctrl-C that arrived during the step was dropped with it"
        if self.outcome == ROLLED_BACK and self.what != "step":
            return (f"harmony: the {self.what} was rolled back: the device holds {fmt_bytes(rt.meter.live)} as "
                    f"before it ({fmt_bytes(self.live)}) and no training state changed; the next sm(...) trains as "
                    f"if this call had not happened{extra}")
        if self.outcome == ROLLED_BACK:
            return (f"harmony: the step was rolled back: no parameter or optimizer state changed, its gradients "
                    f"were dropped and the device holds {fmt_bytes(rt.meter.live)} as before it "
                    f"({fmt_bytes(self.live)}); the next sm(...) trains as if this call had not happened{extra}")
        if self.outcome == COMMITTED:
            return (f"harmony: every pack's optimizer update was applied before this error, so the step counts in "
                    f"sm.steps{extra}")
        return f"harmony: {describe_torn(rt.torn)}{extra}"


def _replay(status, rt) -> list[str]:
    """``status.replay``: the errors it met (a dead peer), for the rollback's note."""
    try:
        status.replay(rt)
    except BaseException as e:    # noqa: BLE001 (the step's own error is the one to raise)
        return [f"{type(e).__name__}: {str(e).splitlines()[0]}"]
    return []


def torn_record(rt, stepped: list[int], step_packs: list[int]) -> dict:
    """Which packs a failed step updated, and which it did not."""
    packs = rt.plan.packs
    return dict(stepped=list(stepped), not_stepped=[p for p in step_packs if p not in set(stepped)],
                params=[n for p in stepped for n in packs[p].stepped])


def describe_torn(torn: dict) -> str:
    names = torn["params"]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if "ranks" in torn:
        return (f"the step failed on one rank of several after the optimizer had updated some packs on some ranks "
                f"({torn['ranks']}; here packs {torn['stepped']} were updated, {torn['not_stepped']} not): the ranks "
                f"no longer hold one model's state. Every rank refuses to train on or save this mix until you call "
                f"harmony.load(sm, checkpoint) on every rank to go back to a checkpoint, or sm.accept_partial_step() "
                f"on every rank to keep it")
    return (f"the step failed after the optimizer had updated packs {torn['stepped']} ({shown}) but not packs "
            f"{torn['not_stepped']}: the rest of the step was rolled back, but those updates cannot be. The module "
            f"refuses to train on or save this mix until you call harmony.load(sm, checkpoint) to go back to a "
            f"checkpoint, or sm.accept_partial_step() to keep it")


def _clear_frames(error: BaseException) -> None:
    """Let go of what the failed step's frames hold (activations, device copies), which the traceback would keep
    alive as long as the user keeps the exception: the device memory must be back now. The frames' locals are
    lost to a post-mortem debugger; the traceback's lines stay."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)    # frames still running (``Runtime.run``'s) are skipped
        error = error.__cause__ or error.__context__


def _settle(rt) -> tuple[bool, list[str]]:
    """Wait for the copies, host steps and disk writes the step started. Returns (whether a host step failed,
    the errors met), so that nothing is still writing into memory the rollback frees."""
    state, errors, step_failed = rt.state, [], False
    try:
        state.copier.join(state.copier.submit(lambda: None))   # one worker, in order: every copy before it is done
        state.land()
    except BaseException as e:     # noqa: BLE001 (the step's own error is the one to raise)
        errors.append(f"{type(e).__name__}: {e}")
    for fut in dict.fromkeys(state.pending.values()):
        try:
            fut.result()
        except BaseException as e:   # noqa: BLE001
            step_failed = True
            errors.append(f"{type(e).__name__}: {e}")
    state.pending.clear()
    for tier in (getattr(state, "params_disk", None), getattr(state, "disk", None)):
        if tier is None:
            continue
        try:
            tier.flush()
        except BaseException as e:   # noqa: BLE001  (a failed write keeps its state in host memory)
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return step_failed, errors
