"""Checkpoints across world sizes and sharding modes, and every rank calling harmony.save.

One spawn per phase (``_spawn`` from test_collectives), each running several cases: 2 ranks train and save in each
mode (replicated, ``shard_state=True``, ``shard_state="full"``); 3 ranks do the same and load the 2-rank ones; one
process loads all of them; 2 ranks load the 3-rank and 1-process ones and the other modes of their own size. The
reference of every load into M ranks is the M-rank replicated run that loaded the replicated checkpoint of the same
state (whose layout needs no resharding): the same parameters after the same steps, bit for bit (ZeRO-1 and
ZeRO-3 train bitwise like replicated: tests/test_zero3.py).
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import CheckpointError, CommunicationError
from models import mlp_case, training_state_bytes
from test_collectives import _digest, _spawn

MODES = {"rep": False, "z1": True, "full": "full"}
K, J = 2, 2           # steps before the save, after the load


def _compile(mode, world, seed=0, data_seeds=(0, 1)):
    """The MLP (its weights drawn from ``seed``) compiled for ``world`` ranks in ``mode``, and the batches of
    ``data_seeds`` (tests/test_one_save.py's too)."""
    model, _ = mlp_case(batch=12, seed=seed)
    data = [b for s in data_seeds for b in mlp_case(batch=12, seed=s)[1]]
    kw = dict(shard_state=MODES[mode]) if world > 1 else {}
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]) if world > 1 else data[0],
                         microbatches=2, memory_budget=int(training_state_bytes(model) * 0.5),
                         optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3), optimizer_on="host", **kw)
    return model, data, sm


def _step(sm, data, i, world):
    sm(*(harmony.data.shard(data[i]) if world > 1 else data[i]))


def _digest_of(model, sm):
    if getattr(sm.runtime.state, "shares", None) is not None:
        sm.sync_model()
    return _digest([p.detach() for p in model.parameters()])


def _save_all(world, root):
    """Train K steps in each mode, save to ``root/w<world>-<mode>``; the digests (equal across modes)."""
    out = {}
    for mode in (MODES if world > 1 else ["rep"]):
        model, data, sm = _compile(mode, world)
        for i in range(K):
            _step(sm, data, i, world)
        harmony.save(sm, Path(root) / f"w{world}-{mode}")
        out[mode] = _digest_of(model, sm)
        sm.close()
    return out


def _resume(world, root, sources):
    """For each mode here and each source checkpoint: load, check the step count, train J steps, digest."""
    out = {}
    for mode in (MODES if world > 1 else ["rep"]):
        model, data, sm = _compile(mode, world)
        for src in sources:
            try:
                info = harmony.load(sm, Path(root) / src)
                assert sm.steps == K and info.step == K, (sm.steps, info)
                for i in range(K, K + J):
                    _step(sm, data, i, world)
                out[(mode, src)] = _digest_of(model, sm)
            except Exception as e:  # noqa: BLE001 (reported to the parent)
                out[(mode, src)] = f"{type(e).__name__}: {e}"
        if world == 1:      # the whole state, exactly: every source's state dict equals the replicated one's
            sds = {}
            for src in sources:
                harmony.load(sm, Path(root) / src)
                sds[src] = copy.deepcopy(sm.training_state_dict())     # it references the live tensors
            out["same_state"] = all(_same_state(sd, sds[src.split("-")[0] + "-rep"]) for src, sd in sds.items())
        sm.close()
    return out


def _same_state(sd, ref) -> bool:
    return (sd["model"].keys() == ref["model"].keys() and sd["optimizer"].keys() == ref["optimizer"].keys()
            and all(torch.equal(sd["model"][n], ref["model"][n]) for n in ref["model"])
            and all(sd["optimizer"][n].keys() == s.keys() and all(torch.equal(v, sd["optimizer"][n][k])
                                                                  for k, v in s.items())
                    for n, s in ref["optimizer"].items())
            and sd["step"] == ref["step"] and sd["param_groups"] == ref["param_groups"])


