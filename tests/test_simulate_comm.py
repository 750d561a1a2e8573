"""The simulator's all-reduces (runtime/simulate/, runtime/ops/reduce.socket_seconds): a 2 x 2 grid's first pipeline
planned on meta tensors (driver/node.plan_node), simulated. The runtime runs a rank's all-reduces and host optimizer
steps on one host thread, one at a time, so the simulator does; where the device is the CPU, gloo's socket copies,
sums and fused-buffer copies are CPU work the transfer lasts at least, on a core of the host; on a GPU (NCCL) nothing
changes; a server's ranks pooling their link (``Hardware.network_shared``) send one at a time at the whole link's
rate. No processes."""
from __future__ import annotations

import pytest
import torch

from harmony import Hardware
from harmony.driver.node import plan_node, simulate_programs
from harmony.models import GPT, GPTConfig
from harmony.runtime.ops import op_of
from harmony.runtime.ops.reduce import sent_bytes, socket_seconds
from harmony.runtime.plan import NOMINAL_SOCKET_RATE, socket_rate
from harmony.runtime.simulate import OnHost
from harmony.runtime.simulate.node import pooled_links

def _grid(hw, compression, budget=2**30, layers=4):
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=layers, width=64, heads=2, vocab=128, seq=32, tie=False))
        ids = torch.zeros(8, 32, dtype=torch.long)
        return plan_node(model, (ids, ids), hw, microbatches=4, replicas=2, compression=compression,
                         memory_budget=budget)


def _reduces(program):
    return [n for n in program.schedule.nodes if n.op == "call_function" and n.target.__name__ == "allreduce"]


def _cpu(**kw):
    return Hardware.detect().logical([2**30] * 2).replace(**kw)


def _socket(program, hw, rank, node):
    return socket_seconds(program.plan, OnHost(hw.devices[rank], hw), *node.args, **node.kwargs)


def test_gloo_work_is_costed_on_cpu_devices_by_the_bytes_it_moves():
    cpu, gpu = _cpu(), Hardware.node("4x1080ti")
    fp32, q4 = _grid(cpu, None), _grid(cpu, "4bit")
    node = _reduces(fp32[0])[0]
    seconds = _socket(fp32[0], cpu, 0, node)
    size = fp32[0].plan.packs[node.args[0]].param_bytes
    assert seconds == pytest.approx(2 * sent_bytes(size, "none", 2) / NOMINAL_SOCKET_RATE
                                    + 2 * size / cpu.devices[0].memory_bandwidth)
    assert socket_rate(cpu) == NOMINAL_SOCKET_RATE and socket_rate(cpu.replace(socket_rate=1e6)) == 1e6
    # NCCL on a GPU: none; one rank: nothing to send; 4 bits: fewer bytes, the same fused-buffer copies
    assert socket_seconds(fp32[0].plan, OnHost(gpu.devices[0], gpu), *node.args, **node.kwargs) == 0
    assert socket_seconds(fp32[0].plan, OnHost(cpu.devices[0], cpu), node.args[0], "none", world=1) == 0
    assert 0 < _socket(q4[0], cpu, 0, _reduces(q4[0])[0]) < seconds
    assert _socket(fp32[0], cpu.replace(socket_rate=NOMINAL_SOCKET_RATE / 10), 0, node) > 5 * seconds
    assert Hardware.from_dict(__import__("dataclasses").asdict(cpu.replace(socket_rate=3e9))).socket_rate == 3e9


def test_a_cpu_transfer_lasts_its_gloo_work_and_shares_the_hosts_core():
    # a link so fast that the bytes take no time: before gloo's work was costed the all-reduce took none
    hw = _cpu(network_bandwidth=1e15, network_latency=0.0, host_cores=1)
    programs = _grid(hw, None)
    apart = simulate_programs(programs, hw.replace(hosts=((0,), (1,))))
    for rank, (sim, program) in enumerate(zip(apart.devices, programs)):
        for node in _reduces(program):
            ev = next(e for e in sim.events if e.name == node.name)
            assert ev.end - ev.start == pytest.approx(_socket(program, hw, rank, node)) and ev.end > ev.start
    slow = simulate_programs(programs, hw.replace(hosts=((0,), (1,)), socket_rate=NOMINAL_SOCKET_RATE / 100))
    assert slow.step_seconds > apart.step_seconds
    # on one core shared by both ranks, the work also waits for the other rank's compute there
    shared = simulate_programs(programs, hw)
    assert shared.step_seconds >= apart.step_seconds and sum(shared.waited) > sum(apart.waited)


def test_gpu_all_reduces_cost_as_before():
    hw = Hardware.node("4x1080ti")
    programs = _grid(hw, None)
    node = simulate_programs(programs, hw)
    for sim, program in zip(node.devices, programs):
        for n in _reduces(program):
            ev = next(e for e in sim.events if e.name == n.name)
            stream, seconds = op_of(n).cost(program.plan, OnHost(hw.devices[0], hw), *n.args, **n.kwargs)
            assert stream == "network" and ev.end - ev.start == pytest.approx(seconds)


def test_the_host_thread_runs_all_reduces_and_host_steps_one_at_a_time():
    # a small budget: three packs per rank stepped on the host behind their all-reduce, with a slow codec and link
    hw = Hardware.node("4x1080ti").replace(codec_rates=((4, 2e6),), network_bandwidth=2e6)
    programs = _grid(hw, "4bit", budget=3 << 19, layers=8)
    assert any(n.kwargs.get("where") == "host" for n in programs[0].schedule.nodes if n.op == "call_function"
               and n.target.__name__ == "step")
    node = simulate_programs(programs, hw)
    for sim, program in zip(node.devices, programs):
        reduces = {n.name for n in _reduces(program)}
        thread = sorted((e for e in sim.events if e.end > e.start and (e.stream in ("codec", "host") or (
            e.stream == "network" and e.name in reduces))), key=lambda e: e.start)
        assert len(thread) >= 3
        for before, after in zip(thread, thread[1:]):
            assert after.start >= before.end - 1e-12, (before, after)
        # the step ends after all of the thread's work, done back to back at the least
        assert sim.step_seconds >= sum(e.end - e.start for e in thread)


