"""Safetensors shards written tensor by tensor, as an export reads them (``pretrained.save_pretrained``).

A shard's header (every tensor's name, dtype, shape and place) is written first, from what the export knows before
it reads anything (the shapes and dtypes of the traced graph's tensors); each tensor's bytes follow as soon as it is
read, in the order it is read, and are dropped: the writer never holds a shard, only the tensor it is writing.
``safetensors.torch.save_file`` takes a whole shard and copies it into one bytes object first.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError
from harmony.base.units import parse_bytes

SINGLE = "model.safetensors"      # one shard: save_pretrained's name for it, without an index

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


@dataclass
class Entry:
    """One tensor of the export: its name in the file, shape, dtype and the unit (a pack) it is read with."""

    name: str
    shape: tuple
    dtype: torch.dtype
    unit: object = None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class Shard:
    entries: list[Entry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def shard_bytes(max_shard_size) -> int | None:
    """``max_shard_size`` as bytes (an int, or a string like "500MB"); None: a shard per pack."""
    return None if max_shard_size is None else parse_bytes(max_shard_size, "max_shard_size")


def plan(entries: list[Entry], max_bytes: int | None) -> list[Shard]:
    """The shards, in the order the entries come: a shard per unit (pack), or with ``max_bytes`` filled up to it
    (a tensor larger than it alone in its shard), as ``save_pretrained(max_shard_size=)`` fills them."""
    shards: list[Shard] = []
    for e in entries:
        if e.dtype not in _DTYPES:
            raise CheckpointError(f"{e.name} is {e.dtype}, which safetensors cannot store")
        last = shards[-1] if shards else None
        if last is None or (max_bytes is None and last.entries[-1].unit != e.unit) \
                or (max_bytes is not None and last.entries and last.nbytes + e.nbytes > max_bytes):
            shards.append(Shard())
        shards[-1].entries.append(e)
    return shards


def file_name(index: int, total: int) -> str:
    """``save_pretrained``'s names: model.safetensors alone, else model-0000K-of-0000N.safetensors (K from 1)."""
    return SINGLE if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


class ShardWriter:
    """One shard's file: its header at once, then each tensor's bytes as it comes, in the header's order."""

    def __init__(self, path: Path, shard: Shard):
        self.path, self.entries, self.next = path, shard.entries, 0
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for e in shard.entries:
            header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
            at += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)       # the tensors' bytes start 8-byte aligned, as safetensors writes them
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)

    def add(self, name: str, value: torch.Tensor) -> int:
        """Write ``value`` as the next tensor (it must be the next in the header); returns the bytes of any copy
        made for it (from a device, or of a tensor not laid out contiguously)."""
        e = self.entries[self.next]
        if name != e.name or tuple(value.shape) != tuple(e.shape) or value.dtype != e.dtype:
            raise CheckpointError(f"{self.path.name}: expected {e.name} {tuple(e.shape)} {e.dtype}, read {name} "
                                  f"{tuple(value.shape)} {value.dtype}; the model changed during the export")
        t = value.detach()
        copied = t.device.type != "cpu" or not t.is_contiguous()
        t = t.to("cpu").contiguous()
        if t.numel():
            self.file.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.next += 1
        return e.nbytes if copied else 0

    def close(self) -> None:
        """Flush and fsync the file; every tensor of the header must have been written."""
        try:
            if self.next != len(self.entries):
                missing = [e.name for e in self.entries[self.next:]]
                raise CheckpointError(f"{self.path.name}: {missing[:3]} were never read")
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def abandon(self) -> None:
        self.file.close()
