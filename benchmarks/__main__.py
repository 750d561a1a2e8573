"""Every benchmark at a quick size, its headline figures against their targets and a committed baseline.

    python -m benchmarks --quick                      # about 12 minutes on the 2-core CI machine
    python -m benchmarks --quick --only overhead,hetero
    python -m benchmarks --quick --save-baseline      # after checking the table: the new baseline
    python -m benchmarks --quick --add-to-baseline    # another run of the same build: widens the baseline's spread
    python -m benchmarks --self-test                  # a build slowed on purpose must be flagged

Each benchmark runs in its own process, one after another, and writes its headline figures as JSON (its
``--json``) into ``--out``; the machine's load is recorded beside each (load average, and the shares of the
cores busy and stolen by the hypervisor while it ran, from /proc/stat), since this is a shared machine and its
speed moves from one minute to the next. Within each benchmark the peers and Harmony take turns (overhead:
step by step; calibration and hetero: policy by policy each step; allreduce: method by method each rep;
offload: system by system each round), and the figures are medians. A figure more than 10% worse than the
baseline's (in the direction that is worse for it; for a ratio best at 1, ten points further from it) is flagged,
and a benchmark with a flagged figure runs once more: the figure stays flagged only if it is worse in both runs
(``runs`` in its JSON keeps both), since a hypervisor that steals the cores for a minute moves any one run by
more than 10%. Anything still flagged makes the run exit with status 1.

The baseline is not one run but several of one build (``--save-baseline``, then ``--add-to-baseline`` for each
further run): this machine moves some figures by 20-40% between runs of the same build (the simulator's error, a
new shape's first step), so a figure is compared with the worst value the baseline's runs gave it, and the table
shows the baseline's range. A figure flagged is then worse than anything the same build was seen to do here.

The 1 Gbit/s all-reduce runs in a network namespace with a tc rate limit (benchmarks/netns.sh), and the hybrid
row (a 2 x 2 grid of two emulated servers, 4-bit gradients, its measured throughput and its SIMULATED step over the
measured one) in two namespaces joined by one (benchmarks/netns2.sh); both need root and iproute2, and elsewhere
they are skipped and say so. DeepSpeed's figure is there only where it is
installed (``pip install -e ".[bench]"``, and ``apt-get install -y libaio-dev`` for its NVMe op); a figure the
baseline has and a run lacks is shown MISSING and listed under the table, without counting as flagged.

Timings never go in tests; this is what a change that can touch speed is checked with before its issue is
resolved, and the comparison goes in the closing note.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "results" / "cpu-quick.json"
WORSE_BY = 0.10          # a figure this much worse than the baseline is flagged


@dataclass(frozen=True)
class Figure:
    bench: str
    key: str             # in the benchmark's JSON
    target: str          # as the issue states it, for the reader
    better: str          # "lower" | "higher" | "one" (a ratio best at 1: worse is further from it)


FIGURES = [
    Figure("overhead", "compiled/eager step", "<= 1.10", "lower"),
    Figure("overhead", "compile 24-layer s", "< 10 s", "lower"),
    Figure("swap_volume", "harmony/bound worst row", "<= 1.15", "lower"),
    Figure("swap_volume", "ondemand/harmony vs target worst", ">= 1", "higher"),
    Figure("offload", "harmony/eager step", "(none: eager holds it all in memory)", "lower"),
    Figure("offload", "harmony/bound", "<= 1.25", "lower"),
    Figure("offload", "harmony/deepspeed step", "<= 0.67", "lower"),
    Figure("allreduce", "fp32/Harmony 4-bit sync", ">= 6 at 1 Gbit/s, 4 ranks", "higher"),
    Figure("hetero", "balanced/uniform step", "<= 0.8", "lower"),
    Figure("hetero", "balanced predicted/measured", "within 15%", "one"),
    Figure("hetero", "simulated balanced/uniform throughput", ">= 1.5", "higher"),
    Figure("calibration", "simulated/measured harmony", "within 15%", "one"),
    Figure("calibration", "simulator error worst policy", "<= 0.15", "lower"),
    Figure("loop", "harmony_clip_ratio", "(none: what clip_grad_norm adds to a step)", "lower"),
    Figure("evaluate", "evaluate/step", "(none: forward only, under the training budget)", "lower"),
    Figure("evaluate", "eval_peak/budget", "<= 1", "lower"),
    Figure("shapes", "new shape first/seen step", "<= 1.2 (dynamic padding on the compiled plan)", "lower"),
    Figure("shapes", "each/compiled planning+training", "(none: a plan per shape against one plan)", "higher"),
    Figure("shapes", "peak/budget worst", "<= 1", "lower"),
    Figure("partition", "w2_full/replicated host", "<= 0.525 (1/N + 5%)", "lower"),
    Figure("partition", "w2_full/replicated step", "(none: gathers and reduce-scatters on 2 shared cores)", "lower"),
    Figure("pipeline", "2 ranks contiguous", "(none: 2 emulated ranks vs 1; 2.5x at 4 ranks full size)", "higher"),
    Figure("pipeline", "2 ranks layers group 1", "(none: placement='layers', pipeline_group=1, 2 ranks vs 1)",
           "higher"),
    Figure("pipeline", "simulated 4x1080ti gpt-0.4b vPP-rr/vDP", "(none: SIMULATED)", "higher"),
    Figure("hybrid", "emulated grid 4bit samples/s", "(none: a 2 x 2 grid, 4-bit gradients over 1 Gbit/s)", "higher"),
    Figure("hybrid", "emulated grid 4bit predicted/measured", "within 15% (SIMULATED over measured)", "one"),
]


def commands(out: Path, py: str) -> dict[str, list[str]]:
    """Each benchmark's quick run, writing ``out/<name>.json``."""
    b = str(HERE)
    j = {name: str(out / f"{name}.json") for name in ("overhead", "swap_volume", "offload", "allreduce", "hetero",
                                                      "calibration", "loop", "evaluate", "shapes", "partition",
                                                      "pipeline", "hybrid")}
    return {
        "overhead": [py, f"{b}/overhead.py", "--layers", "4", "--width", "384", "--steps", "10",
                     "--json", j["overhead"]],
        "swap_volume": [py, f"{b}/swap_volume.py", "--layers", "12", "--budgets", "0.25", "0.5", "--microbatches", "4",
                        "16", "--json", j["swap_volume"]],
        "offload": [py, f"{b}/offload.py", "--layers", "8", "--width", "768", "--seq", "128", "--budget", "256MiB",
                    "--host-budget", "512MiB", "--systems", "harmony,eager,deepspeed" if _deepspeed() else
                    "harmony,eager", "--rounds", "2", "--raw-bytes", str(256 * 2**20), "--interference-seconds", "0",
                    "--json", j["offload"]],
        "allreduce": ["bash", f"{b}/netns.sh", "1gbit", "4", "--reps", "3", "--warmup", "1", "--methods", "q4",
                      "--json", j["allreduce"]],
        "hetero": [py, f"{b}/hetero.py", "--steps", "4", "--warmup", "1", "--profile-seconds", "4",
                   "--json", j["hetero"]],
        "calibration": [py, f"{b}/calibration.py", "--quick", "--steps", "5", "--json", j["calibration"]],
        "loop": [py, f"{b}/loop.py", "--layers", "4", "--steps", "6", "--json", j["loop"]],
        "evaluate": [py, f"{b}/evaluate.py", "--layers", "4", "--steps", "4", "--json", j["evaluate"]],
        "shapes": [py, f"{b}/shapes.py", "--layers", "4", "--steps", "16", "--json", j["shapes"]],
        "partition": [py, f"{b}/partition.py", "--worlds", "2", "--layers", "4", "--width", "256", "--heads", "4",
                      "--json", j["partition"], "--modes", "replicated", "full"] +
                     (["deepspeed"] if _deepspeed() else []),
        "pipeline": [py, f"{b}/pipeline.py", "--quick", "--json", j["pipeline"]],
        # the 2 x 2 grid with 4-bit gradients only, in two namespaces joined by 1 Gbit/s (needs root, as allreduce)
        "hybrid": [py, f"{b}/hybrid.py", "--emulated", "--link", "none", "--systems", "grid 4bit", "--layers", "2",
                   "--width", "256",
                   "--steps", "3", "--out", str(out / "hybrid"), "--json", j["hybrid"]],
    }


