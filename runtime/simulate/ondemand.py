"""The ``ondemand`` policy replayed for the simulator: what its runtime fetches and evicts before each op."""
from __future__ import annotations

from collections import OrderedDict

from harmony.runtime.ops import op_of


class OnDemand:
    """What the ``ondemand`` runtime moves, replayed at the granularity of a pack's state of one kind.

    The schedule has no copies: the runtime fetches each parameter, gradient or optimizer
    state an op touches when it is not on the device, on the thread that runs the op, and
    evicts the least recently used state the op does not touch until the op's own bytes
    fit (written back unless it is an unchanged parameter). The replay does the same with
    whole (pack, kind) groups: a forward touches the pack's parameters, a backward its
    parameters and gradients (made by the first backward of the step), a step all three.
    The room at each op is the budget less the activations and transients the memory curve
    predicts there (the curve of an ondemand schedule holds no state). The schedule is
    replayed once first, so the step simulated starts from where the previous one left off.
    """

    def __init__(self, plan, dev, nodes, curve):
        self.plan = plan
        self.lru: OrderedDict[tuple, int] = OrderedDict()    # (pack, kind) -> bytes, least recent first
        self.dirty: set[int] = set()                         # packs whose parameters changed
        self.grads: set[int] = set()                         # packs whose gradients exist
        self.optim: set[int] = set()                         # packs whose optimizer state exists
        taken = curve.peak_at if curve is not None else [0] * len(nodes)
        self.room = [dev.memory - t for t in taken]
        for i, node in enumerate(nodes):                     # the previous step
            if op_of(node).kind == "compute":
                self.touch(i, node)

    def size(self, pack, kind) -> int:
        spec = self.plan.packs[pack]
        return {"params": spec.param_bytes + spec.buffer_bytes, "grads": spec.param_bytes,
                "optim": spec.optim_bytes}[kind]

    def touch(self, i, node) -> tuple[int, int]:
        """Bytes fetched and written back before op ``i`` runs; updates residency to after it."""
        op, pack = op_of(node), node.args[0]
        kinds = list(op.needs(node.kwargs))                  # (a step on host copies touches nothing here)
        exists = {"params": True, "grads": pack in self.grads, "optim": pack in self.optim}
        fetch = [k for k in kinds if exists[k] and (pack, k) not in self.lru]
        # gradients a first backward makes, and optimizer state a first step makes, are new bytes too
        new = [k for k in kinds if not exists[k]]
        need = sum(self.size(pack, k) for k in fetch + new)
        evicted = 0
        for key in list(self.lru):
            if sum(self.lru.values()) + need <= self.room[i]:
                break
            if key[0] == pack and key[1] in kinds:
                continue
            size = self.lru.pop(key)
            if key[1] != "params" or key[0] in self.dirty:
                evicted += size
            if key[1] == "params":
                self.dirty.discard(key[0])
        for k in kinds:
            self.lru[(pack, k)] = self.size(pack, k)
            self.lru.move_to_end((pack, k))
        if op.runs_backward:                                 # it makes the pack's gradients
            self.grads.add(pack)
        if op.steps:                                         # gradients are freed; weights and state changed
            self.grads.discard(pack)
            self.lru.pop((pack, "grads"), None)
            self.optim.add(pack)
            self.dirty.add(pack)
        return sum(self.size(pack, k) for k in fetch), evicted
