"""A training step's outcome is the job's: a rank whose step fails tells the others at the next collective they
meet, and every rank rolls the same step back.

Each rank says how its step stands (a word: it runs; its own step failed; it knows another's did) at the
collectives that come before an optimizer update, each on its own group and thread, in the schedule's order:

* data parallel (fp32 all-reduces): on each gradient all-reduce (runtime/comm/collectives.py ``allreduce(words=)``):
  at the end of its first fp32 buffer (padded alike on every step over three ranks or more, so no sum changes
  with them); with no fp32 buffer beside it (``Words.launch``: their own small all-reduce, launched with it and
  joined after it); ``shard_state="full"``: on the first swap of each reduce-scatter (two ranks), else in the pad
  of its first all-reduce (the replicated run's padded buffer), or beside it where that run pads none (a compressed
  run's pack of fp32 buffers: runtime/partitioned/meet.py); a pipeline: in the mask before each message (``ABORT``);
* elsewhere (compression, adaptive bits), and before ZeRO-1's broadcasts and a pipeline's norms' all-gather: a
  ``meet`` of its own, one small all-reduce before the collective.

Where none failed, every collective moves the bytes it always did. A rank whose step fails (a bad batch, an
exception in the model, Ctrl-C, a failed disk read) rolls back as one process does (runtime/transaction.py) and,
on its way out, replays the rest of its schedule's collectives saying so (``replay``; each op's ``ghost``: a meet, or
the exchange itself on zeros or on its own chunks: ZeRO-3's gathers carry no word and are replayed whole). Its peers,
waiting in the next of them, learn it there, stop (``Aborted``) and replay theirs alike, so every rank makes every
collective of the step exactly once (counted per group, ``done``) and none waits for one a peer will never make.

Once every rank has replayed, the ranks that heard of a failure (all of them, or none: a word is exchanged by all)
tell each other what happened on the handshake's group (``settle``): the failing ranks' errors, and each rank's
outcome. A step that updated no pack anywhere is rolled back everywhere and the job trains on as if it had not
happened (the others raise ``StepAbortedError``); one that updated some packs somewhere (a torn step) leaves every
rank refusing alike until a checkpoint is loaded. A failure after a rank's last collective (nothing left to tell)
is told at the next call's handshake instead (driver/handshake.py carries each rank's torn state).
"""
from __future__ import annotations

from collections import Counter

import torch

from harmony.base.errors import StepAbortedError

OK, SEEN, FAILED = 0, 1, 2      # what a rank says at a meet: its step runs; it knows of a failure; its own failed
ABORT = 255                     # a pipeline message's mask that says the sender's step failed (runtime/pipeline.py)
STEP_KEY = "default group"      # the words of the collectives on the default group (the host thread's)
GHOSTS: dict = {}               # op name -> what it does in a replay: its meets only (``ghost``)


def ghost(op):
    """Register ``fn(rt, node)`` as what op ``op`` (its stub, or its name) does in a replay: the meets its
    collectives make, in their order (each module of a collective registers its own)."""
    def register(fn):
        GHOSTS[op if isinstance(op, str) else op.__name__] = fn
        return fn
    return register


class Aborted(StepAbortedError):
    """A meet found another rank's step failed (the ranks' errors are exchanged later, in ``settle``)."""