def _deepspeed() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def _can_shape_links() -> str | None:
    """Why the rate-limited all-reduce cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    return None


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def run(name: str, cmd: list[str], out: Path, env: dict) -> dict:
    """One benchmark: its figures, wall time, and the machine's load while it ran."""
    load0, cpu0, t0 = os.getloadavg()[0], _cpu_times(), time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
    cpu1 = _cpu_times()
    d = [b - a for a, b in zip(cpu0, cpu1)]
    total = sum(d) or 1
    load = dict(load_before=load0, load_after=os.getloadavg()[0], wall_s=time.perf_counter() - t0,
                busy=1 - (d[3] + d[4]) / total, steal=(d[7] if len(d) > 7 else 0) / total)
    path = out / f"{name}.json"
    if p.returncode or not path.exists():
        tail = log.read_text()[-1500:]
        return dict(error=f"exit {p.returncode}", log_tail=tail, machine=load)
    return dict(json.loads(path.read_text()), machine=load)


_WORSENESS = {"lower": lambda v: v, "higher": lambda v: -v, "one": lambda v: abs(v - 1)}


def compare(results: dict, baseline: dict, spread: dict | None = None) -> tuple[list[dict], int]:
    """Each figure against the baseline: against the worst of the baseline runs' values where ``spread``
    (``{bench: {figure: [value, ...]}}``) has them, else against ``baseline``'s one value."""
    rows, flagged = [], 0
    for f in FIGURES:
        r = results.get(f.bench, {})
        value = r.get(f.key) if isinstance(r, dict) else None
        seen = [v for v in (spread or {}).get(f.bench, {}).get(f.key, []) if v is not None]
        base = max(seen, key=_WORSENESS[f.better]) if seen else (
            baseline.get(f.bench, {}).get(f.key) if baseline else None)
        row = dict(benchmark=f.bench, figure=f.key, value=value, target=f.target, baseline=base,
                   range=f"{min(seen):.4g}..{max(seen):.4g} ({len(seen)} runs)" if len(seen) > 1 else "",
                   change="", flag="")
        if f.bench not in results:
            row["flag"] = "not run"
        elif "skipped" in r:
            row["flag"] = f"skipped: {r['skipped']}"
        elif "error" in r:
            row["flag"] = f"FAILED ({r['error']})"
            flagged += 1
        elif value is None and base is not None:   # e.g. a peer that failed inside the benchmark (its log says why)
            row["flag"] = "MISSING (the baseline has it; see the benchmark's log)"
        elif value is not None and base:
            if f.better == "one":           # a ratio best at 1: worse is 10 points further from it
                worse = abs(value - 1) - abs(base - 1)
                row["change"] = f"{worse:+.3f} from 1"
                bad = worse > WORSE_BY
            else:
                change = value / base - 1
                row["change"] = f"{change:+.1%}"
                bad = change > WORSE_BY if f.better == "lower" else change < -WORSE_BY
            if bad:
                row["flag"] = "WORSE"
                flagged += 1
        rows.append(row)
    return rows, flagged


