"""A Hugging Face Llama trained by a 2-rank pipeline: ``sm.sync_model()`` gives every rank's model every weight, and
its checkpoint loads into one process, every weight and buffer bit for bit,
buffers no pack reads (the rotary embedding's ``original_inv_freq``) included: the first rank's checkpoint holds
them (runtime/tiers/live.py ``unread``). Before, resharding failed: "'model.rotary_emb.original_inv_freq' elements
0:4 are in none of its files". Each rank exports its packs' weights into shards of its own (save_pretrained).

The same for ZeRO-3 (``shard_state="full"``, 2 ranks): its checkpoint loads into one process bit for bit, rotary
buffers included, and save_pretrained gathers one segment of one pack at a time, rank 0 writing it."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from models import _DECODER, _hf_case, hf_small_llama_case, training_state_bytes
from test_collectives import _spawn

import harmony
import harmony.data
from harmony.integrations.pretrained import INDEX, save_pretrained
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
    save_pretrained(sm, Path(root) / "hf", max_shard_size="16KB")      # each rank its packs' weights
    stats = dict(sm.export_stats)
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
    return dict(state=state, brought=brought, whole=whole, after=after, stats=stats)


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
    files = set(json.loads((Path(root) / "hf" / INDEX).read_text())["weight_map"].values())
    counts = [synced[r]["stats"]["files"] for r in (0, 1)]
    assert min(counts) > 1 and files == {f"model-{k:05d}-of-{sum(counts):05d}.safetensors"     # rank 1's numbered
                                         for k in range(1, sum(counts) + 1)}                    # after rank 0's
    assert all(synced[r]["stats"]["peak_bytes"] == 0 for r in (0, 1))     # written from where they live
    _same_model(Path(root) / "hf", one)


def _wide_llama():
    """A Llama whose weights outweigh its activations at 16 tokens, so a budget of a third of its training state
    cuts it into many packs."""
    return _hf_case("LlamaForCausalLM", "LlamaConfig", 8, 0,
                    **{**_DECODER, "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256})


def _zero3(rank, world, root):
    model, data = _wide_llama()
    kw = dict(shard_state="full", comm_timeout=30) if world > 1 else {}
    sm = harmony.compile(model, harmony.data.shard(data[0]) if world > 1 else data[0], microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.3), **kw)
    if world == 1:      # the 2 ranks' checkpoint, into one process alone
        harmony.load(sm, Path(root) / "z3")
        out = {n: t.numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
        sm.close()
        return dict(state=out, steps=sm.steps)
    sm(**harmony.data.shard(data[0]))
    harmony.save(sm, Path(root) / "z3")
    save_pretrained(sm, Path(root) / "hf3", max_shard_size="256KB")     # a pack's segment at a time, rank 0 writes
    stats = dict(sm.export_stats)
    segments = [seg.size * 4 for r in sm.plan.residency.values() if r.shares is not None for seg in r.shares.segments]
    state = {n: t.detach().numpy().copy() for n, t in sm.state_dict().items()}     # gathered, on every rank
    buffers = {n: b.numpy().copy() for n, b in sm.program.gm.named_buffers()}      # the rotary frequencies too
    sm.close()
    return dict(state=state, buffers=buffers, stats=stats, segments=segments, steps=sm.steps)


@pytest.mark.slow
def test_save_pretrained_from_zero3_a_segment_at_a_time_and_its_checkpoint_into_one_process():
    root = tempfile.mkdtemp()
    ranks = _spawn(2, _zero3, root, timeout=600, pg_timeout=60)
    assert all(isinstance(v, dict) for v in ranks.values()), ranks
    trained = ranks[0]["state"]
    weights = sum(t.nbytes for t in trained.values())
    for r in (0, 1):       # every rank held one gathered segment at a time, never the model
        stats, segments = ranks[r]["stats"], ranks[r]["segments"]
        assert len(segments) > 2 and stats["peak_bytes"] <= max(segments) < weights / 2, (stats, segments, weights)
    assert ranks[0]["stats"]["files"] > 2 and ranks[1]["stats"]["files"] == 0      # rank 0 writes
    _same_model(Path(root) / "hf3", trained)
    one = _spawn(1, _zero3, root, timeout=600, pg_timeout=60)[0]
    assert isinstance(one, dict), one
    assert one["steps"] == 1
    both = {**ranks[0]["buffers"], **trained}
    assert one["state"].keys() == both.keys()
    assert any("rotary_emb" in n for n in one["state"])
    for n, t in one["state"].items():
        assert t.tobytes() == both[n].tobytes(), n


def _same_model(path: Path, weights: dict) -> None:
    """``path`` loads with from_pretrained into ``weights`` bit for bit, and generates what they generate."""
    import torch
    import transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(path)
    for n, t in back.state_dict().items():
        assert t.numpy().tobytes() == weights[n].tobytes(), n
    fresh = transformers.AutoModelForCausalLM.from_config(back.config)
    fresh.load_state_dict({n: torch.from_numpy(t) for n, t in weights.items()}, strict=False)
    prompt = torch.randint(0, back.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    a = back.generate(prompt, max_new_tokens=5, do_sample=False)
    b = fresh.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)
