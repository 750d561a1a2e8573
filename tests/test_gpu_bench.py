"""benchmarks/gpu.py, dry-run on the CPU: the Hugging Face Llama rows (the 8B shape's small stand-in), built under
``harmony.empty_weights()`` for Harmony's row, train beside eager from the same batches, and the run writes its JSON
after each row. The card runs the same script at full size (benchmarks/gpu.sh)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_benchmark_dry_run_trains_a_llama_beside_eager(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--quick", "--model", "llama", "--device", "cpu",
           "--rows", "eager,harmony-50", "--steps", "2", "--probe-seconds", "0", "--profile-step", "0",
           "--row-timeout", "280", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "LlamaForCausalLM hidden 256 x 2 layers" in p.stdout, p.stdout
    res = json.loads((tmp_path / "gpu-llama-fp32.json").read_text())
    assert res["args"]["model"] == "llama"
    rows = {r["system"]: r for r in res["rows"]}
    assert set(rows) == {"eager", "harmony-50"} and not any("error" in r for r in rows.values()), rows
    raw = {r["system"]: r for r in res["raw"]}
    for r in raw.values():
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]), r
    # the same model and batches, the weights drawn apart (Harmony's row makes them as compile places them): the
    # first step's loss, before any update, is near eager's and ln(vocab)'s, as random weights give
    for r in raw.values():
        assert r["losses"][0] == pytest.approx(math.log(512), rel=0.03), r["losses"]
    assert rows["harmony-50"]["meter_peak_gib"] <= rows["harmony-50"]["budget_gib"]
    assert "harmony-50 / eager tokens/s" in p.stdout


def test_host_step_benchmark_prints_each_adamw_against_the_memory_probe():
    """benchmarks/host_step.py (gpu.py prints it for the card's host): every torch AdamW implementation's step traffic
    per second beside the memory-bandwidth probe, as shares of it."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--mib", "4", "--seconds", "0.3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    for impl in ("for-loop", "foreach", "fused"):
        assert f" {impl} " in p.stdout, p.stdout
    assert "of the memory-bandwidth probe's" in p.stdout and "%)" in p.stdout, p.stdout
