"""A checkpoint is one save (driver/checkpoint/saves.py): every rank's directory names the save it belongs to, and a
load never mixes two saves' directories.

Two gloo ranks, under ``shard_state="full"`` and ``shard_state=True`` (each rank its own ``rank-R-of-2``): a rank
directory copied in from another run (another seed), or one save older, is refused on both ranks naming rank 1,
with nothing changed; the directories a save left when it committed on rank 0 only (rank 1's one save older, rank
0's previous one still beside it as ``.old``) load the previous complete save on both ranks, with a warning; a save
that fails on rank 1 fails on both, each keeping the previous save; a normal save and load still round-trip; and
one process reshards the 2-rank checkpoints (2 -> 1) and refuses the mixed one there too.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

import harmony
import harmony.data
import harmony.driver.checkpoint.files as ckfiles
from harmony.errors import CheckpointError
from test_collectives import _spawn
from test_reshard import _compile as compile_mlp
from test_reshard import _digest_of, _step


MODES = ("full", "z1")      # shard_state="full" and True, as test_reshard names them


def _compile(mode, world, seed=0):
    return compile_mlp(mode, world, seed, data_seeds=(0,))


def _barrier():
    import torch.distributed as dist
    dist.barrier()


def _mixed(root: Path, name: str, rank1_from: Path, old0_from: Path | None = None) -> Path:
    """``root/ck`` with rank 1's directory taken from ``rank1_from`` (and rank 0's ``.old`` from ``old0_from``)."""
    out = root / name
    shutil.copytree(root / "ck", out)
    shutil.rmtree(out / "rank-1-of-2")
    shutil.copytree(rank1_from / "rank-1-of-2", out / "rank-1-of-2")
    if old0_from is not None:
        shutil.copytree(old0_from / "rank-0-of-2", out / "rank-0-of-2.old")
    return out


def _refused(sm, model, path) -> dict:
    """Load ``path``: the error's message, and whether the module is as it was."""
    before, steps = _digest_of(model, sm), sm.steps
    try:
        harmony.load(sm, path)
        msg = "no error"
    except CheckpointError as e:
        msg = str(e)
    return dict(msg=msg, unchanged=_digest_of(model, sm) == before and sm.steps == steps)


def _two_ranks(rank, world, root):
    out = {}
    for mode in MODES:
        base = Path(root) / mode
        model, data, sm = _compile(mode, world)
        _step(sm, data, 0, world)
        harmony.save(sm, base / "ck")
        at1 = _digest_of(model, sm)
        _barrier()
        if rank == 0:
            shutil.copytree(base / "ck", base / "at1")
        _barrier()
        _step(sm, data, 1, world)
        harmony.save(sm, base / "ck")
        at2 = _digest_of(model, sm)
        other_model, other_data, other = _compile(mode, world, seed=1)       # another run: another seed
        _step(other, other_data, 0, world)
        harmony.save(other, base / "other")
        other.close()
        _barrier()
        if rank == 0:
            _mixed(base, "from_another_run", base / "other")
            _mixed(base, "one_save_older", base / "at1")
            _mixed(base, "interrupted", base / "at1", old0_from=base / "at1")
        _barrier()
        got = dict(at1=at1, at2=at2)
        got["another_run"] = _refused(sm, model, base / "from_another_run")
        got["older"] = _refused(sm, model, base / "one_save_older")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = harmony.load(sm, base / "interrupted")
        got["interrupted"] = dict(step=info.step, steps=sm.steps, digest=_digest_of(model, sm),
                                  warned=[str(w.message) for w in caught])
        harmony.save(sm, base / "interrupted")        # over it: rank 0 keeps the complete save until all commit
        info = harmony.load(sm, base / "interrupted")
        got["saved_over"] = dict(step=info.step, digest=_digest_of(model, sm),
                                 left=sorted(p.name for p in (base / "interrupted").iterdir()))
        info = harmony.load(sm, base / "ck")
        got["normal"] = dict(step=info.step, digest=_digest_of(model, sm))
        _step(sm, data, 2, world)
        write = ckfiles.write_file

        def full_disk_on_rank_1(path, obj):
            if rank == 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return write(path, obj)
        ckfiles.write_file = full_disk_on_rank_1
        try:
            harmony.save(sm, base / "ck")
            got["failed_save"] = "no error"
        except CheckpointError as e:
            got["failed_save"] = str(e)
        finally:
            ckfiles.write_file = write
        info = harmony.load(sm, base / "ck")
        got["after_failed_save"] = dict(step=info.step, digest=_digest_of(model, sm),
                                        temps=sorted(p.name for p in base.iterdir() if ".tmp-" in p.name
                                                     or p.name.endswith(".old")),
                                        rank_temps=sorted(p.name for p in (base / "ck").iterdir()
                                                          if not p.name.startswith("rank-") or "." in p.name))
        sm.close()
        out[mode] = got
    return out


