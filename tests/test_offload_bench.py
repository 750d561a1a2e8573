"""benchmarks/offload.py runs end to end on a tiny model (harmony and eager columns; no timing asserts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_offload_bench_tiny(tmp_path):
    out = tmp_path / "result.json"
    # a budget a little over one layer's need and a host budget Harmony raises to its minimum:
    # every pack's optimizer state goes to disk
    cmd = [sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--layers", "4", "--width", "64",
           "--seq", "32", "--batch", "2", "--steps", "2", "--systems", "harmony,eager", "--budget", "1.5MiB",
           "--host-budget", "1KiB", "--raw-bytes", str(8 * 2**20), "--dir", str(tmp_path / "d"),
           "--interference-seconds", "0.3", "--json", str(out)]
    # a caller's defaults (not tests/conftest.py's share of the cores under xdist)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "offload: GPT" in p.stdout and "Harmony / bound" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    rows = {r["system"]: r for r in res["rows"]}
    assert set(rows) == {"harmony", "eager"}
    for r in rows.values():
        assert isinstance(r["step_s"], float) and r["step_s"] > 0
        assert r["read_GB_step"] >= 0 and r["write_GB_step"] >= 0 and r["peak_rss_GiB"] > 0
        assert r["bound_s"] > 0
    # raw disk probes: one at the start, one after each run of a system that moved more than 1 MiB a step
    assert res["raw_disk"][0]["when"] == "at the start"
    assert [p["when"] for p in res["raw_disk"][1:]] == ["after harmony, round 1", "after harmony, round 2"]
    assert all(p["read"] > 0 and p["write"] > 0 for p in res["raw_disk"])
    # two rounds (the default): each system ran twice, interleaved, and its row pools the steps after each first
    runs = res["results"]
    assert len(runs["harmony"]) == len(runs["eager"]) == 2
    for r in runs["harmony"] + runs["eager"]:
        assert "error" not in r and len(r["step_s"]) == 2
        assert len(r["idle"]) == len(r["steal"]) == 2     # the machine's idle and stolen shares during each step
        if Path("/proc/stat").exists():
            assert all(0 <= v <= 1 for v in r["idle"] + r["steal"])
    for name, row in rows.items():
        pooled = sorted(r["step_s"][1] for r in runs[name])
        assert row["step_s"] == sum(pooled) / 2      # the median of the two runs' second steps
    assert rows["eager"]["bound_s"] >= min(r["step_s"][1] for r in runs["eager"])
    assert "round 2" in " ".join(res["notes"])
    h, e = runs["harmony"][-1], runs["eager"][-1]
    assert h["peak_rss"] >= (h["peak_rss_steps"] or 0) > 0
    assert rows["harmony"]["peak_rss_GiB"] * 2**30 == max(r["peak_rss"] for r in runs["harmony"])
    # the harmony child imports harmony first (its idle OpenMP threads sleep); eager keeps the caller's OpenMP
    # settings, although the parent imported harmony, which sets OMP_WAIT_POLICY in its own environment
    if h["threads"] > 1 and torch.backends.openmp.is_available():
        assert h["idle_threads_sleep"] is True and e["idle_threads_sleep"] is False
    # the disk tier was used; optimizer state alone on disk moves once each way, while packs wholly on disk
    # also read their weights for the forward and the backward
    assert h["plan.optim_on"].get("disk", 0) >= 1
    for s in h["stats"][1:]:
        assert s["disk_write_bytes"] > 0
        if h["plan.master_on"].get("disk"):
            assert s["disk_read_bytes"] > s["disk_write_bytes"]
        else:
            assert s["disk_read_bytes"] == s["disk_write_bytes"]
    # same model, seed and batch: the first loss agrees
    assert abs(h["loss"][0] - e["loss"][0]) < 1e-4
    # compute lost to disk traffic beside it: measured, and the bound that adds it is no lower than the bound
    i = res["interference"]
    assert i["sgemm_GFLOPs_alone"] > 0 and i["read_GBps"] > 0 and i["write_GBps"] > 0
    assert i["read_s_per_GB"] >= 0 and i["write_s_per_GB"] >= 0
    assert rows["harmony"]["bound_io_s"] >= rows["harmony"]["bound_s"] and "Harmony / bound_io" in p.stdout
    assert not list((tmp_path / "d").iterdir())          # the run's directory is removed
