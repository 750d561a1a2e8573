"""The pieces ``shard_state="full"`` uses on a GPU, run on the CPU device: the gathers' staging buffers (allocated once,
reused; runtime/partitioned/staging.py), the copy engine's ``submit_host`` (the collective off the thread issuing ops),
and what ``check_config`` builds and refuses. On a card, tests/test_cuda.py checks the streams and events behind them
and tests/test_cuda_ranks.py trains two ranks sharing the card bitwise as the replicated run."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from harmony.errors import ConfigError
from harmony.passes.shard import check_config, host_collectives
from harmony.runtime.partitioned.layout import Segment
from harmony.runtime.partitioned.staging import Staging, to_device
from harmony.runtime.tiers.state import CopyEngine


def test_a_buffer_is_made_once_for_the_largest_size_and_reused():
    staging = Staging()
    assert not staging.pin              # the CPU device: pageable, no event
    with staging.hold(100) as a:
        first = a.data_ptr()
        assert a.numel() == 100 and a.dtype == torch.float32
    with staging.hold(60) as b:         # smaller: the same buffer
        assert b.data_ptr() == first and b.numel() == 60
    with staging.hold(300) as c:        # larger: grown, once
        grown = c.data_ptr()
    for n in (300, 10, 299):
        with staging.hold(n) as d:
            assert d.data_ptr() == grown
    assert staging.allocations == 2 and staging.held_bytes() == 300 * 4


def test_holders_at_once_get_their_own_buffers_and_each_dtype_its_own():
    staging = Staging()
    with staging.hold(50) as a, staging.hold(50) as b, staging.hold(50, torch.bfloat16) as c:
        assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3 and c.dtype == torch.bfloat16
    assert staging.allocations == 3
    # a small request takes the smaller free buffer's place, never shrinking the large one
    with staging.hold(500) as big:
        big_ptr = big.data_ptr()
    with staging.hold(10), staging.hold(500) as again:
        assert again.data_ptr() == big_ptr


def test_threads_share_the_pool_and_the_buffers_come_back():
    staging, barrier, seen = Staging(), threading.Barrier(2), []

    def use():
        with staging.hold(1000) as t:
            barrier.wait()           # both hold one now
            seen.append(t.data_ptr())
    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 2 and staging.allocations == 2 and staging.held_bytes() == 2 * 1000 * 4


def test_copies_of_another_dtype_are_cast_on_the_host_as_copy_casts():
    seg = Segment(["a", "b", "c"], [5, 7, 3], [0, 8, 15], [0, 5, 12])
    flat = torch.randn(seg.size, generator=torch.Generator().manual_seed(0)) * 1e3
    dests = {"a": torch.empty(5, dtype=torch.bfloat16), "c": torch.empty(3)}    # "b" not wanted
    staging = Staging()
    to_device(dests, seg, flat, staging)
    assert torch.equal(dests["a"], torch.empty(5, dtype=torch.bfloat16).copy_(flat[0:5]))
    assert torch.equal(dests["c"], flat[12:15])
    assert staging.allocations == 1      # the cast's buffer, of the segment's size, reused next time
    to_device(dests, seg, flat, staging)
    assert staging.allocations == 1


def test_submit_host_on_the_cpu_device_runs_on_the_copy_thread():
    engine = CopyEngine(torch.device("cpu"))
    try:
        got = {}
        fut = engine.submit_host(lambda: got.setdefault("thread", threading.current_thread().name))
        engine.join(fut)
        assert got["thread"].startswith("harmony-copy") and got["thread"] != threading.current_thread().name

        def fail():
            raise ValueError("in the gather")
        with pytest.raises(ValueError, match="in the gather"):     # raised where the wait joins it
            engine.join(engine.submit_host(fail))
    finally:
        engine.close()


def _cfg(device, **kw):
    return SimpleNamespace(**{**dict(optimizer_on="auto", device=device, policy="harmony",
                                     optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3)), **kw})


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "cpu", "meta"])
def test_full_sharding_is_built_for_cuda_devices(device):
    cfg = _cfg(device)
    check_config(cfg, {})
    assert cfg.optimizer_on == "host"


def test_what_is_not_built_on_a_device_is_refused_by_name():
    with pytest.raises(ConfigError, match="device='xpu'.*use device='cuda' or 'cpu', or use shard_state=True"):
        check_config(_cfg("xpu"), {})
    with pytest.raises(ConfigError, match="optimizer_on='device'"):
        check_config(_cfg("cuda", optimizer_on="device"), {})


def test_a_default_group_without_gloo_is_refused_for_its_host_collectives():
    assert host_collectives(None) and host_collectives("gloo") and host_collectives("cpu:gloo,cuda:nccl")
    assert host_collectives("undefined")     # torch's default with no backend named: gloo on the CPU, NCCL on GPUs
    assert not host_collectives("nccl")
