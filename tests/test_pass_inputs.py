"""Each pass handed a program it did not get from the passes before it: a hand-edited plan or configuration, run by
the pass's own ``run`` (no monkeypatching), and the residency record as the one place the ops read placement from."""
import copy
import types

import pytest

import harmony
from harmony.compiler.verify import memory_curve
from harmony.passes import offload, prefetch, schedule
from harmony.runtime import ops
from harmony.runtime.plan import STATE_KINDS, Residency
from harmony.runtime.simulate import simulate
from models import CASES, training_state_bytes


def program_after(passes, frac=0.4, **kw):
    model, data = CASES["gpt"](layers=4)
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=4, passes=passes,
                         memory_budget=int(training_state_bytes(model) * frac), **kw)
    return sm.program


def op_args(program, op):
    return [tuple(n.args[:2]) for n in program.schedule.nodes if n.op == "call_function" and n.target is op]


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
def test_the_schedule_pass_orders_a_plan_it_is_handed(policy):
    """The same packs lowered under a policy set by hand: harmony runs each pack over every microbatch before the
    next pack; sequential runs every pack for one microbatch before the next microbatch."""
    program = program_after(("partition",))
    program.config.policy = policy
    program = schedule.run(program, None).program
    n, m = len(program.plan.packs), program.plan.microbatches
    fwd = op_args(program, ops.forward)
    if policy == "harmony":
        assert fwd == [(p, k) for p in range(n) for k in range(m)]
    else:
        assert fwd == [(p, k) for k in range(m) for p in range(n)]
    assert len(op_args(program, ops.backward)) == n * m and len(op_args(program, ops.step)) == n


def test_the_offload_pass_places_a_program_it_is_handed(tmp_path):
    """A scheduled program given a host budget by hand: the offload pass writes every pack's placement into its
    residency record (host steps; the first-stepped packs' optimizer state on disk), and each step op says the
    same ``where`` its record does."""
    def placed(host_budget):
        program = program_after(("partition", "schedule"), frac=0.3)
        assert all(r == Residency() for r in program.plan.residency.values())    # nothing placed yet
        program.config.optimizer_on, program.config.offload_dir = "host", str(tmp_path)
        program.config.host_memory_budget = host_budget
        return offload.run(program, None)
    roomy = placed(1 << 40)
    assert set(roomy.program.plan.by_pack("optim_on").values()) == {"host"}
    optim = sum(p.optim_bytes for p in roomy.program.plan.packs)
    program = placed(roomy.report.totals["host_planned_bytes"] - optim // 2).program
    records = program.plan.by_pack("optim_on")
    assert set(program.plan.by_pack("step_on").values()) == {"host"}
    assert "disk" in records.values() and "host" in records.values()
    for n in program.schedule.nodes:
        if n.op == "call_function" and n.target is ops.step:
            assert n.kwargs["where"] == "host"
    # the simulator reads the same records: the disk packs' steps read and write their optimizer state
    disk = [p for p, where in records.items() if where == "disk"]
    disk_speed = types.SimpleNamespace(disk_read_bandwidth=1e9, disk_write_bandwidth=1e9)
    io = {n.args[0]: ops.op_of(n).disk_io(program.plan, n, disk_speed)
          for n in program.schedule.nodes if n.op == "call_function" and n.target is ops.step}
    assert all(io[p]["read"] > 0 and io[p]["write"] > 0 for p in disk)
    assert all(io[p] == {"read": 0, "write": 0} for p in records if p not in disk)


def test_the_prefetch_pass_hoists_within_the_budget_it_is_handed():
    """A swapped program handed to prefetch with its budget raised by hand hoists its swap-ins over more compute
    than under the budget it was planned for, and under either the predicted peak stays within the budget."""
    passes = ("partition", "schedule", "offload", "compress", "swap")
    program, roomy = program_after(passes, frac=0.3), program_after(passes, frac=0.3)
    roomy.config.memory_budget = program.config.memory_budget * 4
    overlapped = {}
    for name, prog in (("planned", program), ("roomy", roomy)):
        report = prefetch.run(prog, None).report
        overlapped[name] = report.totals["ops_overlapped"]
        assert memory_curve(prog, check_residency=True).peak <= prog.config.usable_budget
    assert overlapped["roomy"] > overlapped["planned"] > 0


def test_a_placement_is_one_field_that_the_memory_model_the_simulator_and_the_report_read():
    """Keeping a pack's optimizer state on the device is one field of its record: the memory curve holds those
    bytes for the whole run, the simulator's traffic drops by them, and the report's packs table says so."""
    program = program_after(("partition", "schedule", "offload", "compress", "swap"), frac=0.3, optimizer_on="device")
    plan = program.plan
    pack = next(p for p, r in plan.residency.items() if "optim" not in r.kept and plan.packs[p].optim_bytes)
    before = memory_curve(program, check_residency=False)
    hw = harmony.compiler.hardware.Hardware.preset("gtx1080ti")
    sim_before = simulate(program.schedule, plan, hw)
    plan.at(pack).kept = plan.at(pack).kept | {"optim"}
    after = memory_curve(program, check_residency=False)
    assert min(after.before) - min(before.before) == plan.packs[pack].optim_bytes
    assert sim_before.moved["h2d"] - simulate(program.schedule, plan, hw).moved["h2d"] >= 0
    assert (pack, "optim") in plan.kept() and plan.at(pack).has("optim")
    assert set(STATE_KINDS) >= plan.at(pack).kept