def test_a_servers_ranks_pooling_their_link_send_one_at_a_time_at_its_whole_rate():
    hw = Hardware.node("4x1080ti").replace(network_bandwidth=1e7, network_latency=0.0)
    programs = _grid(hw, None)
    apart, pooled = simulate_programs(programs, hw), simulate_programs(programs, hw.replace(network_shared=True))

    def transfers(node):
        return [next(e for e in sim.events if e.name == n.name) for sim, p in zip(node.devices, programs)
                for n in _reduces(p)]
    alone = {(e.device, e.name): e.end - e.start for e in transfers(apart)}
    # each device's share alone, its transfer took its time; pooled, they go at the four shares' rate, one after the
    # other (here all four are issued together, as the stages' compute is short): the last lands when the link has
    # carried them all
    pooled_transfers = sorted(transfers(pooled), key=lambda e: e.start)
    assert len(pooled_transfers) == len(programs) == 4
    for e in pooled_transfers:
        assert e.end - e.start <= alone[(e.device, e.name)] + 1e-12
    last = max(e.end for e in pooled_transfers)
    assert last - pooled_transfers[0].start == pytest.approx(sum(alone.values()) / 4)
    assert pooled.step_seconds <= apart.step_seconds
    assert not pooled_links(hw, 4) and pooled_links(hw.replace(network_shared=True), 4)[3] == (0, 4)


def _data_parallel(world=2):
    """A GPT planned as one of ``world`` data-parallel ranks (offline: no process group), packs swapping."""
    import dataclasses

    import harmony
    from harmony.compiler.passmanager import run_passes
    from harmony.driver.replan import another_rank
    from harmony.models import copy_task
    cfg = GPTConfig(layers=4, width=64, heads=4, vocab=128, seq=32, tie=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    budget = int(0.6 * 16 * sum(p.numel() for p in model.parameters()))
    sm = harmony.compile(model, next(iter(copy_task(cfg, 8, 1, seed=0))), memory_budget=budget, microbatches=2)
    config = dataclasses.replace(sm.program.config, data_parallel=True, world_size=world, offline=True)
    program = run_passes(another_rank(sm.program, config), config.passes)
    sm.close()
    return program, budget


def test_a_collective_starts_when_its_last_rank_reaches_it():
    from harmony.runtime.simulate import simulate
    program, budget = _data_parallel()
    reduces = _reduces(program)
    assert len(reduces) > 1
    fast_alone = simulate(program.schedule, program.plan, Hardware.detect().logical([budget]))
    hw = Hardware.detect().logical([budget] * 2, [1.0, 4.0]).replace(hosts=((0,), (1,)), host_cores=1)
    node = simulate_programs([program], hw, replicas=2)
    fast, slow = node.devices

    def at(sim, n):
        return next(e for e in sim.events if e.name == n.name)
    for n in reduces:     # the fast rank waits for the slow one, whose backward made the gradients 4x later
        assert at(fast, n).start == at(slow, n).start > at(fast_alone, n).start
    assert fast.step_seconds > 2 * fast_alone.step_seconds
    # equal ranks: nobody waits, each as alone; a rank whose partner is not simulated here starts alone too
    even = simulate_programs([program], hw.replace(devices=(hw.devices[0],) * 2), replicas=2)
    assert [d.step_seconds for d in even.devices] == [fast_alone.step_seconds] * 2
    one = hw.replace(devices=(hw.devices[1],), hosts=())
    assert simulate_programs([program], one).step_seconds == simulate(program.schedule, program.plan, one).step_seconds


def test_a_pack_of_several_communication_groups_pays_a_collectives_latency_each():
    import dataclasses
    program, budget = _data_parallel()
    node = _reduces(program)[0]
    pack = node.args[0]
    owned = sorted(program.plan.packs[pack].owned)
    hw = Hardware.detect().logical([budget]).replace(network_latency=1e-3)
    op = op_of(node)
    one = op.cost(program.plan, OnHost(hw.devices[0], hw), *node.args, **node.kwargs)[1]
    split = dataclasses.replace(program.plan, comm_groups={pack: [owned[:1], owned[1:2], owned[2:]]})
    three = op.cost(split, OnHost(hw.devices[0], hw), *node.args, **node.kwargs)[1]
    assert len(owned) >= 3 and three - one == pytest.approx(2 * 2 * (2 - 1) * 1e-3)


def test_server_link_is_the_one_way_a_servers_ranks_pool_their_link():
    """``Hardware.server_link(bandwidth, ranks)``: what Grid.simulate and benchmarks/hybrid.py's simulated servers
    both give the simulator; each rank's share and the pool, so a transfer alone has the whole link."""
    from harmony.errors import ConfigError
    hw = Hardware.node("4x1080ti").replace(network_latency=0.0)
    pooled = hw.server_link(4e7, 4)
    assert pooled.network_bandwidth == 1e7 and pooled.network_shared
    programs = _grid(hw, None)
    assert simulate_programs(programs, pooled).step_seconds == pytest.approx(
        simulate_programs(programs, hw.replace(network_bandwidth=1e7, network_shared=True)).step_seconds)
    for bad in ((0.0, 4), (4e7, 0)):
        with pytest.raises(ConfigError, match="positive bytes/s"):
            hw.server_link(*bad)
