"""The disk tier: optimizer state on disk is bitwise the all-on-host run; files are private and cleaned up;
a full disk or an unwritable path raises OffloadError and leaves nothing behind; direct and buffered I/O."""
import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import harmony
import harmony.runtime.tiers.disk as disk
import harmony.runtime.tiers.iobuffers as iobuffers
import harmony.runtime.tiers.dirs as od
from harmony.errors import BudgetError, OffloadError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.tiers.disk import DiskStore
from harmony.runtime.tiers.memory import MemoryMeter
from models import assert_bitwise, params

CFG = GPTConfig(layers=4, width=64, vocab=64, seq=16, tie=False)
TINY = GPTConfig(layers=2, width=32, vocab=64, seq=16, tie=False)     # for the error paths: quicker to compile
DATA = list(copy_task(CFG, 8, 3))
ROOT = Path(__file__).resolve().parents[1]


def model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return GPT(cfg)


def state_bytes(m) -> int:
    return 16 * sum(p.numel() for p in m.parameters())      # fp32 parameter, gradient, Adam m and v


def compile_gpt(frac=0.35, cfg=CFG, **kw):
    """The GPT under ``frac`` of its training state on the device, microbatches 4, the step on the host."""
    m = model(cfg=cfg)
    kw.setdefault("weights_on", "host")     # optimizer state alone on disk (test_disk_params.py: weights too)
    return harmony.compile(m, example_batch=DATA[0], memory_budget=int(state_bytes(m) * frac), microbatches=4,
                           optimizer_on="host", **kw)


def smallest_host_budget(cfg=CFG) -> int:
    """The smallest host budget (every pack's optimizer state on disk), as the BudgetError names it."""
    m = model(cfg=cfg)
    with pytest.raises(BudgetError, match="Raise host_memory_budget to at least") as e:
        harmony.compile(m, example_batch=DATA[0], memory_budget=int(state_bytes(m) * 0.35), microbatches=4,
                        optimizer_on="host", host_memory_budget=state_bytes(m) // 4, weights_on="host",
                        passes=("partition", "schedule", "offload"))
    return e.value.min_budget


def train(sm, batches):
    return [sm(x, y).item() for x, y in batches]


def pack_files(path: Path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def offload_dirs(parent: Path):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(disk.PREFIX))


@pytest.fixture(scope="module")
def host_run():
    """The reference: every pack's optimizer state on the host, no host budget."""
    sm = compile_gpt()
    assert set(sm.plan.by_pack("optim_on").values()) == {"host"}
    losses = train(sm, DATA)
    p = params(sm)
    sm.close()
    return losses, p


@pytest.fixture(scope="module")
def min_host_budget():
    return smallest_host_budget()


@pytest.fixture(scope="module")
def tiny_budget():
    return smallest_host_budget(TINY)


@pytest.fixture(scope="module")
def disk_run(min_host_budget, tmp_path_factory):
    """Every pack's optimizer state on disk: one step, a checkpoint and a state dict, two more steps."""
    root = tmp_path_factory.mktemp("disk_run")
    sm = compile_gpt(host_memory_budget=min_host_budget, offload_dir=root)
    losses = train(sm, DATA[:1])
    harmony.save(sm, root / "ckpt")
    sd = sm.training_state_dict()            # in memory: the disk state read back into real tensors
    sd["model"] = {n: t.clone() for n, t in sd["model"].items()}      # (it references the live parameters)
    sd["optimizer"] = {n: {k: v.clone() for k, v in st.items()} for n, st in sd["optimizer"].items()}
    losses += train(sm, DATA[1:])
    store = sm.runtime.state.disk.store
    yield dict(sm=sm, losses=losses, root=root, ckpt=root / "ckpt", sd=sd, store=store)
    sm.close()
    assert not store.path.exists() and offload_dirs(root) == []