def _one_process(rank, world, root):
    out = {}
    for mode in MODES:
        base = Path(root) / mode
        model, data, sm = _compile(mode, world)
        info = harmony.load(sm, base / "ck")
        out[mode] = dict(step=info.step, digest=_digest_of(model, sm),
                         another_run=_refused(sm, model, base / "from_another_run"))
        sm.close()
    return out


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory(prefix="harmony-one-save-") as root:
        two = _spawn(2, _two_ranks, root, timeout=600, pg_timeout=60)
        one = _spawn(1, _one_process, root, timeout=300, pg_timeout=60)
        for res, world in ((two, 2), (one, 1)):
            assert sorted(res) == list(range(world)), res
            for r, v in res.items():
                assert isinstance(v, dict), f"rank {r}: {v}"
        yield two, one[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_directory_from_another_run_is_refused_naming_the_rank(ranks, mode):
    two, one = ranks
    for r in range(2):
        got = two[r][mode]["another_run"]
        assert got["unchanged"], got
        assert "its rank directories are not one save's: rank 1's" in got["msg"], got
        assert "is from another run" in got["msg"] and "Nothing was changed" in got["msg"], got
    assert one[mode]["another_run"]["unchanged"]           # and when it is resharded into one process
    assert "rank 1's" in one[mode]["another_run"]["msg"] and "another run" in one[mode]["another_run"]["msg"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_directory_one_save_older_is_refused_naming_the_rank(ranks, mode):
    two, _ = ranks
    for r in range(2):
        got = two[r][mode]["older"]
        assert got["unchanged"], got
        assert "rank 1's" in got["msg"] and "is from another save of the same run: step 1, where rank 0's is step 2" \
            in got["msg"], got


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_save_that_committed_on_rank_0_only_loads_the_previous_complete_save(ranks, mode):
    two, _ = ranks
    for r in range(2):
        got = two[r][mode]
        assert got["interrupted"]["step"] == got["interrupted"]["steps"] == 1, got["interrupted"]
        assert got["interrupted"]["digest"] == got["at1"]
        assert got["saved_over"] == dict(step=1, digest=got["at1"], left=["rank-0-of-2", "rank-1-of-2"])
        assert any("did not commit on every rank (rank 0 wrote it, rank 1 did not" in w
                   and "loaded the previous complete save, step 1, on every rank" in w
                   for w in got["interrupted"]["warned"]), got["interrupted"]["warned"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_normal_save_loads_and_a_failed_save_keeps_the_previous_one_on_every_rank(ranks, mode):
    two, one = ranks
    for r in range(2):
        got = two[r][mode]
        assert got["normal"] == dict(step=2, digest=got["at2"]), got["normal"]
        msg = got["failed_save"]
        assert ("rank 1 failed" in msg or "No space left on device" in msg) and msg != "no error", msg
        after = got["after_failed_save"]
        assert after["step"] == 2 and after["digest"] == got["at2"], after      # the previous save, whole
        assert after["temps"] == [] and after["rank_temps"] == [], after
    assert "rank 1 failed (CheckpointError: could not save" in two[0][mode]["failed_save"]
    assert one[mode]["step"] == 2 and one[mode]["digest"] == two[0][mode]["at2"]     # 2 -> 1 resharded
