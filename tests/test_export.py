"""``save_pretrained(sm, dir)`` pack by pack: weights on the disk tier are read one file at a time (the disk tier's
own buffer accounting shows it), the shards load with ``from_pretrained`` bit for bit, and the shard files are
safetensors as ``safetensors`` reads them. ZeRO-3 and the pipeline: tests/test_pipeline_to_one.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import hf_small_llama_case, training_state_bytes
from test_pipeline_to_one import _same_model

import harmony
import harmony.data
from harmony.errors import CheckpointError, ClosedError, ConfigError
from harmony.integrations.pretrained import INDEX, save_pretrained
from harmony.integrations.shards import Entry, Shard, ShardWriter
from harmony.runtime.tiers.iobuffers import align_up


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    """A Llama trained one step with every pack's weights in files between steps, a file per 8 KiB of weights."""
    model, data = hf_small_llama_case(batch=8)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.8), microbatches=4,
                         weights_on="disk", optimizer_on="host", disk_group_bytes=8192,
                         offload_dir=tmp_path_factory.mktemp("offload"))
    sm(**data[0])
    yield sm
    sm.close()


def _file_bytes(sm, gid: int) -> int:
    """The bytes of a disk file's weights (the part an export reads), as the disk tier's buffers round them."""
    gm = sm.program.gm
    return align_up(sum(gm.get_parameter(n).numel() * 4 for n in sm.runtime.state.params_disk.groups[gid]))


@pytest.mark.slow
def test_weights_on_disk_are_exported_a_file_at_a_time_and_load_bitwise(on_disk, tmp_path):
    sm = on_disk
    pdisk = sm.runtime.state.params_disk
    assert set(sm.plan.by_pack("master_on").values()) == {"disk"} and len(pdisk.groups) > 4
    trained = {n: t.numpy().copy() for n, t in sm.state_dict().items()}
    weights = sum(t.nbytes for t in trained.values())
    largest = max(_file_bytes(sm, g) for g in range(len(pdisk.groups)))
    buffers = pdisk.store.buffers
    buffers.reset_peak()
    before = buffers.in_use
    out = save_pretrained(sm, tmp_path / "hf", max_shard_size=None)      # a file a pack
    grew = buffers.peak - before        # the disk tier's own count of the buffers read into
    assert 0 < grew <= largest < weights / 4, (grew, largest, weights)
    assert sm.export_stats["peak_bytes"] <= largest
    assert sm.export_stats["bytes"] == weights
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"]) == trained.keys()
    assert len(set(index["weight_map"].values())) == len(sm.plan.packs) == sm.export_stats["files"]
    _same_model(out, trained)
    # the old export, sm.state_dict(), read every file whole (weights and optimizer state) before writing any
    buffers.reset_peak()
    before = buffers.in_use
    sm.state_dict()
    assert buffers.peak - before > 2 * weights


