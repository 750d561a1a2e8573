"""A unit of the partition: the smallest run of model-graph nodes a pack boundary may not cut (a layer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Unit:
    nodes: list
    params: frozenset        # trainable state names
    buffers: frozenset
    fwd_flops: float
    bwd_flops: float
    kept: float              # activation bytes kept for backward, one microbatch
    peak: float              # transient bytes of its forward, one microbatch
    bwd: float               # transient bytes of its backward, one microbatch
    cross_in: float          # activation bytes entering it
