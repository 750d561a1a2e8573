"""``save_pretrained(sm, path)``: a compiled module's trained model as a Hugging Face directory, from any mode.

The layout is ``save_pretrained``'s with safetensors: ``config.json`` (and ``generation_config.json``) where the
model has a config, ``model-0000R-of-0000W.safetensors`` files and ``model.safetensors.index.json`` mapping each
weight to its file, so ``AutoModel*.from_pretrained(path)`` reads it as it reads any checkpoint.

Every rank calls it (as ``harmony.save``); what each writes is what it holds:

- one process, and replicated data parallel: rank 0 writes the whole model (one file);
- ``parallel="pipeline"``: each rank its packs' weights and buffers (one file a rank), so no process ever holds
  the whole model, and rank 0 what no pack reads;
- ``shard_state="full"``: the weights are gathered from the ranks' shares (``sm.state_dict()``, on every rank)
  and rank 0 writes them.

A weight two names share (a tied embedding and head) is written once, under its first name, as ``save_pretrained``
does; ``from_pretrained`` ties it again. Non-persistent buffers (a rotary embedding's frequencies) are not written:
the model makes them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError, ConfigError
from harmony.driver.checkpoint.module import entries

INDEX = "model.safetensors.index.json"


def save_pretrained(sm, path) -> Path:
    """Write ``sm``'s trained model to the directory ``path`` in Hugging Face's layout; returns the path."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:      # transformers brings it
        raise ConfigError("save_pretrained needs safetensors: pip install safetensors (or the trainer extra)") from e
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    staged = getattr(sm.plan, "stage", None) is not None
    if getattr(getattr(sm.runtime, "state", None), "shares", None) is not None:
        state = sm.state_dict()           # shard_state="full": gathered from the shares, on every rank (a collective)
        state = {n: t.detach().cpu().contiguous() for n, t in state.items()} if rank == 0 else {}
    else:
        state = _mine(sm, staged) if staged or rank == 0 else {}
    persistent = {n for n, _ in entries(sm.model)}      # (reads no value: a pipeline's model holds placeholders)
    state = _untied({n: t for n, t in state.items() if n in persistent})
    files = world if staged else 1
    name = f"model-{rank + 1:05d}-of-{files:05d}.safetensors"
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    error = None
    try:
        if state:
            save_file(state, str(target / name), metadata={"format": "pt"})
            written = dict.fromkeys(state, name)
    except OSError as e:
        error = f"rank {rank}: {e}"
    every = [None] * world
    if world > 1:
        dist.all_gather_object(every, (written, error), group=sm.handshake.group)
    else:
        every = [(written, error)]
    errors = [e for _, e in every if e]
    if errors:
        raise CheckpointError(f"save_pretrained to {target}: {'; '.join(errors)}")
    if rank == 0:
        weight_map = {k: v for w, _ in every for k, v in w.items()}
        total = sum(os.path.getsize(target / f) for f in set(weight_map.values()))
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True))
        config = getattr(sm.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(target)
        generation = getattr(sm.model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(target)
    if world > 1:
        dist.barrier(group=sm.handshake.group)      # the index is there when any rank returns
    return target


def _mine(sm, staged: bool) -> dict[str, torch.Tensor]:
    """What this rank writes, by the model's names: a pipeline rank's own tensors, or the whole model's."""
    if staged:
        return {n: t.detach().cpu().contiguous() for n, t in sm.training_state_dict()["model"].items()}
    return {n: t.detach().cpu().contiguous() for n, t in sm.state_dict().items()}


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name a storage (safetensors refuses tensors that share memory; from_pretrained ties them again)."""
    seen, out = set(), {}
    for n, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[n] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
    return out
