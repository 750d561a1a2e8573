"""Measurements the cost model keeps for the life of the process, by signature.

The cost model measures each node (``cost._Measure``) and the partition each candidate pack
(``pack_cost.measure_pack``) on fake tensors. A node or pack whose signature
(``compiler/signature.py``) matches one measured before takes that
measurement's figures: the signature holds everything the measurement depends on (the op or the
leaf module's class and settings, and each argument's shape, dtype, strides, storage and device).
Within one compile that spares the blocks of a model after its first; kept for the process, it
also spares the next compile of the same layers: a new batch shape (``harmony.driver.shapes``), the
evaluation plan, a budget sweep, every rank of a multi-rank run. Planning on the same model then
costs the passes' own work, not the measuring.

>>> from harmony.compiler import measured
>>> measured.forget()       # the next compile measures every distinct node and pack again
"""
from __future__ import annotations

from collections import OrderedDict

LIMIT = 8192    # records (a few hundred bytes each); the least recently used go first


class _Kind:
    """The records of one kind (nodes, packs) as a mapping: ``key in``, ``[key]``, ``[key] = record``."""

    def __init__(self, kind: str):
        self.kind = kind

    def __contains__(self, key) -> bool:
        return (self.kind, key) in _RECORDS

    def __getitem__(self, key) -> dict:
        _RECORDS.move_to_end((self.kind, key))
        return dict(_RECORDS[(self.kind, key)])

    def __setitem__(self, key, record: dict) -> None:
        _RECORDS[(self.kind, key)] = dict(record)
        _RECORDS.move_to_end((self.kind, key))
        while len(_RECORDS) > LIMIT:
            _RECORDS.popitem(last=False)


_RECORDS: OrderedDict = OrderedDict()
NODES = _Kind("node")    # cost._Measure's records: bytes, FLOPs and saved tensors of one node
PACKS = _Kind("pack")    # pack_cost.measure_pack's figures: a pack's peaks, run as the runtime runs it
GRAPHS = _Kind("graph")  # cost.annotate's records of a whole graph at its second microbatch size, by position


def forget() -> None:
    """Drop every kept measurement (a test that counts measurements starts from none)."""
    _RECORDS.clear()
