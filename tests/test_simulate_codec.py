"""The CPU work of a quantized all-reduce's codec in the simulator (runtime/ops/reduce.codec_seconds, the ``codec``
stream): a 2 x 2 grid's first pipeline planned on meta tensors (driver/node.plan_node), simulated with codecs of
different rates. The codec's time grows with its work and a slower rate, it takes a core of the host (so on a host
whose ranks share one core it waits for their compute), and fp32 all-reduces cost as before. No processes."""
from __future__ import annotations

import pytest
import torch

from harmony import Hardware
from harmony.driver.node import plan_node, simulate_programs
from harmony.models import GPT, GPTConfig
from harmony.runtime.ops.reduce import codec_seconds
from harmony.runtime.plan import codec_rate


def _grid(hw, compression, width=64):
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=4, width=width, heads=2, vocab=128, seq=32, tie=False))
        ids = torch.zeros(8, 32, dtype=torch.long)
        return plan_node(model, (ids, ids), hw, microbatches=4, replicas=2, compression=compression,
                         memory_budget=2**30)


def _codecs(node):
    return [e for d in node.devices for e in d.events if e.stream == "codec"]


def _reduces(program):
    return [n for n in program.schedule.nodes if n.op == "call_function" and n.target.__name__ == "allreduce"]


@pytest.fixture(scope="module")
def gpus():
    hw = Hardware.node("4x1080ti")
    return hw, _grid(hw, "4bit"), _grid(hw, None)


def test_a_quantized_all_reduce_takes_its_codec_time_and_a_slower_codec_longer(gpus):
    hw, q4, _ = gpus
    node = simulate_programs(q4, hw)
    codecs = _codecs(node)
    expected = [codec_seconds(p.plan, hw, *n.args, **n.kwargs) for p in q4 for n in _reduces(p)]
    assert len(codecs) == len(expected) and all(s > 0 for s in expected)
    assert sum(e.end - e.start for e in codecs) == pytest.approx(sum(expected))
    for d in node.devices:        # each all-reduce's transfer waits for its codec
        ends = {e.name: e.end for e in d.events}
        assert all(ends[e.name[:-len(".codec")]] >= e.end for e in d.events if e.stream == "codec")
    slow = simulate_programs(q4, hw.replace(codec_rates=((4, codec_rate(hw, 4) / 1000),)))
    assert sum(e.end - e.start for e in _codecs(slow)) == pytest.approx(1000 * sum(expected))
    assert slow.step_seconds > node.step_seconds
    # more gradients, more codec work, at the same rate
    wide = _codecs(simulate_programs(_grid(hw, "4bit", width=128), hw))
    assert sum(e.end - e.start for e in wide) > 3 * sum(e.end - e.start for e in codecs)


def test_the_codec_rate_is_read_by_bits_and_fp32_is_not_costed(gpus):
    hw, _, fp32 = gpus
    rated = hw.replace(codec_rates=((1, 5e8), (8, 2e8)))
    assert codec_rate(rated, 2) == 5e8 and codec_rate(rated, 6) == 2e8 and codec_rate(hw, 4) > 0
    assert codec_seconds(fp32[0].plan, rated, 0, "none", world=2) == 0
    assert codec_seconds(fp32[0].plan, rated, 0, "quantized", world=1) == 0
    assert not _codecs(simulate_programs(fp32, hw))
    assert simulate_programs(fp32, rated.replace(codec_rates=((4, 1.0),))).step_seconds == \
        simulate_programs(fp32, hw).step_seconds
    assert "gradient codec per core" in rated.describe()
    assert Hardware.from_dict(__import__("dataclasses").asdict(rated)) == rated


def test_on_a_host_of_one_core_the_codec_waits_for_the_other_ranks_compute():
    hw = Hardware.detect().logical([2**30] * 2).replace(host_cores=1, codec_rates=((4, 2e7),))
    programs = _grid(hw, "4bit")
    apart = simulate_programs(programs, hw.replace(hosts=((0,), (1,))))
    shared = simulate_programs(programs, hw)
    own = sum(codec_seconds(p.plan, hw, *n.args, **n.kwargs) for p in programs for n in _reduces(p))
    # a core of its own: the codec takes its own time
    assert sum(e.end - e.start for e in _codecs(apart)) == pytest.approx(own)
    assert sum(e.end - e.start for e in _codecs(shared)) > own     # it shared the core with compute
    assert shared.step_seconds > apart.step_seconds
    assert sum(shared.waited) > 0