# -- numerics ----------------------------------------------------------------------------------
def test_disk_placement_is_bitwise_the_all_on_host_run(host_run, disk_run):
    sm, store = disk_run["sm"], disk_run["store"]
    assert set(sm.plan.by_pack("optim_on").values()) == {"disk"} and len(sm.plan.packs) > 1
    assert store.direct, store.why          # /tmp here is ext4: the probe finds O_DIRECT
    assert disk_run["losses"] == host_run[0]
    assert_bitwise(sm, host_run[1])
    # every step read and wrote every pack's state, by direct I/O, and the report says how fast
    c = store.stats()
    assert c["direct_ops"] > 0 and c["buffered_ops"] == 0
    s = sm.stats
    assert s["disk_read_bytes"] > 0 and s["disk_write_bytes"] == s["disk_read_bytes"]
    assert s["disk_read_GBps"] > 0 and s["disk_write_GBps"] > 0
    # each pack's state was read ahead of its step, and at most two packs' buffers were alive at once
    assert s["disk_reads_not_ahead"] == 0
    biggest = max(store.file(p.index).stat().st_size for p in sm.plan.packs)
    assert 0 < s["disk_buffer_peak_bytes"] <= 2 * (biggest + disk.ALIGN)
    report = sm.report()
    assert "disk_read_GBps" in report and "disk_write_GBps" in report and "direct I/O" in report
    offload = next(r for r in sm.program.reports if r.title.startswith("offload"))
    assert [r["optimizer_state"] for r in offload.rows] == ["disk"] * len(sm.plan.packs)
    assert offload.totals["step_disk_read_bytes"] == sum(p.optim_bytes for p in sm.plan.packs)
    assert offload.totals["host_planned_bytes"] <= offload.totals["host_budget_bytes"]
    # between steps the optimizer holds meta placeholders for what is on disk, real scalars (Adam's step)
    for opt in sm.optimizers:
        for st in opt.state.values():
            assert st["exp_avg"].device.type == "meta" and st["exp_avg_sq"].device.type == "meta"
            assert st["step"].device.type == "cpu" and st["step"].item() == len(DATA)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
    assert pack_files(store.path) == [f"pack-{p.index:03d}.bin" for p in sm.plan.packs]