def _tampered(rank, world, root):
    """A damaged piece of a 2-rank checkpoint loaded into 3 ranks: refused on every rank, nothing changed."""
    bad = Path(root) / "tampered"
    if rank == 0:
        shutil.copytree(Path(root) / "w2-full", bad)
        victim = next(p for p in sorted((bad / "rank-1-of-2").glob("*.pt")) if p.name != "rng.pt")
        raw = bytearray(victim.read_bytes())
        raw[-10] ^= 0xFF
        victim.write_bytes(bytes(raw))
    import torch.distributed as dist
    dist.barrier()
    model, data, sm = _compile("full", world)
    _step(sm, data, 0, world)
    before, steps = _digest_of(model, sm), sm.steps
    try:
        harmony.load(sm, bad)
        msg = "no error"
    except CheckpointError as e:
        msg = str(e)
    after = _digest_of(model, sm)
    sm.close()
    return dict(msg=msg, unchanged=before == after and sm.steps == steps)


def _save_on_rank_0_only(rank, world, root):
    """The DDP habit: rank 0 saves while rank 1 steps. Both refused at once, naming the calls; then both go on."""
    os.environ["HARMONY_COMM_TIMEOUT"] = "20"
    out = {}
    for mode in ("rep", "full"):
        model, data, sm = _compile(mode, world)
        _step(sm, data, 0, world)
        try:
            if rank == 0:
                harmony.save(sm, Path(root) / f"alone-{mode}")
            else:
                _step(sm, data, 1, world)
            out[mode] = "no error"
        except CommunicationError as e:
            out[mode] = str(e)
        out[f"{mode}_steps"] = sm.steps
        _step(sm, data, 1, world)           # the ranks agree again: a step together works
        out[f"{mode}_then"] = sm.steps
        sm.close()
    os.environ["HARMONY_COMM_TIMEOUT"] = "3"     # last: rank 1 leaves, rank 0 saves with no one to meet
    model, data, sm = _compile("rep", world)
    if rank == 0:
        try:
            harmony.save(sm, Path(root) / "left")
            out["left"] = "no error"
        except CommunicationError as e:
            out["left"] = str(e)
    return out


def _phase(rank, world, root, what):
    out = {}
    if "save" in what:
        out["saved"] = _save_all(world, root)
    if "resume" in what:
        out["resumed"] = _resume(world, root, what["resume"])
    if "tamper" in what:
        out["tampered"] = _tampered(rank, world, root)
    if "alone" in what:
        out["alone"] = _save_on_rank_0_only(rank, world, root)
    return out


@pytest.fixture(scope="module")
def root():
    with tempfile.TemporaryDirectory(prefix="harmony-reshard-") as d:
        yield d


def _run(world, root, **what):
    res = _spawn(world, _phase, root, what, timeout=600, pg_timeout=60)
    assert sorted(res) == list(range(world)), res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
    return res


@pytest.fixture(scope="module")
def two(root):
    return _run(2, root, save=True)


@pytest.fixture(scope="module")
def three(root, two):
    sources = ["w2-rep", "w2-z1", "w2-full"]
    return _run(3, root, save=True, resume=sources, tamper=True)


@pytest.fixture(scope="module")
def one(root, three):
    return _run(1, root, save=True, resume=["w2-rep", "w2-z1", "w2-full", "w3-rep", "w3-z1", "w3-full"])


@pytest.fixture(scope="module")
def two_again(root, one):
    return _run(2, root, resume=["w3-rep", "w3-z1", "w3-full", "w1-rep", "w2-rep", "w2-z1", "w2-full"],
                alone=True)


