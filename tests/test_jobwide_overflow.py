"""Issue 61: fp16 loss scaling over several ranks skips a step on every rank or on none.

A rank that keeps only its share of the state (``shard_state=True`` or ``"full"``) checks the gradients it updates;
an inf or nan in one rank's share alone must still skip the step on every rank and lower every rank's loss scale
(a meet of the ranks' words, runtime/precision.py), or the ranks' states and scales part ways for good.

The model adds ``(poke * k.mean(0)).sum()`` to its loss: ``poke``'s gradient is ``k``'s column means, so a batch
whose ``k`` is huge in one column makes one element of one tensor overflow, in one rank's share only.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import harmony
import harmony.data
from test_collectives import _digest, spawn_ok

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1))
WIDTH = 64


class Poked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
        self.head = nn.Linear(WIDTH, 4)
        self.poke = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x, y, k):
        return F.cross_entropy(self.head(self.body(x)), y) + (self.poke * k.mean(0)).sum()


def _batches(world, steps=4):
    g = torch.Generator().manual_seed(3)
    rows = 4 * world
    data = [(torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g),
             torch.full((rows, WIDTH), 0.01)) for _ in range(steps)]
    data[1][2][:, WIDTH - 1] = 1e6         # step 1: poke's last element overflows fp16 at any scale used here
    return data


def _train(rank, world, kw):
    torch.manual_seed(0)
    model = Poked()
    data = _batches(world)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, precision="fp16",
                         loss_scaling=dict(init_scale=2.0 ** 8), comm_timeout=60, **{**SGD, **kw})
    scales, digests = [], []
    for batch in data:
        sm(*harmony.data.shard(batch))
        scales.append(sm.loss_scale)
        sm.sync_model()
        digests.append(_digest([p.detach() for p in model.parameters()]))
    skipped = sm.stats["skipped_steps"]
    sm.close()
    return dict(scales=scales, digests=digests, skipped=skipped)


def _ranks(rank, world):
    return {name: _train(rank, world, kw) for name, kw in
            (("replicated", {}), ("zero1", dict(shard_state=True)), ("full", dict(shard_state="full")))}


def test_an_overflow_in_one_ranks_share_skips_the_step_on_every_rank():
    res = spawn_ok(2, _ranks, timeout=300)
    want = res[0]["replicated"]
    assert want["skipped"] == 1 and want["scales"][1] == want["scales"][0] / 2, want   # the overflow is real
    assert want["digests"][1] == want["digests"][0] != want["digests"][2], want          # step 1 updated nothing
    for name in ("zero1", "full"):
        for r in (0, 1):
            got = res[r][name]
            assert got["skipped"] == 1, (name, r, got)
            assert got["scales"] == want["scales"], (name, r, got["scales"], want["scales"])
            assert got["digests"] == want["digests"], (name, r)


def _fails_after_the_last_collective(rank, world):
    """Rank 1's step fails once every collective of its schedule is done, as the held updates are about to be
    checked (a Ctrl-C there): rank 0 has nothing left to meet but the overflow agreement, which rank 1 replays."""
    torch.manual_seed(0)
    model = Poked()
    data = _batches(world)
    data[1][2][:, WIDTH - 1] = 0.01
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, precision="fp16",
                         loss_scaling=dict(init_scale=2.0 ** 8), comm_timeout=30, shard_state="full", **SGD)
    sm(*harmony.data.shard(data[0]))
    scaler, real = sm.runtime.scaler, sm.runtime.scaler.overflowed

    def interrupted():
        raise KeyboardInterrupt
    if rank == 1:
        scaler.overflowed = interrupted
    try:
        sm(*harmony.data.shard(data[1]))
        raised = None
    except BaseException as e:      # noqa: BLE001 (Ctrl-C)
        raised = f"{type(e).__name__}: {e}"
    scaler.overflowed = real
    sm(*harmony.data.shard(data[2]))
    sm.sync_model()
    out = dict(raised=raised, steps=sm.steps, scale=sm.loss_scale,
               digest=_digest([p.detach() for p in model.parameters()]))
    sm.close()
    return out


def test_a_rank_failing_after_its_last_collective_is_heard_at_the_overflow_agreement():
    res = spawn_ok(2, _fails_after_the_last_collective, timeout=200)
    assert res[1]["raised"].startswith("KeyboardInterrupt"), res[1]
    assert res[0]["raised"].startswith("StepAbortedError") and "rank 1" in res[0]["raised"], res[0]
    assert res[0]["steps"] == res[1]["steps"] == 2 and res[0]["digest"] == res[1]["digest"], res
    assert res[0]["scale"] == res[1]["scale"], res