class Words:
    """Each rank's word on the step, riding on a collective's own exchange: as messages added to its first batch of
    point-to-point sends (``ops``), or summed at the end of an all-reduce's buffer (``vector``, ``read``); heard
    after it (``settle``). Made on the thread that runs the collective, in its order: it counts as a meet."""

    def __init__(self, status, key, group):
        status.done[key] += 1
        self.status, self.key, self.group = status, key, group
        self.got: list | None = None
        self.work = self.pending = None       # ``launch``'s all-reduce in flight

    def ops(self, world: int, me: int) -> list:
        """The messages that carry this rank's word to every peer and theirs here (the first call only)."""
        import torch.distributed as dist
        if self.got is not None:
            return []
        mine = torch.tensor([self.status.word()], dtype=torch.int32)
        self.got = [mine if r == me else torch.zeros(1, dtype=torch.int32) for r in range(world)]
        out = []
        for r in range(world):
            if r != me:
                peer = r if self.group is None else dist.get_global_rank(self.group, r)
                out += [dist.P2POp(dist.isend, mine, peer, self.group), dist.P2POp(dist.irecv, self.got[r], peer,
                                                                                     self.group)]
        return out

    def vector(self, world: int, me: int) -> torch.Tensor:
        """This rank's word in its slot of ``world`` floats, for an all-reduce to sum (``read`` takes the sum)."""
        out = torch.zeros(world)
        out[me] = self.status.word()
        return out

    def launch(self, world: int, me: int, timeout: float | None = None) -> None:
        """Send the words beside a collective of ``self.group`` that cannot carry them bitwise (three ranks or more:
        gloo's ring sums an element in an order set by where it sits, so a longer buffer would change the sums):
        their own all-reduce, launched just before it so the two overlap on the backend's threads; ``join`` after."""
        import torch.distributed as dist

        from harmony.runtime.comm.failures import launch
        self.pending = self.vector(world, me)
        group = self.status.beside if self.status.beside is not None else self.group
        self.work = launch("the ranks' words on the step", timeout, group, dist.all_reduce, self.pending)

    def join(self, timeout: float | None = None) -> None:
        """The words ``launch`` sent, once its all-reduce is done."""
        from harmony.runtime.comm.failures import wait_work
        wait_work(self.work, "the ranks' words on the step", timeout,
                  self.status.beside if self.status.beside is not None else self.group)
        self.read(self.pending)
        self.work = self.pending = None

    def read(self, summed: torch.Tensor, scale: float = 1.0) -> None:
        """The words from the sum of every rank's ``vector`` (times ``scale``: an average's world size)."""
        self.got = [round(float(v) * scale) for v in summed]

    def settle(self, raises: bool) -> None:
        """What the words said: a rank's step failed (``Aborted`` where ``raises``), or not."""
        words = [int(t) for t in self.got] if self.got is not None else []
        self.status.heard(self.key, [r for r, w in enumerate(words) if w == FAILED], any(words))
        if raises and self.status.seen:
            raise Aborted(f"rank {self.status.rank}: a rank's step failed before a gather")


