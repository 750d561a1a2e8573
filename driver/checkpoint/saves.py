"""A checkpoint is one save: every rank's files carry the same save id, and a load takes one save's files only.

Each ``harmony.save`` draws an id on rank 0 (``draw``); it travels to every rank over the module's handshake group
(driver/handshake.py) and goes into every rank's manifest as ``"save": {"id", "run", "rank", "world"}`` (``run``:
an id the module draws at its first save, the same for all its saves). Over several ranks that each write their
own directory, a save commits in two phases (``commit_together``): every rank writes its directory under a
temporary name and the ranks tell each other it is complete (a rank that failed makes every rank raise, each
keeping its previous checkpoint); then each renames its own into place, keeping the previous one as ``.old`` until
every rank has renamed (a rank whose rename failed makes every rank put its previous one back).

A process killed between the renames can still leave rank directories of two saves. ``choose`` takes, for every
rank, the directory of one save they all hold: the newest whose files every rank still has (its directory, or its
``.old``), and says so in a warning when that is not the newest save there. Rank directories that share no save (a
directory copied in from another run, a rank's directory one save older) are refused, naming each rank's save.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from harmony.base.errors import CheckpointError, CommunicationError
from harmony.driver.checkpoint import files as ckfiles
from harmony.driver.checkpoint.files import MANIFEST


@dataclass(frozen=True)
class Held:
    """A checkpoint directory a rank could load: its path, step and save (``save`` None: written before saves had
    ids; ``readable`` False: its manifest cannot be read, which its load then names)."""

    path: str
    step: int | None
    save: str | None
    run: str | None
    rank: int | None
    readable: bool = True


def exchange(sm, mine, call: str) -> list:
    """Every rank's ``mine``, in rank order, over the module's handshake group; ``[mine]`` on one process."""
    handshake = getattr(sm, "handshake", None)
    if handshake is None:
        return [mine]
    import torch.distributed as dist
    got: list = [None] * handshake.world
    try:
        dist.all_gather_object(got, mine, group=handshake.group)
    except (RuntimeError, dist.DistError) as e:
        raise CommunicationError(f"{call} on rank {handshake.rank} of {handshake.world}: the ranks could not "
                                 f"exchange which save they hold within {handshake.timeout:g} s ({e}); nothing was "
                                 f"changed. If a rank died, restart all ranks and load the last checkpoint.") from e
    return got


def draw(sm, call: str) -> dict:
    """This save's id, the run's and this rank's place, the same id on every rank (rank 0 draws it)."""
    handshake = getattr(sm, "handshake", None)
    run = getattr(sm, "checkpoint_run", None) or secrets.token_hex(8)
    drawn = exchange(sm, (secrets.token_hex(8), run), call)[0]
    sm.checkpoint_run = drawn[1]        # rank 0's: every rank's saves name the same run
    rank, world = (0, 1) if handshake is None else (handshake.rank, handshake.world)
    return {"id": drawn[0], "run": drawn[1], "rank": rank, "world": world}


def held(d) -> list[Held]:
    """The checkpoints rank directory ``d`` holds, newest first: ``d`` and its ``.old``. Never raises: a directory
    whose manifest cannot be read is held as unreadable, and its load says why."""
    target, old, _ = ckfiles.paths(d)
    out = []
    for p in (target, old):
        if not ckfiles.is_checkpoint(p):
            continue
        try:
            manifest = json.loads((p / MANIFEST).read_text())
            save = manifest.get("save") if isinstance(manifest.get("save"), dict) else {}
            step = manifest.get("step")
            out.append(Held(str(p), step if isinstance(step, int) else None, _str(save.get("id")),
                            _str(save.get("run")), save.get("rank") if isinstance(save.get("rank"), int) else None))
        except (OSError, ValueError, AttributeError):
            out.append(Held(str(p), None, None, None, None, readable=False))
    return out


def _str(v) -> str | None:
    return v if isinstance(v, str) else None


def choose(ranks: list[list[Held]], where) -> tuple[list[Held], str | None] | None:
    """One save's directory for every rank (``ranks``: what each holds, ``held``), and a warning where it is not
    the newest save there; None where a rank holds none (its load names what is missing). ``CheckpointError``,
    naming the ranks, where the ranks' directories share no save."""
    if any(not h for h in ranks):
        return None
    first = [h[0] for h in ranks]
    if any(not h.readable for h in first):
        return first, None
    misplaced = [(r, h) for r, h in enumerate(first) if h.rank is not None and h.rank != r]
    if misplaced:
        r, h = misplaced[0]
        raise CheckpointError(f"cannot load {where}: {h.path} is rank {r}'s directory but holds the files rank "
                              f"{h.rank} saved; put each rank's directory back under its own name. Nothing was "
                              f"changed.")
    if len({h.save for h in first}) == 1:
        return first, None
    common = set.intersection(*({h.save for h in hs if h.save is not None} for hs in ranks))
    if not common:
        raise CheckpointError(_mismatch(first, where))
    chosen = [next(h for h in hs if h.save in common) for hs in ranks]
    newest = max(first, key=lambda h: h.step if h.step is not None else -1)
    ahead = [r for r, h in enumerate(first) if h.save == newest.save]
    behind = [r for r in range(len(first)) if r not in ahead]
    note = (f"{where}: the save at step {newest.step} did not commit on every rank ({_ranks(ahead)} wrote it, "
            f"{_ranks(behind)} did not: a save was interrupted); loaded the previous complete save, step "
            f"{chosen[0].step}, on every rank. The next harmony.save there replaces both.")
    return chosen, note


