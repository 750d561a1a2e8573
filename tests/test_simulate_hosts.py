"""What the ranks of one host share in the node simulator (runtime/simulate/node.py, runtime/simulate/shared.py):
the host's cores and memory bus. Ranks on one host slow each other; a rank alone, or a host without
``host_cores``, simulates as before; emulated devices need a core only for their own time; the summary says so.
No processes are spawned."""
from __future__ import annotations

import pytest
import torch

import harmony
from harmony.compiler.hardware import Hardware
from harmony.compiler.verify import state_sizes
from harmony.errors import ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.simulate import simulate
from harmony.runtime.simulate.node import simulate_node
from harmony.runtime.simulate.shared import Shared

CFG = GPTConfig(layers=4, width=64, heads=4, vocab=128, seq=32, tie=False)


@pytest.fixture(scope="module")
def rank():
    torch.manual_seed(0)
    model = GPT(CFG)
    batch = next(iter(copy_task(CFG, 8, 1, seed=0)))
    budget = int(0.6 * 16 * sum(p.numel() for p in model.parameters()))     # it swaps: copies and compute
    sm = harmony.compile(model, batch, memory_budget=budget, microbatches=2)
    yield (sm.graph, sm.plan, sm.predicted, state_sizes(sm.program)), budget
    sm.close()


def _cpu(budget, count, cores, hosts=(), factor=1.0):
    """``count`` logical CPU devices (``sync_copies``: their compute is the host's), on hosts of ``cores``."""
    return Hardware.detect().logical([budget] * count, [factor] * count).replace(host_cores=cores, hosts=hosts)


def test_two_ranks_on_one_core_take_twice_as_long_as_on_two_hosts(rank):
    inputs, budget = rank
    shared = simulate_node([inputs] * 2, _cpu(budget, 2, 1))
    apart = simulate_node([inputs] * 2, _cpu(budget, 2, 1, hosts=((0,), (1,))))
    alone = simulate(*inputs[:2], _cpu(budget, 1, 1), memory=inputs[2], sizes=inputs[3])
    assert apart.step_seconds == alone.step_seconds           # a rank alone on its host: as simulated alone
    # about twice: the core computes one rank's ops at a time; a little more, since a rank's copies on the copy
    # thread no longer run beside its compute when the one core is taken (alone, a rank's streams are not shared)
    assert 1.8 < shared.step_seconds / apart.step_seconds < 2.5
    # a core each: only their copies (two memcpys fill the bus) and copy threads beside compute still meet
    assert apart.step_seconds <= simulate_node([inputs] * 2, _cpu(budget, 2, 2)).step_seconds < shared.step_seconds


def test_a_host_without_cores_given_shares_nothing(rank):
    inputs, budget = rank
    hw = _cpu(budget, 3, 0)
    assert simulate_node([inputs] * 3, hw).step_seconds == \
        simulate(*inputs[:2], hw, memory=inputs[2], sizes=inputs[3]).step_seconds


def test_emulated_ranks_need_a_core_only_for_their_own_time(rank):
    inputs, budget = rank
    apart = simulate_node([inputs] * 2, _cpu(budget, 2, 1, hosts=((0,), (1,)), factor=4.0))
    shared = simulate_node([inputs] * 2, _cpu(budget, 2, 1, factor=4.0))
    # two devices 4x slower than the core compute a quarter of the time each: one core nearly holds both (their
    # copies, which the emulation does not stretch, still meet)
    assert shared.step_seconds < 1.3 * apart.step_seconds
    three = simulate_node([inputs] * 3, _cpu(budget, 3, 1, factor=1.0))
    assert three.step_seconds > 2.5 * apart.step_seconds / 4.0


def test_the_summary_says_which_devices_share_a_host(rank):
    inputs, budget = rank
    node = simulate_node([inputs] * 3, _cpu(budget, 3, 2))
    text = node.summary()
    assert "host 0: devices 0, 1, 2 share 2 cores" in text
    assert all(r["shared_wait_s"] > 0 for r in node.rows())
    assert "shared_wait_s" in text
    alone = simulate_node([inputs] * 3, _cpu(budget, 3, 2, hosts=((0,), (1,), (2,))))
    assert "host 0:" not in alone.summary() and all(r["shared_wait_s"] == 0 for r in alone.rows())
    assert "devices 0, 1, 2 share one host: 2 cores" in _cpu(budget, 3, 2).describe()


def test_shared_books_first_come_first_served():
    pool = Shared()
    assert pool.book({"cores": (1.0, 2.0)}, 0.0, 1.0) == 1.0
    assert pool.book({"cores": (1.0, 2.0)}, 0.0, 1.0) == 1.0          # the second core
    assert pool.book({"cores": (1.0, 2.0)}, 0.5, 1.0) == 2.0          # none left until the first two end
    # the scarcer of two resources sets the rate: half the bus left, so half speed
    bus = Shared()
    bus.book({"bus": (5.0, 10.0)}, 0.0, 10.0)
    assert bus.book({"cores": (1.0, 1.0), "bus": (10.0, 10.0)}, 0.0, 1.0) == 2.0
    assert bus.used("cores") == pytest.approx(1.0) and bus.used("bus") == pytest.approx(60.0)


def test_bad_hosts_are_refused():
    hw = Hardware.detect().logical([2**20] * 2)
    with pytest.raises(ConfigError, match="at most one host"):
        hw.replace(hosts=((0, 1), (1,)))
    with pytest.raises(ConfigError, match="host_cores >= 0"):
        hw.replace(host_cores=-1)
    assert Hardware.detect().host_cores >= 1 and Hardware.preset("a100-40gb").host_cores == 0
