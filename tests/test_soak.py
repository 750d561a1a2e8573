"""Issue 29's soak: a few hundred steps of a small model with faults injected at random points, deterministic under a
seed, ending bitwise equal to eager PyTorch that skipped the same failed steps.

Faults: an exception in a forward or backward op, KeyboardInterrupt raised there, Ctrl-C (a real SIGINT) delivered
after a random op, ENOSPC on every write to the offload directory during a step, and a corrupted checkpoint file
between saves. After each the module must be in a state the eager reference can reach: a rolled-back step is
skipped by both; a step whose updates were all applied (Ctrl-C held until it finished, a write that failed after
every pack stepped) is taken by both; a torn step (some packs updated) is either accepted (eager then updates
exactly those parameters) or undone by loading the last checkpoint (eager goes back to its copy of the same
point). A corrupted checkpoint must be refused with nothing changed, and the next save repairs it.
"""
from __future__ import annotations

import copy
import errno
import os
import random
import signal

import pytest
import torch

import harmony
import harmony.runtime.tiers.disk as disk
from faults import fail_at, schedule_ops
from harmony.errors import CheckpointError
from models import assert_bitwise

STEPS, SEED, MICRO = 200, 29, 4
KINDS = ("none",) * 6 + ("error", "interrupt", "sigint", "enospc", "corrupt")


class Eager:
    """The reference: the same model and optimizer, stepped as Harmony's committed steps were."""

    def __init__(self, model):
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), fused=True)   # as Harmony builds it
        self.saved = None

    def step(self, batch, only=None):
        for mb in zip(*(t.chunk(MICRO) for t in batch)):
            (self.model(*mb) / MICRO).backward()
        for n, p in self.model.named_parameters():
            if only is not None and n not in only:
                p.grad = None
        self.opt.step()
        self.opt.zero_grad()

    def save(self):
        self.saved = copy.deepcopy((self.model.state_dict(), self.opt.state_dict()))

    def load(self):
        model, opt = copy.deepcopy(self.saved)
        self.model.load_state_dict(model)
        self.opt.load_state_dict(opt)

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def _enospc(fd, data, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _corrupt(ck):
    victim = sorted(p for p in ck.iterdir() if p.name.startswith("pack-"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))


@pytest.fixture
def one_thread():
    """One intra-op thread: a tiny model's ops are too small to share, and on a busy machine each parallel region
    waits for its partner thread to get a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_soak_with_faults_at_random_points_ends_bitwise_as_eager(tmp_path, monkeypatch, one_thread):
    from test_disk import DATA, TINY, compile_gpt, smallest_host_budget
    rng = random.Random(SEED)
    sm = compile_gpt(cfg=TINY, host_memory_budget=smallest_host_budget(TINY), offload_dir=tmp_path / "offload")
    assert sm.runtime.state.disk is not None and len(sm.plan.packs) > 1      # state on disk, several packs
    eager = Eager(sm.model)
    torch.manual_seed(SEED)
    batches = [tuple(t.roll(k, 0) for t in DATA[k % len(DATA)]) for k in range(16)]
    compute = [i for i, op in enumerate(schedule_ops(sm)) if op in ("forward", "backward")]
    ck = tmp_path / "ck"
    harmony.save(sm, ck)
    eager.save()
    tally = dict(injected=0, recovered=0, lost=0, rolled_back=0, committed=0, torn=0)
    for i in range(STEPS):
        batch = batches[i % len(batches)]
        kind = rng.choice(KINDS)
        if kind == "corrupt":
            tally["injected"] += 1
            _corrupt(ck)
            before = {n: p.detach().clone() for n, p in sm.program.gm.named_parameters()}
            with pytest.raises(CheckpointError, match="damaged"):
                harmony.load(sm, ck)
            intact = all(torch.equal(p, before[n]) for n, p in sm.program.gm.named_parameters())
            harmony.save(sm, ck)                       # the next save repairs it
            eager.save()
            tally["recovered" if intact else "lost"] += 1
            kind = "none"
        if kind == "none":
            sm(*batch)
            eager.step(batch)
            continue
        tally["injected"] += 1
        at = rng.randrange(len(compute))
        if kind == "enospc":
            monkeypatch.setattr(disk, "_pwrite", _enospc)
            injection = fail_at(10 ** 9)
        elif kind == "sigint":
            injection = fail_at(rng.randrange(len(schedule_ops(sm))), signum=signal.SIGINT)
        else:
            error = RuntimeError("injected") if kind == "error" else KeyboardInterrupt()
            injection = fail_at(at, error, kinds=("forward", "backward"))
        try:
            with injection:
                sm(*batch)
        except BaseException:   # noqa: BLE001 (every injected fault lands here)
            pass
        finally:
            monkeypatch.setattr(disk, "_pwrite", os.pwrite)
        outcome = sm.runtime.transaction.outcome
        if outcome == "committed":
            eager.step(batch)
            tally["committed"] += 1
        elif outcome == "torn":
            tally["torn"] += 1
            if rng.random() < 0.5:
                torn = sm.accept_partial_step()
                eager.step(batch, only=set(torn["params"]))
            else:
                harmony.load(sm, ck)
                eager.load()
        else:
            tally["rolled_back"] += 1
        tally["recovered"] += 1
        if i % 20 == 19:
            harmony.save(sm, ck)
            eager.save()
    print(f"soak: {STEPS} steps, seed {SEED}: faults injected {tally['injected']}, recovered {tally['recovered']}, "
          f"lost {tally['lost']} (rolled back {tally['rolled_back']}, completed {tally['committed']}, "
          f"torn {tally['torn']})")
    assert tally["lost"] == 0 and tally["recovered"] == tally["injected"] > STEPS // 5
    assert tally["rolled_back"] and tally["committed"] and tally["torn"]
    assert_bitwise(sm, eager.params())
    sm.close()