@pytest.mark.slow
def test_max_shard_size_fills_shards_up_to_it(on_disk, tmp_path):
    sm = on_disk
    trained = {n: t.numpy().copy() for n, t in sm.state_dict().items()}
    out = save_pretrained(sm, tmp_path / "hf", max_shard_size="8KB")
    index = json.loads((out / INDEX).read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) == sm.export_stats["files"] > len(sm.plan.packs)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        held = [n for n, g in index.items() if g == f]
        assert len(held) == 1 or sum(trained[n].nbytes for n in held) <= 8000, (f, held)
    _same_model(out, trained)
    again = save_pretrained(sm, out)      # save_pretrained's default: one file, model.safetensors; the old ones gone
    assert sorted(p.name for p in again.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    _same_model(again, trained)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["lots", 0, -5, float("nan")])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(on_disk, tmp_path, size):
    with pytest.raises(ConfigError, match="max_shard_size"):
        save_pretrained(on_disk, tmp_path / "hf", max_shard_size=size)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_an_unwritable_directory_is_a_checkpoint_error(on_disk, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").mkdir()       # a directory where a shard file goes
    with pytest.raises(CheckpointError, match="save_pretrained to"):
        save_pretrained(on_disk, tmp_path / "hf")


def test_shard_files_are_safetensors_files(tmp_path):
    from safetensors.torch import load_file
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "c": torch.tensor(7),
               "d": torch.zeros(0, 3), "e": torch.tensor([True, False, True]), "f": torch.arange(5, dtype=torch.int64),
               "g": torch.randn(6, 4).t()}       # not contiguous: written from a copy
    shard = Shard([Entry(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    writer = ShardWriter(tmp_path / "x.safetensors", shard)
    copies = [writer.add(n, t) for n, t in tensors.items()]
    writer.close()
    assert copies == [0, 0, 0, 0, 0, 0, 96]
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for n, t in tensors.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n


def test_a_tensor_out_of_order_or_missing_is_a_checkpoint_error(tmp_path):
    shard = Shard([Entry("a", (2,), torch.float32), Entry("b", (2,), torch.float32)])
    writer = ShardWriter(tmp_path / "x.safetensors", shard)
    with pytest.raises(CheckpointError, match="expected a"):
        writer.add("b", torch.zeros(2))
    with pytest.raises(CheckpointError, match="expected a .* read a \\(3,\\)"):
        writer.add("a", torch.zeros(3))
    writer.add("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="never read"):
        writer.close()


def _tied_shares_on_disk(rank, world, root):
    from test_zero3 import _compile
    model, data, sm = _compile(4 * world, tie=True, shard_state="full", weights_on="disk", optimizer_on="host",
                               offload_dir=root, loss_weighting="rows")
    sm(*harmony.data.shard(data[0]))
    on_disk = sm.runtime.state.disk is not None and not any(sm.runtime.state.shares.in_memory(p)
                                                             for p in sm.runtime.state.disk.pack_of.values())
    save_pretrained(sm, Path(root) / "out", max_shard_size=None)     # a file a pack
    stats = dict(sm.export_stats)
    state = {n: t.numpy().copy() for n, t in sm.state_dict().items()}
    sm.close()
    return dict(stats=stats, state=state, on_disk=on_disk)


@pytest.mark.slow
def test_zero3_with_its_shares_on_disk_and_a_tied_head_exports_each_weight_once(tmp_path):
    """shard_state="full" with each rank's chunks in files (runtime/partitioned/disk.py): the export reads them
    pack by pack; the embedding and the head are one weight, written once under the model's first name for it."""
    from safetensors.torch import load_file
    from test_collectives import _spawn
    ranks = _spawn(2, _tied_shares_on_disk, str(tmp_path), timeout=600, pg_timeout=60)
    assert all(isinstance(v, dict) for v in ranks.values()), ranks
    assert ranks[0]["on_disk"] and ranks[1]["on_disk"]
    state = ranks[0]["state"]
    index = json.loads((tmp_path / "out" / INDEX).read_text())["weight_map"]
    tied = [n for n in state if n not in index]
    assert tied == ["head.weight"] and "tok.weight" in index
    back = {}
    for f in set(index.values()):
        back.update(load_file(tmp_path / "out" / f))
    assert back.keys() == index.keys()
    for n, t in back.items():
        assert t.numpy().tobytes() == state[n].tobytes(), n
    assert ranks[0]["stats"]["files"] == len(set(index.values())) > 2 and ranks[1]["stats"]["files"] == 0


def test_a_model_without_a_config_exports_its_weights_once_and_a_closed_one_is_refused(tmp_path):
    """The built-in GPT (no Hugging Face config; tied embedding and head) with its weights on disk: the files hold
    each weight once, bit for bit; after sm.close() the files are gone and the export is a ClosedError."""
    from safetensors.torch import load_file
    from test_disk_params import DATA, compile_gpt
    sm = compile_gpt(offload_dir=tmp_path)
    sm(*DATA[0])
    trained = {n: t.clone() for n, t in sm.state_dict().items()}
    out = save_pretrained(sm, tmp_path / "gpt", max_shard_size=None)
    assert not (out / "config.json").exists()
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert [n for n in trained if n not in index] == ["head.weight"]       # tied to tok.weight: written once
    back = {}
    for f in set(index.values()):
        back.update(load_file(out / f))
    assert back.keys() == index.keys() and all(torch.equal(back[n], trained[n]) for n in back)
    sm.close()
    with pytest.raises(ClosedError, match="save_pretrained"):
        save_pretrained(sm, tmp_path / "again")
