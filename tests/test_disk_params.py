"""Packs wholly on disk (fp32 weights and optimizer state in files): bitwise the all-on-host run under
harmony and sequential; no host copy of the weights stays between uses; device peak within the budget
and the prediction; checkpoints resume bitwise and load across placements; a full disk keeps the state
in memory and leaves no partial file; files are private and removed on close; a host budget below
the minimum names it."""
import errno
import os
import stat

import pytest
import torch

import harmony
import harmony.runtime.tiers.disk as disk
from harmony.errors import BudgetError, ConfigError, OffloadError
from harmony.runtime import ops
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.placeholders import is_placeholder
from models import assert_bitwise, params

CFG = GPTConfig(layers=3, width=64, vocab=64, seq=16)          # tied embedding and head: a group of its own
DATA = list(copy_task(CFG, 8, 3))
GROUP = "24KiB"      # several files per pack


def model(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def state_bytes(m) -> int:
    return 16 * sum(p.numel() for p in m.parameters())


def compile_gpt(policy="harmony", seed=0, share=3, **kw):
    """The GPT under 1/``share`` of its training state on the device, the step on the host."""
    m = model(seed)
    kw.setdefault("weights_on", "disk")
    return harmony.compile(m, example_batch=DATA[0], memory_budget=state_bytes(m) // share, microbatches=4,
                           policy=policy, optimizer_on="host", disk_group_bytes=GROUP, **kw)


def train(sm, batches):
    return [sm(x, y).item() for x, y in batches]


def offload_dirs(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(disk.PREFIX))


@pytest.fixture(scope="module", params=["harmony", "sequential"])
def runs(request, tmp_path_factory):
    """The same three steps with every pack's weights on the host, and wholly on disk."""
    ref = compile_gpt(request.param, weights_on="host")
    assert set(ref.plan.by_pack("master_on").values()) == {"host"}
    ref_losses = train(ref, DATA)
    ref_params = params(ref)
    ref.close()
    root = tmp_path_factory.mktemp("weights")
    sm = compile_gpt(request.param, offload_dir=root)
    yield dict(sm=sm, root=root, losses=train(sm, DATA), ref_losses=ref_losses, ref_params=ref_params)
    pd = sm.runtime.state.params_disk
    sm.close()
    assert not pd.store.path.exists() and offload_dirs(root) == []


def disk_params(sm) -> dict:
    """Every parameter's current value, reading wholly-disk packs' weights from their files."""
    return {n: t.clone() for n, t in sm.training_state_dict()["model"].items()}


def test_weights_on_disk_are_bitwise_the_all_on_host_run(runs):
    sm = runs["sm"]
    assert runs["losses"] == runs["ref_losses"]
    assert_bitwise(sm, runs["ref_params"])
    pd = sm.runtime.state.params_disk
    assert set(sm.plan.by_pack("master_on").values()) == {"disk"} and len(pd.groups) > len(sm.plan.packs)
    # the tied embedding/head is read by two packs: it is a file of its own
    tied = [g for g in pd.groups if "tok.weight" in g]
    assert tied == [["tok.weight"]]
    # between steps no parameter holds memory: weights and optimizer state are in the files
    for n, t in sm.program.gm.named_parameters():
        assert is_placeholder(t.data) and t.grad is None, n
    for opt in sm.optimizers:
        for st in opt.state.values():
            assert st["exp_avg"].device.type == "meta" and st["step"].item() == len(DATA)
    assert stat.S_IMODE(pd.store.path.stat().st_mode) == 0o700
    assert len(list(pd.store.path.iterdir())) == len(pd.groups)


def test_the_budget_holds_and_the_prediction_is_close(runs):
    s = runs["sm"].stats
    assert s["measured_peak"] <= s["budget"]
    assert abs(s["predicted_peak"] - s["measured_peak"]) <= 0.10 * s["measured_peak"]
    # the files' free I/O buffers are the CPU device's memory too: kept only in the room its budget leaves
    sm = runs["sm"]
    pool = sm.runtime.state.params_disk.store.buffers
    assert pool in sm.runtime.meter.caches and sm.runtime.meter.live + pool.free_bytes <= s["budget"]


def test_each_file_is_read_ahead_and_the_traffic_is_as_planned(runs):
    sm = runs["sm"]
    s = sm.stats
    files = sum(f.stat().st_size for f in sm.runtime.state.params_disk.store.path.iterdir())
    weights = sum(t.numel() * 4 for t in sm.program.gm.parameters())
    pd = sm.runtime.state.params_disk
    assert s["disk_reads_not_ahead"] == 0
    assert s["disk_write_bytes"] == files                 # every file written once per step
    slack = 3 * 4096 * len(pd.groups)  # per file: two weight reads rounded up to 4 KiB, a state read starting below
    if sm.plan.policy == "harmony":
        # the step takes the backward's weights from the device and reads the optimizer state alone; the
        # weights come in for the forward and the backward (the last pack's once)
        assert pd.handed == set(range(len(sm.plan.packs)))
        last = sum(t.numel() * 4 for n, t in sm.program.gm.named_parameters() if n in sm.plan.packs[-1].owned)
        # the packs stepped last leave their weights on the device for the next forward: read once, or not at all
        assert sm.plan.packs_with("carried") and pd.carry == sm.plan.packs_with("carried")
        kept = {n for p in sm.plan.packs_with("carried") for n in ops.carried_names(sm.plan, p)}
        carried = sum(t.numel() * 4 for n, t in sm.program.gm.named_parameters() if n in kept)
        assert files + weights - last - carried - slack <= s["disk_read_bytes"] <= files + weights - carried + slack
    else:                                                 # sequential: the weights come in for every microbatch
        assert s["disk_read_bytes"] > files + 2 * weights
    # on the CPU device a handed group's step updates the backward's copy of the weights where it is and
    # writes the file from it and from the state's own buffer: no such group copies its weights (after
    # the first step, which made the optimizer state)
    assert s["disk_steps_in_place"] == sum(pd.group_pack[g] in pd.handed for g in pd.files) > 0
    offload = next(r for r in sm.program.reports if r.title.startswith("offload"))
    assert offload.totals["disk_weight_packs"] == len(sm.plan.packs)
    text = sm.report()
    assert "weights" in text and "disk_read_GBps" in text


def test_checkpoints_resume_bitwise_and_load_across_placements(tmp_path):
    ref = compile_gpt()
    ref_losses = train(ref, DATA)
    ref_params = params(ref)
    ref.close()
    a = compile_gpt(offload_dir=tmp_path)
    train(a, DATA[:2])
    harmony.save(a, tmp_path / "ckpt")
    sd = a.training_state_dict()
    sd = dict(sd, model={n: t.clone() for n, t in sd["model"].items()},
              optimizer={n: {k: v.clone() for k, v in s.items()} for n, s in sd["optimizer"].items()})
    a.close()
    b = compile_gpt(seed=1, offload_dir=tmp_path)              # other weights: the load must replace them all
    harmony.load(b, tmp_path / "ckpt")
    assert train(b, DATA[2:]) == ref_losses[2:]
    assert_bitwise(b, ref_params)
    b.close()
    c = compile_gpt(seed=1, weights_on="host")                 # the same state, weights kept on the host
    c.load_training_state_dict(sd)
    assert train(c, DATA[2:]) == ref_losses[2:]
    assert_bitwise(c, ref_params)
    c.close()
    assert offload_dirs(tmp_path) == []


def test_weights_carried_across_steps_skip_their_read_and_a_load_replaces_them(tmp_path):
    """The packs stepped last keep their stepped weights on the device for the next forward (``Residency.carried``): the
    backward's release hands them over with ``carry``, the forward's first swap_in takes them (``carried``),
    nothing is read for it, and a checkpoint loaded in between replaces them."""
    ref = compile_gpt(weights_on="host")
    ref_losses = train(ref, DATA)
    ref_params = params(ref)
    ref.close()
    sm = compile_gpt(offload_dir=tmp_path)
    pd, plan = sm.runtime.state.params_disk, sm.plan
    assert plan.packs_with("carried") and plan.packs_with("carried") != set(range(len(plan.packs)))
    swaps = {}
    for n in sm.graph.nodes:
        if n.op == "call_function" and n.target in (ops.swap_in, ops.release) and n.args[1] == "params":
            swaps.setdefault(n.args[0], []).append(n)
    carried = plan.packs_with("carried")
    for p, nodes in swaps.items():       # graph shape: the first swap_in and the last release of each carried pack
        flags = [(n.target is ops.swap_in, bool(n.kwargs.get("carried") or n.kwargs.get("carry"))) for n in nodes]
        assert flags == ([(True, True)] + [(x, False) for x, _ in flags[1:-1]] + [(False, True)] if p in carried
                         else [(x, False) for x, _ in flags])
    assert all(n.kwargs.get("handoff") for p in plan.packs_with("carried") for n in swaps[p][-1:])
    train(sm, DATA[:1])
    carried = {g for p in plan.packs_with("carried") for g in pd.pack_groups[p] if g not in pd.in_memory}
    assert set(pd._carried) == carried
    # between steps they are on the device, counted by its meter, and up to date with their files
    assert all(sm.runtime.meter.holds(v[0]) for v in pd._carried.values())
    assert sm.runtime.meter.live >= sum(v[0].untyped_storage().nbytes() for v in pd._carried.values())
    on_device = {n: v.clone() for g in carried for (n, _, _, _), v in zip(pd.layouts[g], pd._carried[g])}
    saved = disk_params(sm)
    assert all(torch.equal(on_device[n], saved[n]) for n in on_device)
    sd = sm.training_state_dict()
    sd = dict(sd, model={n: t.clone() for n, t in sd["model"].items()},
              optimizer={n: {k: v.clone() for k, v in s.items()} for n, s in sd["optimizer"].items()})
    train(sm, DATA[1:2])
    assert set(pd._carried) == carried
    sm.load_training_state_dict(sd)                 # back to the first step's state: the carried weights are stale now
    assert pd._carried == {}
    assert train(sm, DATA[1:]) == ref_losses[1:]
    assert_bitwise(sm, ref_params)
    text = sm.report()
    assert "params across steps" in text and "carried to the next forward" in text
    sm.close()
    assert offload_dirs(tmp_path) == []


def test_a_full_disk_keeps_the_state_in_memory_and_leaves_no_partial_file(tmp_path, monkeypatch):
    sm = compile_gpt(offload_dir=tmp_path)
    pd = sm.runtime.state.params_disk
    train(sm, DATA[:1])
    before = disk_params(sm)
    real = disk._pwrite
    sizes = {f.name: f.stat().st_size for f in pd.store.path.iterdir()}

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(disk, "_pwrite", full)
    with pytest.raises(OffloadError, match="file system is full") as e:
        sm(*DATA[1])
    notes = "".join(getattr(e.value, "__notes__", []))
    assert "kept in host memory" in notes and "harmony.load" in notes
    # the failed files were removed, not left half-written; the others are whole
    for f in pd.store.path.iterdir():
        assert f.stat().st_size == sizes[f.name]
    assert len(pd._kept) > 0
    after = disk_params(sm)                                   # the stepped state is readable from memory
    assert any(not torch.equal(before[n], after[n]) for n in before)
    monkeypatch.setattr(disk, "_pwrite", real)
    sm(*DATA[2])                                              # with room again, everything is written
    assert pd._kept == {} and len(list(pd.store.path.iterdir())) == len(pd.groups)
    path = pd.store.path
    sm.close()
    assert not path.exists() and offload_dirs(tmp_path) == []


def test_auto_places_weights_on_disk_only_when_the_host_cannot_hold_them():
    # a quarter of the state on the device: packs small enough that a host budget between the extremes
    # holds some packs' weights and not others'
    m = model()
    roomy = compile_gpt(share=4, weights_on="auto", host_memory_budget=state_bytes(m),
                        passes=("partition", "schedule", "offload"))
    assert set(roomy.plan.by_pack("master_on").values()) == {"host"}
    with pytest.raises(BudgetError, match="with every pack's weights and optimizer state on disk") as e:
        compile_gpt(share=4, weights_on="auto", host_memory_budget=4096, passes=("partition", "schedule", "offload"))
    tight = compile_gpt(share=4, weights_on="auto", host_memory_budget=e.value.min_budget)
    assert set(tight.plan.by_pack("master_on").values()) == {"disk"}
    offload = next(r for r in tight.program.reports if "host_planned_bytes" in r.totals)
    assert offload.totals["host_planned_bytes"] <= e.value.min_budget
    train(tight, DATA[:1])
    tight.close()
    # a budget between: the first-stepped packs go wholly to disk, the last-stepped one keeps its weights on
    # the host and its optimizer state on disk; both tiers in one step, still bitwise the all-on-host run
    mid = compile_gpt(share=4, weights_on="auto", host_memory_budget=e.value.min_budget + state_bytes(m) // 4)
    assert set(mid.plan.by_pack("master_on").values()) == {"host", "disk"}
    assert set(mid.plan.by_pack("optim_on").values()) == {"disk"}
    assert mid.runtime.state.disk is not None and mid.runtime.state.params_disk is not None
    ref = compile_gpt(share=4, weights_on="host")
    assert train(mid, DATA) == train(ref, DATA)
    assert_bitwise(mid, params(ref))
    mid.close()
    ref.close()


def test_bad_choices_are_clear_errors():
    with pytest.raises(ConfigError, match="weights_on='cloud'; choose one of 'auto', 'host', 'disk'"):
        compile_gpt(weights_on="cloud", passes=("partition", "schedule", "offload"))
    with pytest.raises(BudgetError, match="weights_on='auto' to let weights go to disk"):
        compile_gpt(weights_on="host", host_memory_budget=4096, passes=("partition", "schedule", "offload"))
    with pytest.raises(ConfigError, match="in fp32 and unclipped only"):
        compile_gpt(precision="bf16", passes=("partition", "schedule", "offload"))
    m = model()       # mixed precision under a small host budget keeps weights on the host: a BudgetError names it
    with pytest.raises(BudgetError, match="Raise host_memory_budget"):
        compile_gpt(precision="bf16", weights_on="auto", host_memory_budget=state_bytes(m) // 16,
                    passes=("partition", "schedule", "offload"))


def test_disk_steps_overlap_the_next_backward(runs):
    """Each wholly-disk step runs on the host thread while the device runs the next pack's backward; the next
    disk step waits for it. The device holds the pack's gradients (and under harmony its weights) until then,
    which the prediction counts (the budget test above)."""
    sm = runs["sm"]
    steps = [n for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ == "step"]
    assert steps and all(n.kwargs["where"] == "disk" and n.kwargs["overlap"] for n in steps)
    assert "disk_step_join_seconds" in sm.stats
    order = [n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"]
    if sm.plan.policy == "harmony":   # a backward runs between one disk step and the next
        at = [i for i, o in enumerate(order) if o == "step"]
        assert all("backward" in order[a:b] for a, b in zip(at, at[1:]))
    # on the CPU device the step's ops run on one intra-op thread, beside the compute's team, not a second
    # team as wide as the machine; the caller's own thread count is left as it was
    threads = torch.get_num_threads()
    assert sm.runtime.state.host_pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads


def test_disk_steps_run_inline_where_the_device_cannot_hold_the_gradients():
    """At the smallest budget that compiles, the least-memory plan cannot also hold a pack's gradients through
    the next backward: the swap pass makes the disk steps inline and says so; training stays bitwise."""
    m = model()
    with pytest.raises(BudgetError) as e:
        harmony.compile(m, example_batch=DATA[0], memory_budget=state_bytes(m) // 40, microbatches=4,
                        optimizer_on="host", weights_on="disk", disk_group_bytes=GROUP)
    floor = e.value.min_budget
    for budget in (int(floor * f) for f in (1.0, 1.05, 1.1, 1.2)):
        try:
            sm = harmony.compile(model(), example_batch=DATA[0], memory_budget=budget, microbatches=4,
                                 optimizer_on="host", weights_on="disk", disk_group_bytes=GROUP)
        except BudgetError:
            continue
        swap = next(r for r in sm.program.reports if r.title.startswith("swap"))
        if any("run inline" in n for n in swap.notes):
            break
        sm.close()
    else:
        pytest.fail("no budget near the floor makes the disk steps inline: the fallback is not exercised")
    steps = [n for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ == "step"
             and n.kwargs.get("where") == "disk"]
    assert steps and not any(n.kwargs["overlap"] for n in steps)
    ref = compile_gpt(weights_on="host")
    train(ref, DATA)
    expected = params(ref)
    ref.close()
    train(sm, DATA)
    assert sm.stats["measured_peak"] <= budget
    assert_bitwise(sm, expected)
    sm.close()


def test_files_in_the_room_the_host_budget_leaves_stay_in_memory(tmp_path):
    """A host budget above the minimum keeps the files of the last-stepped packs in host memory: they are never
    written or read (the disk moves that much less per step), training is still bitwise the all-on-host run,
    and a checkpoint taken from them resumes bitwise."""
    m = model()
    with pytest.raises(BudgetError) as e:
        compile_gpt(host_memory_budget=4096, passes=("partition", "schedule", "offload"))
    floor = e.value.min_budget
    base = compile_gpt(host_memory_budget=floor, offload_dir=tmp_path)
    assert not base.plan.packs_with("in_memory")
    sm = compile_gpt(host_memory_budget=floor + state_bytes(m) // 6, offload_dir=tmp_path)
    kept = {p: sm.plan.at(p).in_memory for p in sm.plan.packs_with("in_memory")}
    pd = sm.runtime.state.params_disk
    order = [n.args[0] for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ == "step"]
    assert kept and order[-1] in kept                    # the last-stepped pack's files first
    in_memory = {pd.pack_groups[p][i] for p, idx in kept.items() for i in idx}
    assert pd.in_memory == in_memory and 0 < len(in_memory) < len(pd.groups)
    offload = next(r for r in sm.program.reports if r.title.startswith("offload"))
    assert offload.totals["host_planned_bytes"] <= floor + state_bytes(m) // 6
    assert "stay in host memory" in " ".join(offload.notes)
    ref = compile_gpt(weights_on="host")
    ref_losses = train(ref, DATA)
    expected = params(ref)
    ref.close()
    assert train(base, DATA) == ref_losses
    assert train(sm, DATA[:2]) == ref_losses[:2]
    # the files kept in memory are not on disk, and their bytes are not moved
    names = {f.name for f in pd.store.path.iterdir()}
    assert names == {pd.store.file(g).name for g in range(len(pd.groups)) if g not in in_memory}
    assert sm.stats["disk_write_bytes"] == sum(f.stat().st_size for f in pd.store.path.iterdir())
    assert sm.stats["disk_write_bytes"] < base.stats["disk_write_bytes"]
    assert sm.stats["disk_read_bytes"] < base.stats["disk_read_bytes"]
    assert sm.stats["disk_reads_not_ahead"] == 0
    base.close()
    harmony.save(sm, tmp_path / "ckpt")
    sm(*DATA[2])
    assert_bitwise(sm, expected)
    sm.close()
    again = compile_gpt(seed=1, host_memory_budget=floor + state_bytes(m) // 6, offload_dir=tmp_path)
    harmony.load(again, tmp_path / "ckpt")
    assert train(again, DATA[2:]) == ref_losses[2:]
    assert_bitwise(again, expected)
    again.close()
    assert offload_dirs(tmp_path) == []
