"""Memory contract: the measured device peak never exceeds the budget; verify's prediction is within 10%."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import harmony
from harmony.errors import BudgetError
from models import CASES, run_compiled, training_state_bytes


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
@pytest.mark.parametrize("frac", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("case", ["gpt", "mlp", "cnn"])
def test_measured_peak_within_budget_and_prediction(case, frac, policy):
    model, data = CASES[case](layers=6) if case == "gpt" else CASES[case]()
    budget = int(training_state_bytes(model) * frac)
    sm, stats, _ = run_compiled(copy.deepcopy(model), data, 4, budget, policy)
    for s in stats:
        assert s["measured_peak"] <= budget
    steady = stats[-1]   # the first step also creates the optimizer state
    assert abs(steady["predicted_peak"] - steady["measured_peak"]) <= 0.10 * steady["measured_peak"], steady
    if frac < 1.0:
        assert len(sm.plan.packs) > 1
    assert steady["h2d_bytes"] == pytest.approx(steady["predicted_h2d"], rel=0.02)


def test_ondemand_stays_within_budget_once_it_has_seen_a_step():
    """The on-demand baseline makes room for what each op allocated in the previous step."""
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.5)
    _, stats, _ = run_compiled(copy.deepcopy(model), data, 4, budget, "ondemand")
    assert stats[-1]["measured_peak"] <= budget
    assert stats[-1]["h2d_bytes"] > 0


def test_ondemand_reuses_its_host_buffers_for_evictions():
    """Evicted gradients and optimizer state go to host buffers kept from earlier evictions: once a step has run,
    a step evicts without allocating host memory (its fetches and evictions are timed for sm.stats)."""
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.5)
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget, microbatches=4,
                         policy="ondemand")
    od, stats = sm.runtime.on_demand, []
    for x, y in data * 2:
        sm(x, y)
        held = sum(b.untyped_storage().nbytes() for v in od.spare.values() for b in v)
        stats.append(dict(sm.stats, spare_held=held))
    sm.close()
    assert od.spare == {} and od.backing == {}     # closed: let go
    assert stats[-1]["d2h_bytes"] > 0 and stats[0]["ondemand_new_host_bytes"] > 0
    assert stats[-1]["ondemand_new_host_bytes"] == 0
    assert stats[-1]["ondemand_spare_bytes"] > 0
    # the running count of spare bytes is what the spare buffers hold
    assert all(s["ondemand_spare_bytes"] == s["spare_held"] for s in stats)
    assert stats[-1]["ondemand_fetch_seconds"] > 0 and stats[-1]["ondemand_evict_seconds"] > 0


def test_the_runtime_enforces_the_budget():
    """A plan that under-predicts is stopped by the runtime's meter, not silently exceeded."""
    model, data = CASES["gpt"]()
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=4)
    sm.runtime.meter.budget = sm.stats.get("measured_peak", 0) or int(sm.predicted.peak * 0.5)
    with pytest.raises(harmony.errors.DeviceOutOfMemory, match="over its budget"):
        sm(*data[0])


def test_budget_error_names_a_budget_that_compiles():
    model, data = CASES["gpt"]()
    with pytest.raises(BudgetError) as e:
        harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.05),
                        microbatches=4)
    assert e.value.min_budget and "smallest budget" in str(e.value)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=e.value.min_budget, microbatches=4)
    sm(*data[0])
    assert sm.stats["measured_peak"] <= e.value.min_budget


def _in_fresh_process(code: str, **env) -> str:
    # the machine's defaults: not a choice of this session's (or of tests/conftest.py's, under xdist)
    e = {k: v for k, v in os.environ.items()
         if k not in ("THP_MEM_ALLOC_ENABLE", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages: Linux only")
def test_importing_harmony_turns_on_torchs_huge_page_allocations_unless_the_user_chose():
    from harmony.base.process import THP_SYSFS, _read
    if "[never]" in _read(THP_SYSFS):
        pytest.skip("transparent huge pages are off on this machine")
    probe = "import os, harmony, torch; from harmony.base.process import huge_pages; " \
            "print(huge_pages(), os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    assert _in_fresh_process(probe) == "True 1"
    assert _in_fresh_process(probe, THP_MEM_ALLOC_ENABLE="0") == "False 0"      # the user's choice stands
    # torch latched its choice at the first tensor: too late to ask, and huge_pages() says so
    late = "import torch; torch.zeros(1 << 20); " + probe
    assert _in_fresh_process(late) == "False 1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's mapping: Linux only")
def test_importing_harmony_makes_idle_openmp_threads_sleep_unless_the_user_chose():
    # the fresh processes' thread count, not this one's (a share of the cores under xdist: tests/conftest.py)
    probe = "import os, harmony, torch; from harmony.base.process import idle_threads_sleep; " \
            "print(idle_threads_sleep(), os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads())"

    def sleeps(code=probe, **env) -> str:
        said, threads = _in_fresh_process(code, **env).rsplit(" ", 1)
        if int(threads) < 2 or not torch.backends.openmp.is_available():
            pytest.skip("one thread or no OpenMP: no partner to spin")
        return said

    assert sleeps() == "True PASSIVE"
    assert sleeps(OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"     # the user's choice stands
    assert sleeps(GOMP_SPINCOUNT="300000") == "False None"         # libgomp's own default
    # libgomp read the environment when torch loaded it: too late to ask, so harmony leaves it, and the probe says so
    assert sleeps("import torch; " + probe) == "False None"


def test_the_report_says_whether_huge_pages_are_on():
    from harmony.base.process import huge_pages_note, idle_threads_note
    model, data = CASES["mlp"]()
    sm, stats, _ = run_compiled(copy.deepcopy(model), data, 1, training_state_bytes(model), "harmony")
    assert stats[-1]["huge_pages"] is sm.huge_pages
    flat = " ".join(sm.report().split())
    assert "huge pages " + huge_pages_note(sm.huge_pages) in flat
    assert stats[-1]["idle_threads_sleep"] is sm.idle_threads_sleep
    assert "OpenMP waits " + " ".join(idle_threads_note(sm.idle_threads_sleep).split()) in flat
    assert idle_threads_note(True).startswith("sleep: ") and idle_threads_note(False).startswith("spin: ")
    assert huge_pages_note(True).startswith("on: ") and huge_pages_note(False).startswith("off: ")
