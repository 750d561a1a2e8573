"""``save_pretrained(sm, path)``: a compiled module's trained model as a Hugging Face directory, from any mode.

The layout is ``save_pretrained``'s with safetensors: ``config.json`` (and ``generation_config.json``) where the
model has a config, and ``model.safetensors``, or for several shards ``model-0000K-of-0000N.safetensors`` files
and ``model.safetensors.index.json`` mapping each weight to its file, so ``AutoModel*.from_pretrained(path)`` reads
it as it reads any checkpoint.

It is written pack by pack, so a model bigger than the host's memory can be exported: a shard's header is written
from the weights' shapes before any is read, then each weight's bytes as it is read (``shards.ShardWriter``), and
only one read's weights are held at a time:

- weights in memory (host masters, device copies) are written from where they are;
- weights on the disk tier are read one file (``disk_group_bytes`` of weights) at a time, their optimizer state
  not at all;
- ``shard_state="full"``: every rank takes part in the gather of one segment of one pack at a time (its chunks read
  from disk where they live there), and rank 0 writes it and drops it;
- ``parallel="pipeline"``: each rank writes its packs' weights into shards of its own (rank 0 also what no pack
  reads), numbered after the ranks before it's;
- one process, and replicated data parallel: rank 0 writes.

Shards are filled up to ``max_shard_size`` (bytes, or "500MB"; ``save_pretrained``'s default, "50GB"), or with
``max_shard_size=None`` hold a pack each; either way what is held at once is one read, never a shard.
``sm.export_stats`` says what the last export wrote and the most bytes it held at once beyond the runtime's own.

A weight two names share (a tied embedding and head) is written once, under its first name, as ``save_pretrained``
does; ``from_pretrained`` ties it again. Non-persistent buffers (a rotary embedding's frequencies) are not written:
the model makes them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from harmony.base.errors import CheckpointError
from harmony.driver.checkpoint.module import entries
from harmony.driver.guard import guarded
from harmony.integrations.shards import Entry, ShardWriter, file_name, plan, shard_bytes
from harmony.runtime.comm import failures
from harmony.runtime.placeholders import is_placeholder
from harmony.runtime.tiers.live import LiveState

INDEX = "model.safetensors.index.json"


@dataclass
class Read:
    """Weights read together: their graph names in the order ``read(held)`` yields (name, tensor) pairs, the unit
    (pack) they belong to, and whether this rank writes them (a ZeRO-3 rank other than 0 only takes part)."""

    names: list[str]
    read: Callable[["Held"], Iterator[tuple[str, torch.Tensor]]]
    unit: object
    writes: bool = True


class Held:
    """The bytes an export holds beyond the runtime's own tensors: now, and the most at once."""

    def __init__(self):
        self.now = self.peak = 0

    def set(self, n: int) -> None:
        self.now = n
        self.peak = max(self.peak, n)

    def also(self, n: int) -> None:
        self.peak = max(self.peak, self.now + n)


@guarded("save_pretrained", reads=True)
def save_pretrained(sm, path, *, max_shard_size="50GB") -> Path:
    """Write ``sm``'s trained model to the directory ``path`` in Hugging Face's layout; returns the path. Every rank
    calls it. ``max_shard_size``: the most bytes a shard file holds (a weight larger than it alone in its file);
    None: a file a pack."""
    import torch.distributed as dist
    limit = shard_bytes(max_shard_size)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    group = sm.handshake.group if world > 1 else None
    target = Path(path)
    reads, out_name, specs = _reads(sm, rank)
    mine = [Entry(out_name[n], tuple(specs[n].shape), specs[n].dtype, r.unit)
            for r in reads if r.writes for n in r.names if n in out_name]
    error = None
    try:
        shards = plan(mine, limit)
    except CheckpointError as e:
        shards, error = [], f"rank {rank}: {e}"
    counts = _everyones(world, group, (len(shards), error))
    _raise_any(target, [e for _, e in counts])
    total, first = sum(c for c, _ in counts), sum(c for c, _ in counts[:rank])
    error = None
    if rank == 0:
        try:
            target.mkdir(parents=True, exist_ok=True)
            _remove_stale(target)
        except OSError as e:
            error = f"rank 0: {e}"
    _raise_any(target, _everyones(world, group, error))     # no rank writes before rank 0 cleared the directory
    held = Held()
    written, error = _write(target, reads, out_name, shards, first, total, held)
    every = _everyones(world, group, (written, error))
    _raise_any(target, [e for _, e in every])
    if rank == 0:
        weight_map = {k: v for w, _ in every for k, v in w.items()}
        _finish(sm, target, weight_map, total)
    sm.export_stats = {"files": len(shards), "bytes": sum(s.nbytes for s in shards), "peak_bytes": held.peak,
                       "reads": len(reads)}
    if world > 1:
        failures.guarded("save_pretrained's barrier", dist.barrier, group=group)   # every file and the index are there
    return target