def test_mixed_placement_buffered_io_is_bitwise_too(host_run, tmp_path, monkeypatch):
    """Smaller packs (25% device budget): the first-stepped packs go to disk, the last-stepped stay on the host."""
    monkeypatch.setenv("HARMONY_DIRECT_IO", "0")
    m = model()
    sm = compile_gpt(frac=0.25, host_memory_budget=int(state_bytes(m) * 0.8), offload_dir=tmp_path)
    placed = sm.plan.by_pack("optim_on")
    assert {"host", "disk"} <= set(placed.values())
    order = disk.step_order(sm.graph)
    kinds = [placed[p] for p in order]       # disk packs first in step order, then host ones
    assert kinds == sorted(kinds, key=lambda k: k == "host")
    assert order == sorted(order, reverse=True)    # the harmony policy steps packs last to first
    store = sm.runtime.state.disk.store
    assert not store.direct and "forced" in store.why
    assert train(sm, DATA) == host_run[0]
    assert_bitwise(sm, host_run[1])
    c = store.stats()
    assert c["buffered_ops"] > 0 and c["direct_ops"] == 0
    assert sm.stats["disk_reads_not_ahead"] == 0
    assert "buffered I/O" in sm.report()
    path = store.path
    sm.close()
    assert not path.exists() and offload_dirs(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this system")
def test_on_the_cpu_device_the_host_thread_runs_at_idle_priority(disk_run):
    """Its optimizer steps share the cores with the compute's OpenMP team and the disk threads: they run where
    those leave a core; the thread that runs the schedule, the copy thread and the disk threads keep theirs."""
    from harmony.base.process import runs_when_idle
    sm = disk_run["sm"]
    state = sm.runtime.state
    host = list(state.host_pool._threads)
    others = [t for pool in (state.copier.pool, state.disk.store.pool, state.disk.store._spans) for t in pool._threads]
    assert host and any(t.name.startswith("harmony-disk") for t in others)
    assert all(runs_when_idle(t.native_id) for t in host)
    assert not [t.name for t in others + [threading.main_thread()] if runs_when_idle(t.native_id)]
    assert sm.stats["background_idle_priority"] is True
    assert "host thread" in sm.report() and "idle priority" in sm.report()


def test_a_pools_job_lets_go_of_its_arguments_before_its_future_is_done(monkeypatch):
    """The standard pool's worker holds a job's arguments until after it sets the future; harmony's pools drop them
    first, so a buffer a job filled is freed (and off the device's meter) when whoever waited on it goes on."""
    import concurrent.futures.thread as pool_thread
    import weakref
    from harmony.base.process import started_pool
    seen_done = threading.Event()
    run = pool_thread._WorkItem.run

    def dawdling(item):           # the worker waits for a core after the job, until the test has looked
        run(item)
        seen_done.wait(5)
    pool = started_pool(1, "harmony-test")
    monkeypatch.setattr(pool_thread._WorkItem, "run", dawdling)
    try:
        for how in ("returns", "raises"):
            buf = torch.empty(1024)
            gone = weakref.ref(buf.untyped_storage())
            meter = MemoryMeter("probe")
            meter.track(buf)
            fut = pool.submit(fill, buf, how)
            del buf
            assert (fut.exception(5) is None) == (how == "returns")
            alive = gone() is not None
            seen_done.set()
            assert not alive and meter.live == 0, how
            seen_done.clear()
    finally:
        seen_done.set()
        pool.shutdown()


def fill(buf: torch.Tensor, how: str) -> None:
    buf.fill_(1.0)
    if how == "raises":
        raise OffloadError("the disk is gone")


def test_a_host_budget_below_the_minimum_names_it(min_host_budget):
    m = model()
    assert state_bytes(m) // 4 < min_host_budget < state_bytes(m)   # the fixture's BudgetError named it


# -- checkpoints ---------------------------------------------------------------------------------
def test_checkpoints_read_and_write_disk_state_pack_by_pack(host_run, disk_run, min_host_budget, tmp_path):
    assert all(st["exp_avg"].device.type == "cpu" for st in disk_run["sd"]["optimizer"].values())
    b = compile_gpt(host_memory_budget=min_host_budget, offload_dir=tmp_path)
    harmony.load(b, disk_run["ckpt"])           # written to b's files, pack by pack
    for opt in b.optimizers:
        assert all(st["exp_avg"].device.type == "meta" for st in opt.state.values())
    assert train(b, DATA[1:]) == host_run[0][1:]
    assert_bitwise(b, host_run[1])
    b.load_training_state_dict(disk_run["sd"])           # the in-memory state dict: back to after step 1
    train(b, DATA[1:])
    assert_bitwise(b, host_run[1])
    b.close()


# -- files: permissions, cleanup, errors --------------------------------------------------------
def test_the_directory_is_private_and_removed_on_close_and_on_an_exception(tmp_path):
    with DiskStore(tmp_path) as store:
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
        (t,) = store.empty([((1000,), torch.float32)])
        t.normal_()
        store.write(0, [t]).result()
        assert stat.S_IMODE(store.file(0).stat().st_mode) == 0o600
    assert not store.path.exists() and store.closed
    with pytest.raises(KeyError):
        with DiskStore(tmp_path) as store:
            raise KeyError("boom")
    assert not store.path.exists()
    store = DiskStore(tmp_path)
    path = store.path
    del store                      # garbage collected: weakref.finalize removes it
    assert not path.exists()
    # a directory of a process killed with SIGKILL (no exit handlers) goes when the next store starts
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from harmony.runtime.tiers.dirs import machine_tag     # named for this host and boot, a pid that is gone
    stale = tmp_path / f"{disk.PREFIX}{dead.pid}-{machine_tag()}-abc"
    stale.mkdir()
    with DiskStore(tmp_path) as store:
        assert store.stale_removed == [stale.name] and not stale.exists()
    assert offload_dirs(tmp_path) == []


def test_an_exception_inside_a_step_leaves_no_directory(tiny_budget, tmp_path):
    sm = compile_gpt(cfg=TINY, host_memory_budget=tiny_budget, offload_dir=tmp_path)
    train(sm, DATA[:1])

    def broken(*a, **k):
        raise RuntimeError("injected failure in the optimizer step")
    sm.optimizers[0].step = broken
    with pytest.raises(RuntimeError, match="injected"):
        sm(*DATA[1])
    path = sm.runtime.state.disk.store.path
    assert path.exists()
    sm.close()
    assert not path.exists()
    # and in a process that dies of the exception: removed at exit
    script = textwrap.dedent(f"""
        import sys, torch, harmony
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_disk import compile_gpt, DATA, TINY
        sm = compile_gpt(cfg=TINY, host_memory_budget={tiny_budget}, offload_dir={str(tmp_path)!r})
        sm(*DATA[0])
        print(sm.runtime.state.disk.store.path, flush=True)
        def broken(*a, **k):
            raise RuntimeError("injected failure in the optimizer step")
        sm.optimizers[0].step = broken
        sm(*DATA[1])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "injected failure" in out.stderr
    made = Path(out.stdout.strip().splitlines()[-1])
    assert made.parent == tmp_path and not made.exists()
    assert offload_dirs(tmp_path) == []


def test_enospc_at_the_write_call_raises_offload_error_and_leaves_nothing(tiny_budget, tmp_path, monkeypatch):
    sm = compile_gpt(cfg=TINY, host_memory_budget=tiny_budget, offload_dir=tmp_path)
    tier = sm.runtime.state.disk
    real = disk._pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(disk, "_pwrite", full)
    with pytest.raises(OffloadError, match="file system is full") as e:
        sm(*DATA[0])
    msg = str(e.value) + "".join(getattr(e.value, "__notes__", []))
    assert str(tier.store.path) in msg and "offload_dir=" in msg and "harmony.load" in msg
    assert pack_files(tier.store.path) == []         # no partial files
    # nothing was lost: the state stayed in memory, and with room again the next step writes it
    monkeypatch.setattr(disk, "_pwrite", real)
    sm(*DATA[1])
    assert len(pack_files(tier.store.path)) == len(sm.plan.packs)
    path = tier.store.path
    sm.close()
    assert not path.exists() and offload_dirs(tmp_path) == []


def test_a_disk_without_room_for_the_plan_is_refused_before_anything_is_written(tiny_budget, tmp_path, monkeypatch):
    sm = compile_gpt(cfg=TINY, host_memory_budget=tiny_budget, offload_dir=tmp_path)
    planned = harmony.viz.report.tiers_of(sm.program)["disk_bytes"]
    sm.close()
    assert planned > 0
    real = shutil.disk_usage

    def small(path):    # the disk under tmp_path, with a little less free than the plan needs
        return real(path)._replace(free=planned)
    monkeypatch.setattr(od.shutil, "disk_usage", small)
    target = tmp_path / "not-yet"
    with pytest.raises(OffloadError, match=f"on disk under {target}, whose file system has .* free .*offload_dir="):
        compile_gpt(cfg=TINY, host_memory_budget=tiny_budget, offload_dir=target)
    assert not target.exists()        # refused before its directory was made


def test_a_real_full_file_system(tmp_path):
    """A 64 KiB tmpfs: the write fails with ENOSPC, the partial file is removed (needs root to mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with DiskStore(mnt) as store:
            (t,) = store.empty([((1 << 20,), torch.float32)])
            with pytest.raises(OffloadError, match="file system is full: free at least 4.00 MiB"):
                store.write(0, [t]).result()
            assert pack_files(store.path) == []
        assert offload_dirs(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_an_unwritable_offload_dir_is_a_clear_error(tiny_budget, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(OffloadError, match="create the offload directory .* pass another offload_dir="):
        DiskStore(afile / "sub")

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path))
    monkeypatch.setattr(disk.tempfile, "mkdtemp", denied)
    with pytest.raises(OffloadError, match="not writable"):
        compile_gpt(cfg=TINY, host_memory_budget=tiny_budget, offload_dir=tmp_path)


# -- I/O paths ----------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [None, False])
def test_round_trip_direct_and_buffered(tmp_path, direct):
    with DiskStore(tmp_path, direct=direct) as store:
        assert store.direct == (direct is None)        # ext4 takes O_DIRECT; False forces buffered
        specs = [((300, 7), torch.float32), ((5,), torch.bfloat16), ((3, 3), torch.float64)]
        views = store.empty(specs)
        assert views[0].data_ptr() % disk.ALIGN == 0
        for v in views:
            v.copy_(torch.randn(v.shape).to(v.dtype))
        store.write(1, views).result()
        assert store.file(1).stat().st_size % disk.ALIGN == 0
        back = store.empty(specs)
        store.read(1, into=back).result()
        assert all(torch.equal(a, b) for a, b in zip(views, back))
        # tensors from anywhere go through an aligned staging buffer
        plain = [torch.randn(1001), torch.randn(2, 2)]
        store.write(2, plain)
        got = [torch.empty(1001), torch.empty(2, 2)]
        store.read(2, into=got).result()          # waits for the write of the same pack
        assert all(torch.equal(a, b) for a, b in zip(plain, got))
        c = store.stats()
        assert c["read_bytes"] == c["write_bytes"] > 0 and c["read_GBps"] > 0 and c["write_GBps"] > 0
        assert (c["direct_ops"] > 0) == store.direct and (c["buffered_ops"] > 0) != store.direct


def test_buffers_are_reused_once_their_last_view_is_gone_and_unmapped_at_close(tmp_path):
    """A step asks for the same buffer sizes each time: a freed buffer's memory serves the next of its size
    (the kernel zeroes a page once, not per read), never while any view of it, a parameter's ``.data``
    included, is alive; reads into a reused buffer see the file, not what was there; close unmaps them."""
    import gc
    assert iobuffers.Buffers(keep=0).take(5 << 20) is not None          # keeps nothing: a freed buffer is unmapped
    pool = iobuffers.Buffers(keep=26 << 20)
    a = pool.take(5 << 20)
    assert a.data_ptr() % (2 << 20) == 0 and a.numel() == 5 << 20          # huge-page aligned from 4 MiB
    p = torch.nn.Parameter(torch.empty(1))
    p.data = a[4096:8192].view(torch.float32)
    del a
    gc.collect()
    b = pool.take(5 << 20)
    assert pool.reuses == 0 and b.data_ptr() != p.data.data_ptr() - 4096    # in use: a new mapping
    del p
    gc.collect()
    c = pool.take(5 << 20)
    # whole 2 MiB pages (5 -> 6 MiB), mapped with 2 MiB more to align them
    assert pool.reuses == 1 and pool.held == 2 * (8 << 20)
    del b, c
    gc.collect()
    assert pool.free_bytes == 2 * (6 << 20) and pool.held == 2 * (8 << 20)
    five = [pool.take(5 << 20) for _ in range(5)]      # 5 in use at once, then freed: only what fits ``keep`` stays
    del five
    gc.collect()
    assert pool.free_bytes == 4 * (6 << 20) and pool.held == 4 * (8 << 20)
    with DiskStore(tmp_path) as store:
        specs = [((1000, 100), torch.float32)]
        for step in range(3):
            v = store.empty(specs)[0]
            v.copy_(torch.full((1000, 100), float(step)))
            store.write(0, [v]).result()
            del v
            back = store.empty(specs)[0]
            back.fill_(-1.0)
            store.read(0, into=[back]).result()
            assert torch.equal(back, torch.full((1000, 100), float(step)))
            del back
            gc.collect()
        st = store.stats()
        assert st["buffer_reuses"] >= 4 and st["buffer_pool_bytes"] <= 2 * disk.layout(specs)[1]
        assert st["buffer_bytes"] == 0
    assert store.buffers.held == 0


def test_by_default_the_pool_keeps_what_was_once_in_use_and_no_more():
    """keep=None (the stores' default): freed buffers stay while the bytes in use and free together are within
    the most ever in use at once, so a step that asks for the same sizes again maps nothing anew; a size not
    seen before first unmaps free buffers of other sizes."""
    import gc
    MiB = 1 << 20
    pool = iobuffers.Buffers()

    def within():
        return pool.in_use + pool.free_bytes <= pool.high
    three = [pool.take(8 * MiB) for _ in range(3)]
    del three
    gc.collect()
    assert pool.high == pool.free_bytes == pool.fresh == 24 * MiB and within()
    again = [pool.take(8 * MiB) for _ in range(3)]          # the next step: all three reused
    assert pool.reuses == 3 and pool.fresh == 24 * MiB and within()
    del again
    gc.collect()
    other = pool.take(12 * MiB)                             # two free 8 MiB buffers unmapped to make room
    assert pool.free_bytes == 8 * MiB and pool.fresh == 36 * MiB and within()
    del other
    gc.collect()
    assert pool.free_bytes == 20 * MiB and within()
    burst = [pool.take(8 * MiB) for _ in range(4)]          # more at once than ever before: the limit rises
    assert pool.high == 32 * MiB and pool.free_bytes == 0 and within()
    del burst
    gc.collect()
    assert pool.free_bytes == 32 * MiB and within()
    reuses = pool.reuses
    near = pool.take(7 * MiB + 5)                           # whole 2 MiB pages: an 8 MiB buffer serves it
    assert pool.reuses == reuses + 1 and near.numel() == 7 * MiB + 4096
    # the device's meter counts storages: a buffer's storage is the bytes taken, not the 8 MiB mapping (or
    # its 2 MiB alignment pad), else the logical device overshoots the plan by what the pool happens to hold
    meter = MemoryMeter("dev")
    meter.track(near[4096:].view(torch.float32))
    assert near.untyped_storage().nbytes() == meter.live == 7 * MiB + 4096
    del near
    gc.collect()
    pool.clear()
    assert pool.held == pool.free_bytes == 0


def test_on_the_cpu_device_free_buffers_stay_within_the_room_its_budget_leaves():
    """share_room: the CPU device's tensors and the pool's free buffers are the same memory, so the free ones are
    kept only while they and the device's live bytes fit its budget, and are unmapped as the device grows."""
    import gc
    MiB = 1 << 20
    meter = MemoryMeter("dev", budget=40 * MiB)
    pool = iobuffers.Buffers()
    pool.share_room(meter)

    def within():
        return meter.live + pool.free_bytes <= meter.budget
    three = [pool.take(8 * MiB) for _ in range(3)]
    for b in three:
        meter.track(b)                                      # weights read into the device, as read_params does
    del three, b
    gc.collect()
    assert meter.live == 0 and pool.free_bytes == 24 * MiB and within()   # all kept: the device has room
    acts = [torch.empty(4 * MiB, dtype=torch.uint8) for _ in range(5)]
    for a in acts:
        meter.track(a)                                      # activations the forward makes: the pool gives way
    assert meter.live == 20 * MiB and pool.free_bytes == 16 * MiB and within()
    more = torch.empty(12 * MiB, dtype=torch.uint8)
    meter.track(more)
    assert pool.free_bytes <= 8 * MiB and within()
    again = pool.take(8 * MiB)                              # the room left serves a read without mapping anew
    meter.track(again)
    fresh = pool.fresh
    del again
    gc.collect()
    assert pool.fresh == fresh and within()
    del acts, a, more
    gc.collect()
    keep = pool.free_bytes
    big = [pool.take(8 * MiB) for _ in range(2)]            # with the device empty again, buffers freed are kept
    del big
    gc.collect()
    assert pool.free_bytes >= keep and within()
    pool.clear()


@pytest.mark.parametrize("direct", [None, False])
def test_a_rewrite_overwrites_the_file_in_place_and_a_shorter_layout_shrinks_it(tmp_path, monkeypatch, direct):
    """Each step writes a pack's file again: into its blocks (never opened with O_TRUNC, which freed and
    reallocated them, 2-5x slower on ext4); a write of fewer tensors (weights before any optimizer
    state) leaves a file of exactly its layout, and what is read back is what was written last."""
    flags, real = [], disk._open
    monkeypatch.setattr(disk, "_open", lambda path, fl, *a: (flags.append((str(path), fl)), real(path, fl, *a))[1])
    with DiskStore(tmp_path, direct=direct) as store:
        long_specs = [((1000, 100), torch.float32), ((1000, 100), torch.float32)]
        first = store.empty(long_specs)
        for v in first:
            v.copy_(torch.randn(v.shape))
        store.write(0, first).result()
        ino, size = store.file(0).stat().st_ino, store.file(0).stat().st_size
        again = [torch.randn(1000, 100), torch.randn(1000, 100)]
        store.write(0, again).result()
        assert (store.file(0).stat().st_ino, store.file(0).stat().st_size) == (ino, size)
        back = store.empty(long_specs)
        store.read(0, into=back).result()
        assert all(torch.equal(a, b) for a, b in zip(again, back))
        short = [torch.randn(1000, 10)]
        store.write(0, short).result()
        assert store.file(0).stat().st_size == disk.layout([((1000, 10), torch.float32)])[1] < size
        got = [torch.empty(1000, 10)]
        store.read(0, into=got).result()
        assert torch.equal(got[0], short[0])
    writes = [fl for path, fl in flags if fl & os.O_WRONLY and path == str(store.file(0))]
    assert len(writes) == 3 and not any(fl & os.O_TRUNC for fl in writes)


@pytest.mark.parametrize("direct", [None, False])
def test_a_file_written_from_two_buffers_reads_back_whole_and_its_tail_alone(tmp_path, monkeypatch, direct):
    """``write_parts``: a file from a head buffer and a tail buffer that starts at a 4 KiB offset (the disk
    step writes a group's weights from the device's copy and its state from its own buffer); ``read_at``
    reads the tail alone into a buffer that starts there. Chunks smaller than the parts: every part is
    written in pieces at its own offsets."""
    monkeypatch.setattr(disk, "CHUNK", 8 << 10)
    specs = [((3000,), torch.float32), ((5000,), torch.float32), ((700,), torch.float64)]
    offsets, total = disk.layout(specs)
    at = offsets[1] // disk.ALIGN * disk.ALIGN
    assert 0 < at < offsets[1]            # the state's first page also holds the weights' last bytes
    with DiskStore(tmp_path, direct=direct) as store:
        whole = store.empty(specs)
        for v in whole:
            v.copy_(torch.randn(v.shape, dtype=v.dtype))
        head = store.buffers.take(offsets[1])
        tail = store.buffers.take(total - at)
        src, _ = store.file_range(whole)
        head[:offsets[1]].copy_(src[:offsets[1]])
        tail.copy_(src[at:])
        store.write_parts(0, [(head[:at], 0), (tail, at)], total).result()
        assert store.file(0).stat().st_size == total
        back = store.empty(specs)
        store.read(0, into=back).result()
        assert all(torch.equal(a, b) for a, b in zip(whole, back))
        got = store.buffers.take(total - at)
        store.read_at(0, got, at).result()
        assert torch.equal(got, tail)
        assert store.stats()["read_issued"] == total + (total - at)
        with pytest.raises(ValueError, match="4 KiB-aligned"):
            store.read_at(0, got, at + 8)


@pytest.mark.parametrize("direct", [None, False])
def test_a_read_runs_in_ranges_at_once_and_a_short_file_is_an_error(tmp_path, monkeypatch, direct):
    """A file of many chunks is read by READ_DEPTH concurrent preadv calls over whole chunks; read_tail
    starts at its 4 KiB boundary; a file cut short raises OffloadError, not a half-filled buffer."""
    monkeypatch.setattr(disk, "CHUNK", 64 << 10)
    assert disk._spans(0, 10 * (64 << 10) + 5, 4) == [(0, 3 << 16), (3 << 16, 6 << 16), (6 << 16, 9 << 16),
                                                      (9 << 16, 10 * (64 << 10) + 5)]
    assert disk._spans(4096, 8192, 4) == [(4096, 8192)]
    seen, real, lock = [], disk._preadv, threading.Lock()
    flight = [0, 0]                    # calls in flight now, and the most at once

    def preadv(fd, bufs, at):
        with lock:
            seen.append(at)
            flight[0] += 1
            flight[1] = max(flight)
        time.sleep(0.02)               # long enough for the other ranges' calls to start
        try:
            return real(fd, bufs, at)
        finally:
            with lock:
                flight[0] -= 1
    monkeypatch.setattr(disk, "_preadv", preadv)
    with DiskStore(tmp_path, direct=direct) as store:
        specs = [((3,), torch.int64), ((300_000,), torch.float32), ((1000,), torch.float64)]
        views = store.empty(specs)
        for v in views:
            v.copy_(torch.randn(v.shape).to(v.dtype) * 1000)
        store.write(0, views).result()
        seen.clear()
        back = store.empty(specs)
        store.read(0, into=back).result()
        assert all(torch.equal(a, b) for a, b in zip(views, back))
        assert flight[1] == min(store.read_depth, 19) > 1          # 1.2 MB: 19 chunks, in up to 4 ranges at once
        assert sorted(seen) == list(range(0, store.file(0).stat().st_size, 64 << 10))
        issued = store.stats()["read_issued"]
        fut, part, (buf, at, first) = store.read_tail(0, specs, 1)     # the file from the page entry 1 starts on
        fut.result()
        offsets, total = disk.layout(specs)
        assert (at, first) == (offsets[1] // disk.ALIGN * disk.ALIGN, offsets[1]) and buf.numel() == total - at
        assert part[0] is None and torch.equal(part[1], views[1]) and torch.equal(part[2], views[2])
        assert store.stats()["read_issued"] - issued == total - at
        fut, part, (buf, at, first) = store.read_tail(0, specs, 3)     # nothing after the skipped: no read
        assert fut.done() and part == [None] * 3 and buf is None and at == first == total
        os.truncate(store.file(0), 256 << 10)
        with pytest.raises(OffloadError, match="short of"):
            store.read(0, into=store.empty(specs)).result()


def test_the_probe_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    """tmpfs before Linux 6.6 (and some network file systems) refuse O_DIRECT at open with EINVAL."""
    real = disk._open

    def no_direct(path, flags, *mode):
        if flags & disk.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real(path, flags, *mode)
    monkeypatch.setattr(disk, "_open", no_direct)
    with DiskStore(tmp_path) as store:
        assert not store.direct and "refuses O_DIRECT" in store.why
        (t,) = store.empty([((100,), torch.float32)])
        store.write(0, [t]).result()
        assert store.stats()["buffered_ops"] == 1
    with pytest.raises(OffloadError, match="direct I/O was required"):
        DiskStore(tmp_path, direct=True)
    assert offload_dirs(tmp_path) == []
