"""Plan misses learned: the next compile of a model leaves room for what its last plan under-predicted.

When a step goes over the budget (a *plan miss*: the runtime's safety net, runtime/safety.py, absorbs it and
``sm.stats["plan_misses"]`` counts it), ``learn`` records by how much the op's measured peak exceeded the plan's
prediction for it, under a fingerprint of the traced graph, the batch and the options that shape the plan
(``fingerprint``). A later ``harmony.compile`` of the same model with the same options in this process, with
``plan_margin="auto"`` (the default), plans with that many bytes of the budget left unplanned
(``CompileConfig.usable_budget``), so it plans around the miss instead of meeting it again. A margin the user sets
wins over the learned one. Kept for the life of the process, like the cost model's measurements
(compiler/measured.py).

>>> from harmony.driver import misses
>>> misses.forget()        # the next compile plans without what earlier steps learned
"""
from __future__ import annotations

import hashlib

_LEARNED: dict[str, dict] = {}    # fingerprint -> {"margin": bytes, "misses": count}

# the options a plan depends on, besides the graph and the batch (the budget first)
_OPTIONS = ("memory_budget", "microbatches", "policy", "precision", "optimizer", "optimizer_kwargs", "param_groups",
            "recompute", "optimizer_on", "weights_on", "host_memory_budget", "shard_state", "world_size", "rank",
            "device", "device_reserved", "loss_fn", "clip_grad_norm")


def fingerprint(gm, batch, cfg) -> str:
    """A digest of the traced graph ``gm`` (its code and every parameter's and buffer's name, shape and dtype), the
    batch's shapes and dtypes, and the options that shape its plan (``cfg``, the budget among them)."""
    h = hashlib.sha256(gm.code.encode())
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    for t in batch:
        h.update(f"{tuple(getattr(t, 'shape', ()))}:{getattr(t, 'dtype', type(t).__name__)};".encode())
    for key in _OPTIONS:
        value = getattr(cfg, key, None)
        h.update(f"{key}={getattr(value, '__qualname__', None) or repr(value)};".encode())
    return h.hexdigest()


def resolve(cfg) -> None:
    """``cfg.plan_margin`` in bytes: the user's, or under ``"auto"`` what this process learned for ``cfg.plan_key``
    (0 if nothing); ``cfg.margin_learned`` says which. Over several ranks ``"auto"`` is 0: each process learns its
    own misses, and ranks that learned different margins would plan different packs (set ``plan_margin`` there,
    the same on every rank)."""
    if cfg.plan_margin != "auto":
        return
    record = _LEARNED.get(cfg.plan_key) if (cfg.world_size or 1) == 1 else None
    cfg.plan_margin = record["margin"] if record else 0
    cfg.margin_learned = record is not None


def learn(key: str | None, misses: dict, predicted, events) -> int:
    """Record a step's plan misses (``SafetyNet.misses``) under ``key``: the margin is the largest amount by which a
    missed op's peak exceeded the plan's prediction for it (``predicted``, the step's ``MemoryCurve``), its peak
    being what it measured plus what the net released during it (or, for an op that failed, the most bytes live
    when it crossed the budget), and at least the bytes it went over the budget. Returns the margin now learned."""
    if key is None or not misses:
        return 0
    at = {node.name: peak for node, peak in zip(predicted.nodes, predicted.peak_at)}
    measured = {e.name: e.peak_bytes for e in events}
    margin = 0
    for miss in misses.values():
        peak = max(measured.get(miss.op, 0) + miss.released, miss.reached)
        margin = max(margin, peak - at.get(miss.op, peak), miss.over)
    record = _LEARNED.setdefault(key, {"margin": 0, "misses": 0})
    record["margin"] = max(record["margin"], margin)
    record["misses"] += sum(m.times for m in misses.values())
    return record["margin"]


def learned(key: str | None) -> dict | None:
    """What this process learned for ``key`` ({"margin": bytes, "misses": count}), or None."""
    record = _LEARNED.get(key)
    return dict(record) if record else None


def forget() -> None:
    """Drop every learned margin (a test that counts misses starts from none)."""
    _LEARNED.clear()
