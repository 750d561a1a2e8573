"""benchmarks/swap_volume.py: its lower bound holds under what Harmony measurably moves and behaves as a bound must
(no timing asserts); the DP behind it is checked against every partition in test_traffic_bound.py."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import swap_volume as sv  # noqa: E402

from harmony.models import GPT, GPTConfig, copy_task  # noqa: E402

CFG = GPTConfig(vocab=128, seq=16, layers=4, width=64, heads=4, tie=False)


def _run(frac, m, model_seed=0):
    torch.manual_seed(model_seed)
    model = GPT(CFG)
    budget = int(16 * sum(p.numel() for p in model.parameters()) * frac)
    r = sv.measure(GPT(CFG), list(copy_task(CFG, m, 2)), m, budget, "harmony")
    return model, budget, r


@pytest.mark.parametrize("frac,m", [(0.3, 4), (0.5, 16), (0.7, 8)])
def test_harmony_moves_at_least_the_bound(frac, m):
    """The bound holds under what Harmony measurably moves, and above the bound of any schedule (3 P - U), which
    leaves out the working set of every backward and what crosses the cuts."""
    model, budget, r = _run(frac, m)
    assert r["peak"] <= budget
    assert 0 < sv.any_schedule_bound(model, budget) <= r["bound"] <= r["moved"]


def test_the_bound_falls_as_the_budget_grows_and_rises_with_the_microbatches():
    """More budget holds more (the bound never rises); more microbatches put more activations across every cut at
    the turn from forward to backward (it never falls)."""
    bounds = [_run(frac, 8)[2]["bound"] for frac in (0.3, 0.45, 0.6)]
    assert bounds[0] >= bounds[1] >= bounds[2] and bounds[0] > bounds[2]
    by_m = [_run(0.45, m)[2]["bound"] for m in (2, 8)]
    assert by_m[0] <= by_m[1]


def test_swap_volume_runs_end_to_end():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "swap_volume.py"), "--layers", "2", "--budgets", "0.5",
           "--microbatches", "4", "--width", "64", "--seq", "16"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    for column in ("harmony/bound", "bound_MiB", "any_schedule_MiB", "harmony_full_link_MiB", "full_link/bound"):
        assert column in p.stdout, p.stdout