def _write(target: Path, reads: list[Read], out_name: dict, shards, first: int, total: int, held: Held):
    """Every read consumed in order (a ZeRO-3 gather is a collective: every rank reads all of it), this rank's
    tensors written into its shards as they come. Returns ({name: file}, error or None)."""
    files = _Files(target, shards, first, total, held)
    for r in reads:
        for name, value in r.read(held):
            if r.writes and name in out_name:
                files.put(out_name[name], value)
            value = None        # a read's buffer is freed once its last tensor is written, before the next read
    files.close()
    return files.written, files.error


class _Files:
    """This rank's shard files, each opened when its first tensor comes and closed when the next shard's does; the
    first error stops the writing (the reads go on: the other ranks' collectives need this one)."""

    def __init__(self, target: Path, shards, first: int, total: int, held: Held):
        self.target, self.shards, self.first, self.total, self.held = target, shards, first, total, held
        self.shard_of = {e.name: i for i, s in enumerate(shards) for e in s.entries}
        self.written: dict[str, str] = {}
        self.writer, self.current, self.error = None, None, None

    def put(self, name: str, value: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            i = self.shard_of[name]
            if i != self.current:
                self.close()
                self.current, self.name = i, file_name(self.first + i, self.total)
                self.writer = ShardWriter(self.target / self.name, self.shards[i])
            self.held.also(self.writer.add(name, value))
            self.written[name] = self.name
        except (OSError, CheckpointError) as e:
            self.error = str(e)
            if self.writer is not None:
                self.writer.abandon()
            self.writer = None

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None and self.error is None:
            try:
                writer.close()
            except (OSError, CheckpointError) as e:
                self.error = str(e)


def _finish(sm, target: Path, weight_map: dict, total: int) -> None:
    """Rank 0: the index (several shards) and the model's config files."""
    if total > 1:
        size = sum(os.path.getsize(target / f) for f in set(weight_map.values()))
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map},
                                               indent=2, sort_keys=True))
    config = getattr(sm.model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(target)
    generation = getattr(sm.model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(target)


def _remove_stale(target: Path) -> None:
    """A previous export's shards and index (from_pretrained would read a stale model.safetensors first)."""
    for f in target.iterdir():
        if f.name == INDEX or (f.name.startswith("model") and f.name.endswith(".safetensors")):
            f.unlink()


def _everyones(world: int, group, mine) -> list:
    if world == 1:
        return [mine]
    import torch.distributed as dist
    every = [None] * world
    failures.guarded("save_pretrained's exchange of the files each rank wrote", dist.all_gather_object, every, mine,
                     group=group)
    return every


def _raise_any(target: Path, errors: list) -> None:
    errors = [e for e in errors if e]
    if errors:
        raise CheckpointError(f"save_pretrained to {target}: {'; '.join(errors)}. The directory may hold part of "
                              f"the export: fix this and call save_pretrained again on every rank")


# -- where each weight is read from ----------------------------------------------------------------------------
def _graph_tensors(sm) -> dict[str, torch.Tensor]:
    gm = sm.program.gm
    return {**dict(gm.named_parameters()), **dict(gm.named_buffers())}


def _model_own(sm) -> dict[str, torch.Tensor]:
    """The model's weights no traced graph holds (by the model's names): the model's own tensors, first names."""
    traced = {id(t) for t in _graph_tensors(sm).values()}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for n, t in entries(sm.model):
        if id(t) not in traced and id(t) not in seen:
            seen.add(id(t))
            out[n] = t
    return out


def _reads(sm, rank: int) -> tuple[list[Read], dict[str, str], dict[str, torch.Tensor]]:
    """What this rank reads, in order; the name each tensor read is written under (the first of the model's names
    for it; a tensor the model keeps out of its state dict has none); and each one's tensor (its shape and dtype,
    a placeholder where the weights live elsewhere)."""
    graph = _graph_tensors(sm)
    model = entries(sm.model)
    first: dict[int, str] = {}
    for n, t in model:
        first.setdefault(id(t), n)
    named = {n for n, _ in model}
    out_name: dict[str, str] = {}
    used: set[str] = set()
    for n, t in graph.items():
        out = first.get(id(t), n if n in named else None)
        if out is not None and out not in used:     # a name written once
            out_name[n] = out
            used.add(out)
    own = {n: t for n, t in _model_own(sm).items() if n not in used}
    out_name.update({n: n for n in own})
    live = LiveState(sm)      # (it waits for any optimizer step still writing the weights)
    shares = getattr(live.tiers, "shares", None)
    staged = getattr(sm.plan, "stage", None) is not None
    if shares is not None:
        reads = _share_reads(shares, graph, rank)
        pieces = {piece.name for r in shares.plan.residency.values() if r.shares is not None
                  for piece in r.shares.pieces}
        rest = [n for n in live.tensors if n not in pieces]
        reads += _live_reads(live, [(None, rest)], rank == 0)
    else:
        reads = _live_reads(live, [(pack, names) for _, pack, names in live.layout()], staged or rank == 0)
    plain = [n for n in own if not is_placeholder(own[n])]
    if plain and rank == 0:
        reads.append(Read(plain, lambda held: ((n, own[n]) for n in plain), unit="model"))
    return reads, out_name, {**graph, **own}


def _live_reads(live: LiveState, layout, writes: bool) -> list[Read]:
    """Per pack: its weights in memory, read where they are, then each of its disk files (runtime/tiers/params_disk)
    read alone."""
    if not writes:
        return []
    pdisk = live.pdisk
    reads = []
    for pack, names in layout:
        here = [n for n in names if pdisk is None or not pdisk.holds(n)]
        if here:
            reads.append(Read(here, lambda held, here=here: ((n, live.tensors[n].data) for n in here), pack))
        files: dict[int, list[str]] = {}
        for n in names:
            if pdisk is not None and pdisk.holds(n):
                files.setdefault(pdisk.pack_of[n], []).append(n)
        for gid, ns in files.items():
            order = [n for n in pdisk.groups[gid] if n in set(ns)]
            reads.append(Read(order, lambda held, gid=gid, order=order: _disk_file(pdisk, gid, order, held), pack))
    return reads


def _disk_file(pdisk, gid: int, names: list[str], held: Held):
    values = pdisk.read_weights(gid)
    kept = gid in pdisk.in_memory
    held.set(0 if kept else _storage_bytes(values.values()))
    for n in names:
        yield n, values[n]
    del values
    held.set(0)


def _share_reads(shares, graph: dict, rank: int) -> list[Read]:
    """``shard_state="full"``: a read a pack, gathered a segment at a time on every rank; rank 0 writes it."""
    reads = []
    for p, record in sorted(shares.plan.residency.items()):
        if record.shares is not None:
            names = [n for seg in record.shares.segments for n, _, _ in seg.items()]
            reads.append(Read(names, lambda held, p=p: _gathered(shares, p, graph, held), p, writes=rank == 0))
    return reads


def _gathered(shares, p: int, graph: dict, held: Held):
    on_disk = not shares.in_memory(p)
    chunks = shares.load(p)
    mine = _storage_bytes(chunks) if on_disk else 0
    with torch.no_grad():
        for s, seg in enumerate(shares.plan.at(p).shares.segments):
            flat = shares.gather(p, s, chunks[s])
            held.set(mine + _storage_bytes([flat]))
            for n, off, k in seg.items():
                yield n, flat[off: off + k].view(graph[n].shape)
            del flat
    held.set(0)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