def _check_against_replicated(res, world, families):
    """Each (mode, source) digest equals the replicated load of the source family's replicated checkpoint."""
    for r in range(world):
        got = res[r]["resumed"]
        for (mode, src), digest in ((k, v) for k, v in got.items() if isinstance(k, tuple)):
            ref = got[("rep", families[src])]
            assert digest == ref, f"rank {r}: {mode} loading {src}: {digest}"
            assert digest == res[0]["resumed"][(mode, src)]


@pytest.mark.slow
def test_checkpoints_of_every_mode_hold_the_same_state(two, three):
    for res in (two, three):
        assert len({d for r in res for d in res[r]["saved"].values()}) == 1


@pytest.mark.slow
def test_two_ranks_into_three_bitwise_in_every_mode(three):
    _check_against_replicated(three, 3, {s: "w2-rep" for s in ("w2-rep", "w2-z1", "w2-full")})


@pytest.mark.slow
def test_two_and_three_ranks_into_one_process_bitwise_with_the_whole_state(one):
    fam = {**{s: "w2-rep" for s in ("w2-rep", "w2-z1", "w2-full")}, **{s: "w3-rep" for s in ("w3-rep", "w3-z1",
                                                                                            "w3-full")}}
    _check_against_replicated(one, 1, fam)
    assert one[0]["resumed"]["same_state"]


@pytest.mark.slow
def test_three_ranks_one_process_and_other_modes_into_two_bitwise(two_again):
    fam = {"w3-rep": "w3-rep", "w3-z1": "w3-rep", "w3-full": "w3-rep", "w1-rep": "w1-rep",
           "w2-rep": "w2-rep", "w2-z1": "w2-rep", "w2-full": "w2-rep"}
    _check_against_replicated(two_again, 2, fam)


@pytest.mark.slow
def test_a_damaged_piece_is_refused_on_every_rank_with_nothing_changed(three):
    for r in range(3):
        got = three[r]["tampered"]
        assert got["unchanged"], got
        assert "rank-1-of-2/rest.pt is damaged" in got["msg"] and "nothing was changed" in got["msg"].lower(), got
        assert "saved by 2 ranks with shard_state='full'" in got["msg"] and "this run has 3 ranks" in got["msg"]
    assert "rank 1 failed" in three[0]["tampered"]["msg"] or "is damaged" in three[0]["tampered"]["msg"]


@pytest.mark.slow
def test_saving_on_rank_0_alone_is_refused_at_once_on_both_ranks_naming_each_call(two_again):
    for r in range(2):
        got = two_again[r]["alone"]
        for mode in ("rep", "full"):
            msg = got[mode]
            assert "rank 0: harmony.save" in msg and "rank 1: sm(...)" in msg, msg
            assert "Every rank must call harmony.save" in msg, msg
            assert got[f"{mode}_steps"] == 1 and got[f"{mode}_then"] == 2, got
    left = two_again[0]["alone"]["left"]         # a rank that never comes: named after comm_timeout
    assert left.startswith("harmony.save on rank 0 of 2: not every rank made a collective call"), left


def test_a_checkpoint_of_another_layout_that_cannot_be_read_names_both_layouts(tmp_path):
    model, data, sm = _compile("rep", 1)
    for r in range(2):
        (tmp_path / "ck" / f"rank-{r}-of-2").mkdir(parents=True)
        (tmp_path / "ck" / f"rank-{r}-of-2" / "manifest.json").write_text('{"mode": "full"}')
    with pytest.raises(CheckpointError, match="saved by 2 ranks with shard_state='full'.*this run has 1 rank "
                                              r"\(one process\)"):
        harmony.load(sm, tmp_path / "ck")
    (tmp_path / "pp" / "rank-0-of-2").mkdir(parents=True)
    (tmp_path / "pp" / "rank-0-of-2" / "manifest.json").write_text('{"mode": "pipeline"}')
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks of a pipeline \(each its packs' state\); this run "
                                              r"has 1 rank \(one process\).*manifest.json is not a Harmony"):
        harmony.load(sm, tmp_path / "pp")
    sm.close()