class StepStatus:
    """One runtime's view of the step under way across the job (``Runtime.status``; None in one process)."""

    def __init__(self, rank: int, world: int, group, timeout: float):
        self.rank, self.world, self.group, self.timeout = rank, world, group, timeout
        self.active = False            # a step is under way (an evaluation's gathers meet nobody)
        self.any_key = False           # a pipeline's ranks each step their own packs: any meet stops its updates
        self.tails: list = []          # what a replay makes after the schedule's ops: ``fn(rt)`` each (``replay``)
        # the group of the words sent beside a collective (``Words.launch``; the host thread's only): its own, so the
        # backend runs the two at once (None: the collective's)
        self.beside = None
        self.begin(active=False)

    def begin(self, active: bool = True) -> None:
        self.active = active
        self.failed = False            # this rank's step failed: its later meets say so
        self.seen = False              # a meet said a rank's step failed: this step is aborted on every rank
        self.failed_ranks: set[int] = set()
        self.seen_on: set = set()      # the keys whose meets found it
        self.done: Counter = Counter()        # meets made, per key
        self.took: dict = {}                  # ZeRO-3's agreements on carried weights: what each said
        self.replayed: Counter | None = None  # during ``replay``: meets the replay has passed, per key

    # -- the meets -------------------------------------------------------------------------------
    def skip(self, key) -> bool:
        """During a replay, whether the meet ``key`` is one this rank made already."""
        if self.replayed is None:
            return False
        self.replayed[key] += 1
        return self.replayed[key] <= self.done[key]

    def word(self) -> int:
        return FAILED if self.failed else SEEN if self.seen else OK

    def meet(self, key, group=None, what: str = "a collective", flag: torch.Tensor | None = None) -> bool:
        """Before a collective of the step on ``group``: every rank says how its step stands. True: run it; False: a
        rank's step failed (this one's included), skip it. Outside a step, True without a word. ``flag``: a
        one-element tensor that rides along and becomes 1 on every rank where it is non-zero on any (fp16's
        overflow, runtime/precision.py); every rank passes one to the same meet, or none."""
        if not self.active or self.skip(key):
            return not (self.active and (self.seen or self.failed))
        import torch.distributed as dist

        from harmony.runtime.comm.collectives import comm_error
        self.done[key] += 1
        words = torch.zeros(self.world + (flag is not None), dtype=torch.int32)
        words[self.rank] = self.word()
        if flag is not None:
            words[-1] = int(bool(flag.item()))
        try:
            dist.all_reduce(words, group=group)
        except (RuntimeError, dist.DistError) as e:
            raise comm_error(f"{what} (its step's status exchange)", e, self.timeout, group) from e
        if flag is not None:
            flag.fill_(float(words[-1].item() > 0))
            words = words[:-1]
        self.heard(key, [r for r, w in enumerate(words.tolist()) if w == FAILED], bool(words.any()))
        return not self.seen

    def heard(self, key, failed: list[int], any_word: bool) -> None:
        self.failed_ranks.update(failed)
        if any_word:
            self.seen = True
            self.seen_on.add(key)

    def aborted_on(self, key) -> bool:
        """Whether a meet of ``key`` found a failure: what a host update asks before it steps. (Not whether any
        meet did: the meets of another thread are not in step with this thread's work on every rank alike.)"""
        return self.active and (key in self.seen_on or (self.any_key and self.seen))

    def check(self) -> None:
        """Raise ``Aborted`` where a meet found a failure (the executor asks before each op)."""
        if self.seen and not self.failed:
            raise Aborted(f"rank {self.rank}: another rank's step failed")

    # -- after a failure -------------------------------------------------------------------------
    def go(self, key, group=None, what: str = "a collective", flag: torch.Tensor | None = None) -> None:
        """``meet``, raising ``Aborted`` where the collective is to be skipped."""
        if not self.meet(key, group, what, flag):
            raise Aborted(f"rank {self.rank}: a rank's step failed before {what}")

    def replay(self, rt) -> None:
        """The schedule's collectives this rank has not made yet, as meets only (each op's ``ghost``), then those
        that follow the schedule (``tails``: fp16's overflow agreement)."""
        self.replayed = Counter()
        try:
            for node in rt.graph.nodes:
                if node.op != "call_function":
                    continue
                fn = GHOSTS.get(getattr(node.target, "__name__", None))
                if fn is not None:
                    fn(rt, node)
            for fn in self.tails:
                fn(rt)
        finally:
            self.replayed = None

    def settle(self, error: BaseException, outcome: str) -> list:
        """Every rank's (error text or None, outcome) once all have replayed; only where a meet saw a failure."""
        import torch.distributed as dist

        from harmony.runtime.comm.collectives import comm_error
        mine = None if isinstance(error, Aborted) else f"{type(error).__name__}: {_first_line(error)}"
        got: list = [None] * self.world
        try:
            dist.all_gather_object(got, (mine, outcome), group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise comm_error("the exchange of the ranks' step outcomes", e, self.timeout, self.group) from e
        return got


def aborted_error(status: StepStatus, got: list, what: str = "step") -> StepAbortedError:
    """The error a rank whose own step (or evaluation, ``what``) did not fail raises: which ranks failed and how."""
    errors = {r: msg for r, (msg, _) in enumerate(got) if msg is not None}
    each = "; ".join(f"rank {r} failed: {msg}" for r, msg in errors.items())
    what = "training step" if what == "step" else what
    return StepAbortedError(f"the {what} was aborted on every rank of {status.world} because {each}. This "
                            f"rank (rank {status.rank}) stopped at the collective where it learned it", errors)


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else "(no message)"
