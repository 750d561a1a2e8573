"""A Hugging Face Llama trained by a 2-rank pipeline: ``sm.sync_model()`` gives every rank's model every weight, and
its checkpoint loads into one process, every weight and buffer bit for bit,
buffers no pack reads (the rotary embedding's ``original_inv_freq``) included: the first rank's checkpoint holds
them (runtime/tiers/live.py ``unread``). Before, resharding failed: "'model.rotary_emb.original_inv_freq' elements
0:4 are in none of its files"."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from models import hf_small_llama_case, training_state_bytes
from test_collectives import _spawn

import harmony
from harmony.errors import OffloadError


def _compile(world):
    model, data = hf_small_llama_case(batch=8)
    kw = dict(parallel="pipeline", comm_timeout=30) if world > 1 else {}
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.8), microbatches=4, **kw)
    return data, sm


def _run(rank, world, root):
    data, sm = _compile(world)
    if world == 1:
        harmony.load(sm, Path(root) / "p2")
        state = {n: t.numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
        sm.close()
        return state
    sm(**data[0])
    harmony.save(sm, Path(root) / "p2")
    state = {n: t.numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
    brought = sm.sync_model()        # every rank's model: the whole trained model
    whole = {n: t.detach().numpy().copy() for n, t in sm.model.state_dict().items()}
    sm(**data[1])                    # the others' weights are stale now: placeholders again
    try:
        sm.model.state_dict()
        after = "read"
    except OffloadError as e:
        after = str(e)
    sm.close()
    return dict(state=state, brought=brought, whole=whole, after=after)


@pytest.mark.slow
def test_a_pipelines_checkpoint_of_a_hf_llama_loads_into_one_process_bitwise():
    root = tempfile.mkdtemp()
    two = _spawn(2, _run, root, timeout=600, pg_timeout=60)
    assert all(isinstance(v, dict) for v in two.values()), two
    one = _spawn(1, _run, root, timeout=600, pg_timeout=60)[0]
    assert isinstance(one, dict), one
    synced, two = two, {r: v["state"] for r, v in two.items()}
    assert not two[0].keys() & two[1].keys()          # each tensor on one rank
    whole = {**two[0], **two[1]}
    assert whole.keys() == one.keys()
    assert any("original_inv_freq" in n for n in two[0])    # read by no pack: the first rank holds it
    for n, t in one.items():
        assert t.tobytes() == whole[n].tobytes(), n
    for r in (0, 1):          # sm.sync_model() under the pipeline: each rank's model is the whole model
        assert set(synced[r]["brought"]) == two[1 - r].keys()     # (non-persistent buffers are in no state_dict)
        assert synced[r]["whole"].keys() <= one.keys() | {"lm_head.weight"}
        for n, t in synced[r]["whole"].items():
            assert t.tobytes() == one[n].tobytes(), (r, n)
        assert "other pipeline ranks" in synced[r]["after"]