def _mismatch(first: list[Held], where) -> str:
    """Each rank whose directory is not of rank 0's save, and whose save it is."""
    ref, odd, said = first[0], [], []
    for r, h in enumerate(first[1:], start=1):
        if h.save == ref.save:
            continue
        odd.append(r)
        if h.save is None or ref.save is None:
            said.append(f"rank {r}'s ({h.path}) " + ("has no save id (an older Harmony wrote it) and rank 0's has one"
                                                     if h.save is None else "has a save id and rank 0's none"))
        elif h.run != ref.run:
            said.append(f"rank {r}'s ({h.path}, step {h.step}) is from another run (save {h.save} of run {h.run}; "
                        f"rank 0's is save {ref.save} of run {ref.run}, step {ref.step})")
        else:
            said.append(f"rank {r}'s ({h.path}) is from another save of the same run: step {h.step}, where rank 0's "
                        f"is step {ref.step}")
    return (f"cannot load {where}: its rank directories are not one save's: {'; '.join(said)}. Every rank's "
            f"directory must come from the same harmony.save: load another checkpoint, or put back that save's "
            f"directory for {_ranks(odd)}. Nothing was changed.")


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) != 1 else ''} {', '.join(map(str, rs))}"


# -- saving over several ranks -----------------------------------------------------------------------------------
class Staged:
    """A rank's checkpoint written completely under ``tmp``, to be renamed into ``target`` (``commit_together``)."""

    def __init__(self, tmp: Path, target: Path, old: Path, need: int = 0, previous: bool = False):
        self.tmp, self.target, self.old = tmp, target, old
        self.need, self.previous = need, previous     # for ``files.explain_save``: its size, a checkpoint before
        self.swapped = False

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def swap(self, keep: Path | None = None) -> None:
        """``tmp`` takes ``target``'s place, and the previous save stays as ``.old``: ``target``, or where ``keep``
        names ``.old`` (``target`` is of a save that never committed on every rank), ``.old`` itself."""
        if self.target.exists() and keep == self.old:
            shutil.rmtree(self.target)
            ckfiles.fsync_dir(self.target.parent)
        if self.target.exists():
            if self.old.exists():
                shutil.rmtree(self.old)
            os.rename(self.target, self.old)
            ckfiles.fsync_dir(self.target.parent)
            try:
                os.rename(self.tmp, self.target)
            except OSError:
                os.rename(self.old, self.target)
                raise
        else:
            os.rename(self.tmp, self.target)
        ckfiles.fsync_dir(self.target.parent)
        self.swapped = True

    def undo(self) -> None:
        """Put the previous save back (another rank could not commit this one)."""
        if not self.swapped:
            self.discard()
            return
        shutil.rmtree(self.target, ignore_errors=True)
        if self.old.exists():
            os.rename(self.old, self.target)
        ckfiles.fsync_dir(self.target.parent)

    def finish(self) -> None:
        shutil.rmtree(self.old, ignore_errors=True)


def commit_together(sm, stage, call: str) -> Path:
    """``stage()`` (this rank's checkpoint written under a temporary name: a ``Staged``) on every rank, then every
    rank's renamed into place once every rank's is complete, each keeping the last save complete on every rank as
    ``.old`` until all have renamed; a rank that fails in either phase makes every rank raise, each with its
    previous checkpoint in place."""
    handshake = sm.handshake
    staged, error = None, None
    try:
        staged = stage()
    except Exception as e:   # noqa: BLE001 (told to the other ranks, then raised here)
        error = e
    try:
        handshake.outcome(call, error)
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    # the last save complete on every rank is what each rank keeps as .old until this one has committed on all
    try:
        every = exchange(sm, held(staged.target), call)
    except BaseException:
        staged.discard()
        raise
    try:
        chosen = choose(every, staged.target.parent)
    except CheckpointError:         # the ranks' directories share no save: none to keep
        chosen = None
    error = None
    try:
        staged.swap(Path(chosen[0][handshake.rank].path) if chosen else None)
    except OSError as e:
        error = CheckpointError(f"could not rename {staged.tmp} to {staged.target}: {e.strerror or e}; every rank "
                                f"keeps its previous checkpoint. Check the file system and save again.")
    try:
        handshake.outcome(call, error)
    except BaseException:
        staged.undo()
        raise
    staged.finish()
    return staged.target