# -- pipelines: a pack's state moves to the rank that now runs it -------------------------------------------------
PIPE_STEPS = 1


def _pipe_compile(world, placement="contiguous", frac=0.5):
    from models import gpt_case
    model, data = gpt_case(batch=8)
    kw = dict(parallel="pipeline", comm_timeout=20, placement=placement) if world > 1 else {}
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * frac), microbatches=4, **kw)
    return model, data, sm


def _mine(sm) -> str:
    """A digest of the state this rank holds (its packs' weights under a pipeline), in name order."""
    sd = sm.training_state_dict()["model"]
    return _digest([sd[n] for n in sorted(sd)])


def _pipe(rank, world, root, loads):
    """Train PIPE_STEPS, save ``root/p<world>``; then each of ``loads``: load, train 2 steps, this rank's digest."""
    model, data, sm = _pipe_compile(world)
    for i in range(PIPE_STEPS):
        sm(*data[i])
    harmony.save(sm, Path(root) / f"p{world}")
    out = {}
    if world == 2:          # the same world, packs placed otherwise: resharded; the union of the ranks' weights
        sm.close()          # is compared with the contiguous placement's own load
        for placement in ("contiguous", "round_robin"):
            model, data, sm = _pipe_compile(world, placement, 0.5 if placement == "contiguous" else 0.3)
            harmony.load(sm, Path(root) / "p2")
            for i in range(PIPE_STEPS, PIPE_STEPS + 2):
                sm(*data[i])
            out[placement] = {n: t.numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
            out[placement + "_names"] = sorted(out[placement])
            sm.close()
        return out
    for src in loads:
        try:
            harmony.load(sm, Path(root) / src)
            for i in range(PIPE_STEPS, PIPE_STEPS + 2):
                sm(*data[i])
            out[src] = _mine(sm) if world > 1 else {n: t.clone() for n, t in sm.training_state_dict()["model"].items()}
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            out[src] = f"{type(e).__name__}: {e}"
    sm.close()
    if world == 1:      # digests of each pipeline rank's names are made by the parent from these
        out = {src: {n: t.numpy().copy() for n, t in v.items()} if isinstance(v, dict) else v
               for src, v in out.items()}
    return out


@pytest.fixture(scope="module")
def pipes(root, two_again):
    """2 pipeline ranks save; one process saves and loads theirs; 3 pipeline ranks load both and their own."""
    two = _spawn(2, _pipe, root, [], timeout=600, pg_timeout=60)
    one = _spawn(1, _pipe, root, ["p1", "p2"], timeout=600, pg_timeout=60)
    three = _spawn(3, _pipe, root, ["p3", "p2", "p1"], timeout=600, pg_timeout=60)
    return two, one, three


@pytest.mark.slow
def test_pipeline_checkpoints_move_packs_between_ranks_bitwise(pipes):
    two, one, three = pipes
    assert all(isinstance(v, dict) for v in two.values()), two
    whole = {p: {n: t for r in (0, 1) for n, t in two[r][p].items()} for p in ("contiguous", "round_robin")}
    assert two[0]["contiguous_names"] != two[0]["round_robin_names"]     # the packs did move
    assert whole["contiguous"].keys() == whole["round_robin"].keys()
    for n, t in whole["contiguous"].items():
        assert t.tobytes() == whole["round_robin"][n].tobytes(), n
    one = one[0]
    assert isinstance(one, dict) and all(isinstance(v, dict) for v in one.values()), one
    for n in one["p1"]:       # a 2-rank pipeline's checkpoint into one process: as its own checkpoint
        assert one["p1"][n].tobytes() == one["p2"][n].tobytes(), n
    for r in range(3):         # 2 ranks and one process into 3: as the 3 ranks' own checkpoint
        got = three[r]
        assert isinstance(got, dict) and got["p3"] == got["p2"] == got["p1"], (r, got)
