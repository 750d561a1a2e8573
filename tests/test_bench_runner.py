"""The benchmark runner's comparison (python -m benchmarks): which figures it flags against a baseline.

No timing here: synthetic figures through ``compare``, the function that decides the flags.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("bench_runner", ROOT / "benchmarks" / "__main__.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_runner"] = mod          # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("bench_runner", None)


def flags(runner, results, baseline, spread=None):
    rows, n = runner.compare(results, baseline, spread)
    return {(r["benchmark"], r["figure"]): r["flag"] for r in rows}, n


def test_worse_by_more_than_a_tenth_is_flagged_in_the_figure_s_own_direction(runner):
    base = {"overhead": {"compiled/eager step": 1.0, "compile 24-layer s": 5.0},
            "allreduce": {"fp32/Harmony 4-bit sync": 6.0},
            "hetero": {"balanced predicted/measured": 0.95}}
    now = {"overhead": {"compiled/eager step": 1.12, "compile 24-layer s": 5.4},     # +12% (lower is better), +8%
           "allreduce": {"fp32/Harmony 4-bit sync": 5.3},                            # -12% (higher is better)
           "hetero": {"balanced predicted/measured": 0.80}}                          # further from 1
    f, n = flags(runner, now, base)
    assert f[("overhead", "compiled/eager step")] == "WORSE"
    assert f[("overhead", "compile 24-layer s")] == ""
    assert f[("allreduce", "fp32/Harmony 4-bit sync")] == "WORSE"
    assert f[("hetero", "balanced predicted/measured")] == "WORSE"
    assert n == 3


def test_better_skipped_failed_and_not_run(runner):
    base = {"overhead": {"compiled/eager step": 1.0}, "allreduce": {"fp32/Harmony 4-bit sync": 6.0}}
    now = {"overhead": {"compiled/eager step": 0.8}, "allreduce": {"skipped": "needs root"},
           "hetero": {"error": "exit 1"}}
    f, n = flags(runner, now, base)
    assert f[("overhead", "compiled/eager step")] == ""
    assert f[("allreduce", "fp32/Harmony 4-bit sync")].startswith("skipped")
    assert f[("hetero", "balanced/uniform step")].startswith("FAILED")
    assert f[("calibration", "simulated/measured harmony")] == "not run"
    assert n == 3                 # each of hetero's three figures


def test_a_figure_the_baseline_has_but_the_run_lacks_is_shown_missing(runner):
    # the offload benchmark runs, but its DeepSpeed peer failed (no libaio): the figure must not vanish silently
    base = {"offload": {"harmony/deepspeed step": 0.5, "harmony/eager step": 1.5}}
    now = {"offload": {"harmony/eager step": 1.5}}
    f, n = flags(runner, now, base)
    assert f[("offload", "harmony/deepspeed step")].startswith("MISSING")
    assert f[("offload", "harmony/eager step")] == "" and n == 0


def test_the_committed_baseline_has_every_figure(runner):
    import json
    base = json.loads((ROOT / "benchmarks" / "results" / "cpu-quick.json").read_text())["results"]
    missing = [(f.bench, f.key) for f in runner.FIGURES
               if f.key not in base.get(f.bench, {}) and "skipped" not in base.get(f.bench, {})
               and f.key != "harmony/deepspeed step"]      # only where DeepSpeed is installed
    assert not missing


def test_a_figure_flagged_once_is_kept_at_the_better_of_two_runs(runner):
    first = {"compiled/eager step": 1.3, "compile 24-layer s": 5.0}
    second = {"compiled/eager step": 1.02, "compile 24-layer s": 5.6}
    both = runner._better(first, second)
    assert both["compiled/eager step"] == 1.02 and both["compile 24-layer s"] == 5.0 and both["runs"] == [first, second]
    near = runner._better({"balanced predicted/measured": 0.7}, {"balanced predicted/measured": 1.2})
    assert near["balanced predicted/measured"] == 1.2              # best at 1: the nearer
    assert runner._better({"error": "exit 1"}, second)["compiled/eager step"] == 1.02


def test_the_baseline_s_spread_sets_the_bar_at_its_worst_run(runner):
    """A figure is compared with the worst value the baseline's runs of one build gave it, in its direction."""
    runs = [{"when": "d1", "commit": "c", "results": {
                "overhead": {"compiled/eager step": 1.00, "machine": {"busy": 0.5}},
                "allreduce": {"fp32/Harmony 4-bit sync": 6.0},
                "hetero": {"balanced predicted/measured": 1.05}}},
            {"when": "d2", "commit": "c", "results": {
                "overhead": {"compiled/eager step": 1.20},
                "allreduce": {"fp32/Harmony 4-bit sync": 5.0},
                "hetero": {"balanced predicted/measured": 0.85}}}]
    base = runner.with_run(runs[0], None)
    base = runner.with_run(runs[1], base)
    assert base["spread"]["overhead"]["compiled/eager step"] == [1.00, 1.20]
    assert [r["when"] for r in base["spread_runs"]] == ["d1", "d2"]
    assert base["results"] == runs[0]["results"]           # the first run's full results stay
    within = {"overhead": {"compiled/eager step": 1.30}, "allreduce": {"fp32/Harmony 4-bit sync": 4.6},
              "hetero": {"balanced predicted/measured": 0.77}}
    f, n = flags(runner, within, base["results"], base["spread"])
    assert n == 0, f                       # each within 10% (10 points) of the worst run
    beyond = {"overhead": {"compiled/eager step": 1.35}, "allreduce": {"fp32/Harmony 4-bit sync": 4.4},
              "hetero": {"balanced predicted/measured": 1.27}}
    f, n = flags(runner, beyond, base["results"], base["spread"])
    assert f[("overhead", "compiled/eager step")] == "WORSE"
    assert f[("allreduce", "fp32/Harmony 4-bit sync")] == "WORSE"
    assert f[("hetero", "balanced predicted/measured")] == "WORSE"
    # without a spread, the one value is the bar (as before)
    f, n = flags(runner, within, base["results"])
    assert f[("overhead", "compiled/eager step")] == "WORSE"


def test_the_committed_baseline_has_a_spread_over_several_runs(runner):
    import json
    base = json.loads((ROOT / "benchmarks" / "results" / "cpu-quick.json").read_text())
    assert len(base["spread_runs"]) >= 2
    for f in runner.FIGURES:
        if f.bench in base["spread"] and f.key != "harmony/deepspeed step":
            assert len(base["spread"][f.bench].get(f.key, [])) >= 2, (f.bench, f.key)