def _table(rows: list[dict]) -> str:
    sys.path.insert(0, str(HERE))
    import common
    shown = [{k: (f"{v:.4g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in r.items()}
             for r in rows]
    return common.table(shown)


def self_test(args) -> int:
    """Run the overhead benchmark twice: as built, then with each forward op slowed by a sleep (a sitecustomize
    the runner puts on PYTHONPATH for the second run only; nothing in harmony reads it): the second must be
    flagged against the first."""
    out = Path(tempfile.mkdtemp(prefix="harmony-bench-selftest-"))
    cmd = commands(out, sys.executable)["overhead"]
    normal = run("overhead", cmd, out, dict(os.environ))
    slow_dir = out / "slow"
    slow_dir.mkdir()
    (slow_dir / "sitecustomize.py").write_text(
        "# benchmarks/__main__.py --self-test: slow every forward op of the runtime by 100 ms\n"
        "import dataclasses, time\n"
        "import harmony, harmony.runtime.ops as ops\n"
        "_op = ops.op_named('forward')\n"
        "def _slow(*a, **k):\n"
        "    time.sleep(0.1)\n"
        "    return _op.execute(*a, **k)\n"
        "ops.OPS[_op.stub] = dataclasses.replace(_op, execute=_slow)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(slow_dir), os.environ.get("PYTHONPATH")])))
    (out / "overhead.json").unlink()         # the slowed run must write its own figures
    slowed = run("overhead", cmd, out, env)
    if "Error in sitecustomize" in (out / "overhead.log").read_text():   # the slowing itself failed: say so
        print((out / "overhead.log").read_text()[:2000])
        print("\nself-test: the slowed build could not be made (its sitecustomize failed, above)")
        return 1
    rows, flagged = compare({"overhead": slowed}, {"overhead": normal})
    print(_table([r for r in rows if r["benchmark"] == "overhead"]))
    ok = any(r["flag"] == "WORSE" and r["figure"] == "compiled/eager step" for r in rows)
    print(f"\nself-test: the slowed build was {'flagged' if ok else 'NOT flagged'} "
          f"(compiled/eager {normal.get('compiled/eager step', float('nan')):.3f} as built, "
          f"{slowed.get('compiled/eager step', float('nan')):.3f} slowed)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick sizes (the only sizes this runner has)")
    ap.add_argument("--only", default="", help="comma-separated benchmarks: " + ", ".join(commands(Path("."), "")))
    ap.add_argument("--out", default=None, help="folder for each benchmark's JSON and log (default: a temp folder)")
    ap.add_argument("--baseline", default=str(BASELINE))
    ap.add_argument("--save-baseline", action="store_true", help="write this run as the baseline")
    ap.add_argument("--add-to-baseline", action="store_true",
                    help="add this run's figures to the baseline's spread (another run of the baseline's build)")
    ap.add_argument("--self-test", action="store_true", help="check that a deliberately slowed build is flagged")
    ap.add_argument("--no-retry", dest="retry", action="store_false",
                    help="flag on one measurement (default: a benchmark with a flagged figure runs again, and a figure "
                         "stays flagged only if worse in both runs)")
    args = ap.parse_args()
    if args.self_test:
        return self_test(args)
    if not args.quick:
        ap.error("give --quick (the runner has one size: the quick one)")
    out = Path(args.out or tempfile.mkdtemp(prefix="harmony-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    cmds = commands(out, sys.executable)
    only = [s for s in args.only.split(",") if s] or list(cmds)
    unknown = set(only) - set(cmds)
    if unknown:
        ap.error(f"unknown benchmarks {sorted(unknown)}; choose from {', '.join(cmds)}")
    results = {}
    for name in only:
        if name in ("allreduce", "hybrid") and _can_shape_links():
            results[name] = dict(skipped=_can_shape_links())
            print(f"{name}: skipped, {results[name]['skipped']}", flush=True)
            continue
        results[name] = _run_and_say(name, cmds[name], out)
    baseline = json.loads(Path(args.baseline).read_text()) if Path(args.baseline).exists() else {}
    spread = baseline.get("spread")
    rows, flagged = compare(results, baseline.get("results", {}), spread)
    again = sorted({r["benchmark"] for r in rows if r["flag"] == "WORSE"})
    if again and args.retry:      # a figure flagged once is measured again: it stays flagged only if worse twice
        print(f"\nflagged, measured again: {', '.join(again)}", flush=True)
        for name in again:
            second = _run_and_say(name, cmds[name], out, suffix="-again")
            results[name] = _better(results[name], second)
        rows, flagged = compare(results, baseline.get("results", {}), spread)
    print()
    print(_table(rows))
    print(f"\nbaseline: {args.baseline} ({baseline.get('when', 'none')}, {baseline.get('commit', '')}); "
          f"flagged: {flagged}; JSON and logs in {out}")
    missing = [f"{r['benchmark']}: {r['figure']}" for r in rows if r["flag"].startswith("MISSING")]
    if missing:      # not counted as flagged (DeepSpeed's figure needs DeepSpeed and libaio), but never silent
        print(f"missing here, measured in the baseline: {'; '.join(missing)}")
    summary = dict(when=time.strftime("%Y-%m-%d %H:%M"), commit=_commit(), cores=os.cpu_count(), results=results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.save_baseline or args.add_to_baseline:
        new = with_run(summary, baseline if args.add_to_baseline else None)
        Path(args.baseline).parent.mkdir(parents=True, exist_ok=True)
        Path(args.baseline).write_text(json.dumps(new, indent=1, default=str))
        print(f"{'added to' if args.add_to_baseline else 'saved as'} the baseline: {args.baseline} "
              f"({len(new['spread_runs'])} runs)")
    return 1 if flagged else 0


def _run_and_say(name: str, cmd: list[str], out: Path, suffix: str = "") -> dict:
    if suffix:
        cmd = [c.replace(f"{name}.json", f"{name}{suffix}.json") for c in cmd]
    print(f"{name}{suffix}: {' '.join(cmd[1:])}", flush=True)
    r = run(name + suffix, cmd, out, dict(os.environ))
    m = r["machine"]
    state = "FAILED" if "error" in r else "done"
    print(f"  {state} in {m['wall_s']:.0f} s; load {m['load_before']:.2f} -> {m['load_after']:.2f}, cores busy "
          f"{m['busy']:.0%}, stolen {m['steal']:.0%}", flush=True)
    return r


def _better(first: dict, second: dict) -> dict:
    """Each figure at the better of two runs (in its own direction), both runs kept under ``runs``."""
    if "error" in second:
        return dict(first, runs=[first, second])
    if "error" in first:
        return dict(second, runs=[first, second])
    out = dict(first)
    for f in FIGURES:
        a, b = first.get(f.key), second.get(f.key)
        if a is None or b is None:
            continue
        out[f.key] = min(a, b, key=_WORSENESS[f.better])
    out["runs"] = [first, second]
    return out


def with_run(summary: dict, baseline: dict | None) -> dict:
    """The baseline with this run's headline figures added to its spread; a new baseline of this run alone where
    ``baseline`` is None. The first run's full results stay under ``results``; ``spread`` keeps every run's value of
    each figure and ``spread_runs`` when and at which commit each ran, with the machine's load."""
    if baseline is None:
        baseline = dict(summary, spread={}, spread_runs=[])
    baseline.setdefault("spread", {})
    baseline.setdefault("spread_runs", [])
    for f in FIGURES:
        r = summary["results"].get(f.bench)
        if isinstance(r, dict) and r.get(f.key) is not None:
            baseline["spread"].setdefault(f.bench, {}).setdefault(f.key, []).append(r[f.key])
    load = {name: {k: round(v, 3) for k, v in r["machine"].items()} for name, r in summary["results"].items()
            if isinstance(r, dict) and "machine" in r}
    baseline["spread_runs"].append(dict(when=summary["when"], commit=summary["commit"], load=load))
    return baseline


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE.parent).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
