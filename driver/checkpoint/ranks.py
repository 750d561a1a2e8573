"""Checkpoints over several ranks: the layout a checkpoint was saved in, and the one this run loads into.

A checkpoint is saved in one of seven layouts, named in its manifest (``world``, ``mode``):

* ``whole``: one directory with the whole state, by one process or by replicated data-parallel ranks (rank 0
  writes it);
* ``zero1`` (``shard_state=True``): ``rank-R-of-W`` directories, each with every weight and the optimizer state of
  the parameters rank R owns;
* ``full`` (``shard_state="full"``): ``rank-R-of-W`` directories, each with rank R's pieces of the weights and
  their optimizer state (``share:<name>[a:b]``, elements ``a:b`` of the flattened parameter);
* ``pipeline``: ``rank-R-of-W`` directories, each with the weights and optimizer state of the packs rank R runs;
* ``grid`` (``parallel=("pipeline", "data")``): ``rank-R-of-W`` directories, pipeline 0's ranks each with its packs'
  state (each stage once), every other rank's with its RNG only (its pipeline holds the same state);
* ``grid_zero1`` (a grid with ``shard_state=True``): ``rank-R-of-W`` directories, each with the weights of rank R's
  packs and the optimizer state of the parameters it owns (its share of its stage's, over the stage's replicas);
* ``grid_zero3`` (a grid with ``shard_state="full"``): ``rank-R-of-W`` directories, each with rank R's pieces of its
  stage's weights and their optimizer state (``share:<name>[a:b]``, its chunks over the stage's replica group).

``saved_layout(path)`` reads which, ``this_layout(sm)`` says the run's own. Where the two are the same, each rank
reads its own directory; otherwise ``harmony.driver.checkpoint.reshard`` assembles the run's layout from the pieces the
saved ranks wrote. ``describe`` names a layout in the messages ("2 ranks with shard_state='full'").
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from harmony.base.errors import CheckpointError

_RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)(\.old)?")
MODES = ("whole", "zero1", "full", "pipeline", "grid", "grid_zero1", "grid_zero3")


@dataclass
class Layout:
    """How a checkpoint's state is split: ``world`` ranks in ``mode``; ``dirs``: each saved rank's directory."""

    world: int
    mode: str
    dirs: list[Path] = field(default_factory=list)

    def same(self, other: "Layout") -> bool:
        """Each rank of ``other`` finds its own state in this layout as it is (nothing to reshard)."""
        return self.mode == other.mode and (self.mode == "whole" or self.world == other.world)


def describe(layout: Layout) -> str:
    """'2 ranks with shard_state=True (each its shard of the optimizer state)', for the messages."""
    n = f"{layout.world} rank{'s' if layout.world != 1 else ''}"
    return {"whole": f"{'1 rank (one process)' if layout.world == 1 else n} with the whole state (no shard_state)",
            "zero1": f"{n} with shard_state=True (each its shard of the optimizer state)",
            "full": f"{n} with shard_state='full' (each its share of the weights and optimizer state)",
            "pipeline": f"{n} of a pipeline (each its packs' state)",
            "grid": f"{n} of a pipeline x data-parallel grid (each stage's state once)",
            "grid_zero1": f"{n} of a pipeline x data-parallel grid with shard_state=True (each rank its share of "
                          f"its stage's optimizer state)",
            "grid_zero3": f"{n} of a pipeline x data-parallel grid with shard_state='full' (each rank its share of "
                          f"its stage's weights and optimizer state)"}.get(
        layout.mode, f"{n} in mode {layout.mode!r}")


def this_layout(sm) -> Layout:
    """The layout this run's ranks hold their state in."""
    plan, cfg = sm.program.plan, sm.program.config
    staged = plan.stage is not None
    world = (cfg.world_size or 1) if cfg.data_parallel or staged else 1
    return Layout(world, sm.mode.checkpoint_layout(plan))      # its parallel mode's (driver/modes/)


def rank_dir(path, rank: int, world: int) -> Path:
    return Path(path) / f"rank-{rank}-of-{world}"


def saved_layout(path) -> Layout | None:
    """The layout of the checkpoint at ``path`` (its rank-0 manifest says which), or None where there is none."""
    path = Path(os.path.realpath(os.fspath(path)))
    try:
        sizes = {int(m.group(2)) for p in path.iterdir() if (m := _RANK_DIR.fullmatch(p.name))}
    except OSError:
        sizes = set()
    if not sizes:
        if not ((path / "manifest.json").is_file() or path.with_name(path.name + ".old").is_dir()):
            return None
        return Layout(_field(path, "world", 1), "whole", [path])
    if len(sizes) > 1:
        raise CheckpointError(f"cannot load {path}: it holds the rank directories of several world sizes "
                              f"({', '.join(f'rank-R-of-{w}' for w in sorted(sizes))}); keep one save's "
                              f"directories there. Nothing was changed.")
    world = sizes.pop()
    dirs = [rank_dir(path, r, world) for r in range(world)]
    mode = _field(dirs[0], "mode", None) or _field(dirs[0].with_name(dirs[0].name + ".old"), "mode", None)
    return Layout(world, mode if mode in MODES else _guess(dirs), dirs)


def _field(d: Path, key: str, default):
    """One field of the manifest in ``d`` (or ``default``: an older checkpoint, or one that is damaged, which
    the load names when it reads it)."""
    try:
        return json.loads((d / "manifest.json").read_text()).get(key, default)
    except (OSError, ValueError, AttributeError):
        return default


def _guess(dirs: list[Path]) -> str:
    """A manifest written before it named its layout: pieces of weights mean ``full``; ranks holding different
    weights, a pipeline's packs; else ``zero1``."""
    held = []
    for d in dirs[:2]:
        try:
            files = json.loads((d / "manifest.json").read_text()).get("files", [])
            held.append({n for f in files if isinstance(f, dict) for n in f.get("model", {})})
        except (OSError, ValueError, AttributeError):
            return "zero1"
    if any(n.startswith("share:") for n in held[0]):
        return "full"
    return "pipeline" if len(held) > 1 and held[0] != held[1] else "zero1"
