"""Plan fingerprints: compile a fixed set of configurations and hash each plan, to show a refactor changed none.

    python .ci/plans.py                 # print {config: fingerprint} as JSON
    python .ci/plans.py --check         # compare with .ci/plans.json; exit 1 naming each plan that changed
    python .ci/plans.py --write         # make the current plans the baseline (after a change meant to alter plans)

A fingerprint is the sha256 of a plan's schedule as printed (``sm.code``: every op, its arguments and the memory
the plan predicts after it), its packs' names and where each pack's state lives; the multi-rank configurations
run on real gloo ranks spawned here and hash every rank's plan. Plans on the CPU without ``hardware=`` depend on
no timing, so the baseline is the same on every machine of this kind; a planner change that is meant to change
plans rewrites it with ``--write`` in the same commit, and says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "plans.json"


def _gpt(layers=4, tie=False, batch=8, seq=16, width=64):
    import torch

    from harmony.models import GPT, GPTConfig, copy_task
    torch.manual_seed(0)
    c = GPTConfig(layers=layers, width=width, vocab=64, seq=seq, tie=tie)
    return GPT(c), next(iter(copy_task(c, batch, 1, seed=0)))


def _mlp():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self, sizes=(32,) + (128,) * 8 + (10,)):
            super().__init__()
            self.layers = nn.Sequential(*[m for a, b in zip(sizes, sizes[1:])
                                          for m in (nn.Linear(a, b), nn.ReLU())][:-1])

        def forward(self, x, y):
            return F.cross_entropy(self.layers(x), y)
    torch.manual_seed(0)
    return MLP(), (torch.randn(16, 32), torch.randint(0, 10, (16,)))


def _state(model) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def fingerprint(sm) -> str:
    h = hashlib.sha256(sm.code.encode())
    h.update(json.dumps([s.name for s in sm.plan.packs]).encode())
    for pack, r in sorted(sm.plan.residency.items()):     # where each pack's state lives (the code names no tier)
        fields = {f.name: _plain(getattr(r, f.name)) for f in dataclasses.fields(r) if f.name != "shares"}
        h.update(repr((pack, sorted(fields.items()), r.shares is not None)).encode())
    return h.hexdigest()[:16]


def _plain(value):
    """A value whose repr is the same in every process: sets sorted (their order follows the string hash's seed)."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(_plain, value), key=repr)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items(), key=repr)}
    if isinstance(value, (list, tuple)):
        return type(value)(map(_plain, value))
    return value


def _meta_gpt_bf16(**kw):
    """A 16-layer GPT planned (not run) for an H100 in bf16: compile weighs stepping the last packs on the card."""
    import torch

    import harmony
    from harmony.compiler.hardware import Hardware
    from harmony.models import GPT, GPTConfig
    c = GPTConfig(vocab=512, seq=256, layers=16, width=512, heads=8, tie=False)
    with torch.device("meta"):
        m = GPT(c)
    x = torch.zeros(8, 256, dtype=torch.long, device="meta")
    hw = Hardware.preset("h100-sxm")
    hw = hw.replace(devices=(hw.devices[0].replace(dtype="bf16"),), host_memory_bandwidth=100e9)
    return harmony.compile(m, (x, x), device="meta", memory_budget=4 * c.n_params(), microbatches=4,
                           precision="bf16", hardware=hw, **kw)


def single() -> dict:
    """One process: each configuration -> its fingerprint."""
    import harmony
    out = {}

    def add(name, make, share, **kw):
        model, batch = make()
        with tempfile.TemporaryDirectory() as d:
            if kw.get("weights_on") == "disk" or kw.get("host_memory_budget"):
                kw["offload_dir"] = d
            sm = harmony.compile(model, batch, memory_budget=int(_state(model) * share), **kw)
            out[name] = fingerprint(sm)
            sm.close()
    for share in (0.25, 0.5, 0.8):
        for policy in ("harmony", "sequential"):
            add(f"gpt4 {share} {policy} m4", _gpt, share, microbatches=4, policy=policy)
    add("gpt4 tied 0.4 m4", lambda: _gpt(tie=True), 0.4, microbatches=4)
    add("gpt4 0.3 m2 ondemand", _gpt, 0.3, microbatches=2, policy="ondemand")
    add("gpt4 0.5 m4 host step", _gpt, 0.5, microbatches=4, optimizer_on="host")
    add("gpt4 0.25 m4 recompute device", _gpt, 0.25, microbatches=4, recompute="device")
    add("gpt4 0.2 m4 bf16", _gpt, 0.2, microbatches=4, precision="bf16")
    add("gpt4 0.25 m4 weights on disk", _gpt, 0.25, microbatches=4, weights_on="disk")
    add("gpt4 0.25 m4 host budget 0.85", _gpt, 0.25, microbatches=4, optimizer_on="host",
        host_memory_budget=int(_state(_gpt()[0]) * 0.85))
    add("gpt8 0.3 m4", lambda: _gpt(layers=8), 0.3, microbatches=4)
    add("mlp 0.3 m4", _mlp, 0.3, microbatches=4)
    out["gpt16 meta bf16 h100 device steps"] = fingerprint(_meta_gpt_bf16())
    return out


RANKED = {   # name -> (world, compile options)
    "dp2 4bit 0.5": (2, dict(compression="4bit")),
    "dp2 shard optimizer 0.4": (2, dict(shard_state=True)),
    "zero3 2 ranks 0.5": (2, dict(shard_state="full")),
    "pipeline 2 ranks 0.5": (2, dict(parallel="pipeline")),
    "pipeline 3 ranks 0.4": (3, dict(parallel="pipeline")),
}


def _rank(rank, world, port, name, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        import torch
        torch.set_num_threads(1)
        import harmony
        model, batch = _gpt(layers=6)
        share = float(name.split()[-1])
        sm = harmony.compile(model, batch, memory_budget=int(_state(model) * share), microbatches=4,
                             comm_timeout=60, **RANKED[name][1])
        q.put((rank, fingerprint(sm)))
        sm.close()
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:   # reported, not hung: the parent names the configuration
        q.put((rank, f"failed: {type(e).__name__}: {e}"))


def ranked() -> dict:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = {}
    for name, (world, _) in RANKED.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, name, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        out[name] = "/".join(got[r] for r in range(world))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with .ci/plans.json")
    ap.add_argument("--write", action="store_true", help="write the current plans to .ci/plans.json")
    ap.add_argument("--single", action="store_true", help="only the single-process configurations")
    args = ap.parse_args()
    got = single()
    if not args.single:
        got.update(ranked())
    if args.write:
        BASELINE.write_text(json.dumps(got, indent=1) + "\n")
    if not args.check:
        print(json.dumps(got, indent=1))
        return 0
    want = json.loads(BASELINE.read_text())
    changed = [k for k in want if k in got and got[k] != want[k]]
    for k in changed:
        print(f"plan changed: {k}: {want[k]} -> {got[k]}")
    print(f"plans: {len(got) - len(changed)} of {len(got)} as in .ci/plans.json"
          + ("" if not changed else "; rerun with --write if the change is meant, and say why in the commit"))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
