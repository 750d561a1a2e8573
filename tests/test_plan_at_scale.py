"""Planning shard_state="full" for ranks that are not here: the meta device under torch's fake process group.

``benchmarks/dgx2.py`` plans one rank of 16 on a simulated DGX-2 this way. A subprocess (the fake process group is
global to its process) plans a tiny GPT over 4 ranks with a host budget that puts shares on disk, and a wider one
that a small device cannot hold, and reports what it got.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
import harmony
from harmony.errors import BudgetError
from harmony.models import GPT, GPTConfig

def compile_(width, host, device_budget):
    c = GPTConfig(layers=4, width=width, heads=4, vocab=256, seq=64, tie=False)
    with torch.device("meta"):
        model = GPT(c)
    x = torch.zeros(8, 64, dtype=torch.long, device="meta")
    return harmony.compile(model, example_batch=(x, x), device="meta", memory_budget=device_budget, microbatches=2,
                           optimizer=torch.optim.AdamW, shard_state="full", host_memory_budget=host,
                           weights_on="disk" if host is None else "auto")

out = {}
sm = compile_(256, None, "64MiB")
shard = next(r for r in sm.program.reports if r.title.startswith("shard"))
out["placed"] = sorted({(r.optim_on, r.master_on) for r in sm.program.plan.residency.values()})
out["totals"] = {k: v for k, v in shard.totals.items() if isinstance(v, (int, float, list))}
out["ops"] = sorted({n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"})
sim = sm.simulate("v100-32gb")
out["step"], out["busy"] = sim.step_seconds, {k: v for k, v in sim.busy.items()}
out["params"] = sum(p.numel() for p in sm.program.gm.parameters())
try:
    compile_(2048, None, "8MiB")
    out["small"] = "no error"
except BudgetError as e:
    out["small"] = str(e)
print(json.dumps(out))
"""


def test_a_rank_of_four_plans_and_simulates_its_share_on_disk_without_the_other_ranks():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["placed"] == [["disk", "disk"]]          # weights_on="disk": every pack's share in its file
    t = out["totals"]
    assert t["world_size"] == 4 and t["rank"] == 1
    # this rank's share: a quarter of the partitioned fp32 weights (within a chunk's alignment per segment)
    assert abs(t["master_bytes_this_rank"] - t["master_bytes_whole"] / 4) <= 64 * 4 * 4 * t["partitioned_packs"] * 4
    # each step writes the rank's file (chunks and optimizer state) and reads the state back; it reads the chunks
    # only for gathers that do not take the copy a carried pack's step refilled (runtime/partitioned/carry.py)
    assert t["disk_write_bytes_per_step"] > 0
    assert t["disk_read_bytes_per_step"] >= t["disk_write_bytes_per_step"] - t["master_bytes_this_rank"]
    assert {"gather", "reduce_scatter"} <= set(out["ops"]) and "allreduce" not in out["ops"]
    # the simulator moves the gathers and reduce-scatters on the network and the files on the disk
    assert out["step"] > 0 and out["busy"].get("network", 0) > 0 and out["busy"].get("disk", 0) > 0
    assert "memory_budget" in out["small"] or "host_memory_budget" in out["small"]
