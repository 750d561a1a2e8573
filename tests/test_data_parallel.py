"""Data parallelism: the compress pass, the allreduce op and harmony.data, on 2 and 3 gloo ranks.

Each multi-process test spawns its ranks once (``_spawn`` from test_collectives: the parent hosts
the TCPStore) and runs several checks per process group; tensors come back as numpy arrays.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import harmony
import harmony.data
import harmony.runtime.comm.world
from harmony.errors import ConfigError, InputError
from harmony.passes import compress
from harmony.runtime import ops
from harmony.runtime.comm import compression
from models import CASES, eager_full, training_state_bytes
from test_collectives import _digest, _spawn

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3))
STEPS = 3
CLIP = 0.05       # below the gradient norm of every step here: each update is clipped


def _case(batch, tie=False):
    return CASES["gpt"](batch=batch, tie=tie)   # 3 blocks, width 64: 2 packs at half its training state


def _train(rank, frac, steps=STEPS, batch=8, perturb=True, keep=False, tie=False, **kw):
    """Compile on this rank's shard and train ``steps`` batches; parameters, digest, stats, report."""
    model, data = _case(batch, tie)
    if perturb and rank:                       # ranks start apart: compile must broadcast rank 0's state
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
    budget = int(training_state_bytes(model) * frac)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), memory_budget=budget,
                         microbatches=2, **kw)
    stats = []
    for i in range(steps):
        sm(*harmony.data.shard(data[i % len(data)]))
        stats.append(dict(sm.stats))
    if not keep:
        sm.close()
    params = [p.detach() for p in model.parameters()]
    report = next(r for r in sm.program.reports if r.title.startswith("compress"))
    optim = sum(v.numel() * v.element_size() for o in sm.optimizers for st in o.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.device.type != "meta")
    out = dict(params=[p.numpy().copy() for p in params], digest=_digest(params), stats=stats, optim_bytes=optim,
               packs=len(sm.plan.packs),
               planned_optim=sum(s.optim_bytes for s in sm.plan.packs), text=sm.report(),
               totals=dict(report.totals), rows=list(report.rows), notes=list(report.notes),
               where={n.kwargs.get("where", "device") for n in sm.graph.nodes if n.target is ops.allreduce},
               ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"])
    if keep:
        out["sm"] = (sm, harmony.data.shard(data[0]))
    return out


def _two_ranks(rank, world):
    import torch.distributed as dist

    out = {"sgd": _train(rank, 0.5, **SGD), "adamw": _train(rank, 0.5, **ADAMW),
           "q4": _train(rank, 0.5, compression="4bit", keep=True, **SGD),
           "sgd_device": _train(rank, 0.5, optimizer_on="device", tie=True, **SGD),   # tied embedding + head
           "deferred": _deferred(rank)}
    # optimizer state sharded over the ranks (ZeRO stage 1): bitwise the replicated runs, on every path
    out["adamw_shard"] = _train(rank, 0.5, shard_state=True, **ADAMW)                       # host steps
    out["adamw_device"] = _train(rank, 0.5, optimizer_on="device", tie=True, **ADAMW)       # streamed device steps
    out["adamw_device_shard"] = _train(rank, 0.5, optimizer_on="device", tie=True, shard_state=True, **ADAMW)
    out["adamw_fits"] = _train(rank, 4.0, optimizer_on="device", **ADAMW)                   # all state resident
    out["adamw_fits_shard"] = _train(rank, 4.0, optimizer_on="device", shard_state=True, **ADAMW)
    # clipping by the global norm of the averaged gradients: host steps, sharded host steps, device steps
    out["clip"] = _train(rank, 0.5, clip_grad_norm=CLIP, **ADAMW)
    out["clip_shard"] = _train(rank, 0.5, clip_grad_norm=CLIP, shard_state=True, **ADAMW)
    out["clip_fits"] = _train(rank, 4.0, clip_grad_norm=CLIP, optimizer_on="device", **ADAMW)
    out["shard_resume"] = _sharded_resume(rank)
    out["bn"] = _batchnorm(rank)
    out["replicated_resume"] = _sharded_resume(rank, shard_state=False)
    try:   # ranks that compile different communication plans are told so, not left to hang
        compress.check_same_plan("4bit" if rank == 0 else "fp32")
        out["mismatch"] = "no error"
    except ConfigError as e:
        out["mismatch"] = str(e)
    sm, batch = out["q4"].pop("sm")
    sim = sm.simulate("a100-40gb")           # the simulator costs the all-reduces on the network stream
    out["sim_network"] = sim.busy.get("network", 0.0)
    dist.destroy_process_group()               # now one process: the plan is for two
    try:
        sm(*batch)
        out["wrong_world"] = "no error"
    except ConfigError as e:
        out["wrong_world"] = str(e)
    sm.close()
    return out


def _batchnorm(rank):
    """BatchNorm under data parallelism: each rank's running statistics see its own rows; rank 0's win
    after every step (DDP's broadcast_buffers), so every rank holds the same buffers."""
    model, data = CASES["cnn"](batch=8)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5), **SGD)
    stats = []
    for b in data:
        sm(*harmony.data.shard(b))
        stats.append(dict(sm.stats))
    sm.close()
    buffers = [b.detach().reshape(-1) for b in model.buffers()]      # num_batches_tracked is 0-dim
    return dict(buffers=_digest(buffers), params=_digest([p.detach() for p in model.parameters()]),
                mean=float(buffers[0].sum()), stats=stats, text=sm.report(),
                ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"])


def _sharded_resume(rank, shard_state=True):
    """Save after one step, train two more, load, train the same two: the same parameters. Sharded, each
    rank writes its own shard; replicated, rank 0 writes the one checkpoint the ranks share."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    model, data = _case(8)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, shard_state=shard_state,
                         memory_budget=int(training_state_bytes(model) * 0.5), **ADAMW)
    path = Path(tempfile.gettempdir()) / f"harmony-dp-ckpt-{os.getppid()}-{shard_state}"   # the same on both ranks
    sm(*harmony.data.shard(data[0]))
    harmony.save(sm, path)
    digests = []
    for _ in range(2):
        for b in data[1:3]:
            sm(*harmony.data.shard(b))
        digests.append(_digest([p.detach() for p in model.parameters()]))
        harmony.load(sm, path)
    files = sorted(p.name for p in path.iterdir())
    try:                                   # an unwritable path: every rank hears of rank 0's failure
        harmony.save(sm, "/dev/null/harmony-ckpt")
        failed = "no error"
    except harmony.errors.CheckpointError as e:
        failed = str(e)
    sm.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return dict(digests=digests, files=files, failed=failed)


def _deferred(rank):
    """The asynchronous device-step path: several packs, all state resident, steps after the next backward.

    A budget that fits all state gives one pack, so the packs come from a tight budget and the
    budget is then raised before compress runs (what a multi-device or larger plan would give).
    """
    from harmony.api import ScheduledModule
    from harmony.compiler.verify import verify

    model, data = _case(8)
    budget = int(training_state_bytes(model) * 0.4)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), memory_budget=budget,
                         microbatches=2, optimizer_on="device", passes=("partition", "schedule", "offload"), **SGD)
    program = sm.program
    program.config.memory_budget = budget * 8
    for record in program.plan.residency.values():
        record.kept = frozenset(("params", "grads", "optim"))
    program = compress.run(program, None).program
    program.capabilities |= compress.PROVIDES | {"residency"}
    verify(program)
    sm = ScheduledModule(program)
    for b in data:
        sm(*harmony.data.shard(b))
    sm.close()
    params = [p.detach() for p in model.parameters()]
    return dict(params=[p.numpy().copy() for p in params], digest=_digest(params), stats=dict(sm.stats),
                packs=len(program.plan.packs),
                ops=[(n.target.__name__, n.args[0] if n.args and isinstance(n.args[0], int) else None)
                     for n in program.schedule.nodes if n.op == "call_function"])


def _reference(batch, steps=STEPS, tie=False, clip=None, **kw):
    """Eager PyTorch on the whole (concatenated) batch (``clip``: then ``clip_grad_norm_`` before each step)."""
    model, data = _case(batch, tie)
    opt = kw["optimizer"]
    ref, _ = eager_full(model, [data[i % len(data)] for i in range(steps)], opt, clip=clip, **kw["optimizer_kwargs"])
    return [p.detach() for p in ref.parameters()]


def _close(params, ref, rtol, atol):
    worst = max(float((torch.from_numpy(a) - b).abs().max()) for a, b in zip(params, ref))
    ok = all(torch.allclose(torch.from_numpy(a), b, rtol=rtol, atol=atol) for a, b in zip(params, ref))
    return ok, worst


def _ok(res, world):
    assert sorted(res) == list(range(world)), res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"


def _with_references(world, fn, batch, **spawn):
    """Spawn the ranks; meanwhile compute the eager references (SGD, AdamW) on the whole batch here."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        refs = pool.submit(lambda: {"sgd": _reference(batch, **SGD), "adamw": _reference(batch, **ADAMW),
                                    "sgd_tied": _reference(batch, tie=True, **SGD),
                                    "clip": _reference(batch, clip=CLIP, **ADAMW)})
        res = _spawn(world, fn, **spawn)
        res["ref"] = refs.result()
    return res


@pytest.fixture(scope="module")
def two():
    res = _with_references(2, _two_ranks, 8, timeout=300)
    _ok({r: v for r, v in res.items() if r != "ref"}, 2)
    return res


def test_two_ranks_equal_single_process_training_on_the_whole_batch(two):
    r0, r1 = two[0], two[1]
    sgd_ref, adamw_ref, tied_ref = two["ref"]["sgd"], two["ref"]["adamw"], two["ref"]["sgd_tied"]
    # a budget that forces swapping: the optimizer steps on the host, behind each pack's all-reduce
    assert r0["sgd"]["where"] == {"host"} and r0["sgd"]["totals"]["allreduces"] == r0["sgd"]["packs"] >= 2
    assert "swap_in" in r0["sgd"]["ops"] and "release" in r0["sgd"]["ops"]
    for key, ref, tol in (("sgd", sgd_ref, (1e-5, 1e-6)), ("sgd_device", tied_ref, (1e-5, 1e-6)),
                          ("deferred", sgd_ref, (1e-5, 1e-6)), ("adamw", adamw_ref, (1e-3, 1e-4))):
        assert r0[key]["digest"] == r1[key]["digest"], f"{key}: ranks differ"
        ok, worst = _close(r0[key]["params"], ref, *tol)
        assert ok, f"{key}: max difference to eager full batch {worst}"
    for key in ("sgd", "q4"):                                   # the device budget holds with the comm buffers
        s = r0[key]["stats"][-1]
        assert s["measured_peak"] <= s["budget"] and s["measured_peak"] <= s["predicted_peak"] * 1.1


def test_device_steps_synchronous_under_swapping_and_deferred_when_resident(two):
    r0 = two[0]
    assert r0["sgd_device"]["where"] == {"device"} and "synchronous" in " ".join(r0["sgd_device"]["notes"])
    # several packs, all state resident: each step waits until the next pack's all-reduce is issued
    d = r0["deferred"]["ops"]
    n = r0["deferred"]["packs"]
    assert n >= 3 and d.count(("wait", None)) == n
    for p in range(n - 1, 0, -1):
        assert d.index(("step", p)) > d.index(("allreduce", p - 1)) > d.index(("backward", p - 1))
    assert r0["deferred"]["stats"]["measured_peak"] <= r0["deferred"]["stats"]["predicted_peak"] * 1.1


def test_4bit_parameters_are_identical_on_every_rank_and_bytes_as_predicted(two):
    q, sgd = two[0]["q4"], two[0]["sgd"]
    assert q["digest"] == two[1]["q4"]["digest"]
    last = q["stats"][-1]
    assert last["comm_wire_bytes"] == q["totals"]["wire_bytes_per_step"]
    assert last["comm_fp32_bytes"] == q["totals"]["fp32_bytes_per_step"] == sgd["stats"][-1]["comm_wire_bytes"]
    assert last["comm_ratio"] > 5 and last["comm_seconds"] > 0
    assert two[0]["sim_network"] > 0
    ok, worst = _close(q["params"], two["ref"]["sgd"], 0, 0.05)   # compressed, yet near the exact result
    assert ok and worst > 1e-6, worst


def test_sharded_optimizer_state_trains_bitwise_like_replicated_state_with_half_the_state(two):
    for shard, whole in (("adamw_shard", "adamw"), ("adamw_device_shard", "adamw_device"),
                         ("adamw_fits_shard", "adamw_fits")):
        assert two[0][shard]["digest"] == two[1][shard]["digest"] == two[0][whole]["digest"], shard
        assert "sync_state" in two[0][shard]["ops"] and "sync_state" not in two[0][whole]["ops"]
        full = two[0][whole]["optim_bytes"]
        mine = [two[r][shard]["optim_bytes"] for r in (0, 1)]
        # each rank keeps its half (whole tensors, cut by bytes) and the two halves make the whole
        assert sum(mine) == full and all(0.3 * full < b < 0.7 * full for b in mine), (mine, full)
        for r in (0, 1):
            t = two[r][shard]
            assert t["planned_optim"] == t["optim_bytes"]          # the plan counts only this rank's share
            last = t["stats"][-1]
            assert last["measured_peak"] <= last["budget"]
            assert last["h2d_bytes"] == last["predicted_h2d"] and last["d2h_bytes"] == last["predicted_d2h"]
            assert t["totals"]["stepped_params"] < len(two[r][whole]["params"])
            assert "ZeRO stage 1" in t["text"]
    for r in (0, 1):     # each rank saved its own shard under the one path, and resumed bitwise from it
        res = two[r]["shard_resume"]
        assert res["files"] == ["rank-0-of-2", "rank-1-of-2"] and res["digests"][0] == res["digests"][1]
    assert two[0]["shard_resume"]["digests"] == two[1]["shard_resume"]["digests"]
    rep = [two[r]["replicated_resume"] for r in (0, 1)]      # replicated: one checkpoint, written by rank 0
    assert rep[0]["digests"][0] == rep[0]["digests"][1] == rep[1]["digests"][1]
    assert "manifest.json" in rep[0]["files"] and not any(f.startswith("rank-") for f in rep[0]["files"])
    assert "/dev/null" in rep[0]["failed"] and rep[1]["failed"].startswith("rank 0 could not save")
    assert all("/dev/null" in two[r]["shard_resume"]["failed"] for r in (0, 1))   # sharded: each rank its own
    assert (two[0]["adamw_device_shard"]["stats"][-1]["predicted_peak"]
            < two[0]["adamw_device"]["stats"][-1]["predicted_peak"] or
            sum(s["h2d_bytes"] for s in two[0]["adamw_device_shard"]["stats"])
            < sum(s["h2d_bytes"] for s in two[0]["adamw_device"]["stats"]))   # less state: less memory or traffic


def test_batchnorm_statistics_are_rank_0s_on_every_rank_after_each_step(two):
    b0, b1 = two[0]["bn"], two[1]["bn"]
    assert b0["buffers"] == b1["buffers"] and b0["params"] == b1["params"]
    assert "sync_state" in b0["ops"] and "broadcast_buffers" in b0["text"]
    for s in b0["stats"] + b1["stats"]:
        assert s["h2d_bytes"] == s["predicted_h2d"] and s["d2h_bytes"] == s["predicted_d2h"]
        assert s["measured_peak"] <= s["budget"]


def test_other_plans_and_world_sizes_are_config_errors(two):
    for r in (0, 1):
        assert "another communication plan" in two[r]["mismatch"]
        assert "compiled for 2 ranks" in two[r]["wrong_world"] and "one process" in two[r]["wrong_world"]


def _three_ranks(rank, world):
    """Uncompressed and adaptive training on 3 ranks; then the last rank dies and the others must fail."""
    import torch.distributed as dist

    out = {"sgd_fits": _train(rank, 4.0, batch=12, **SGD),
           "adaptive": _train(rank, 0.5, steps=5, batch=12, compression="adaptive", keep=True, **ADAMW)}
    every = [None] * world
    dist.all_gather_object(every, {k: v["digest"] for k, v in out.items()})
    out["digests"] = every
    sm, batch = out["adaptive"].pop("sm")
    if rank == world - 1:
        os._exit(1)                            # dies without a word between two steps
    start = time.monotonic()
    try:
        sm(*batch)
        sm(*batch)
        out["dead"] = ("no error", time.monotonic() - start, "")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["dead"] = (type(e).__name__, time.monotonic() - start, str(e))
    return out


@pytest.fixture(scope="module")
def three():
    res = _with_references(3, _three_ranks, 12, timeout=150, pg_timeout=20, wait_for=[0, 1])
    assert set(res) == {0, 1, "ref"}, res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
    return res


def test_three_ranks_equal_single_process_and_each_other(three):
    for key in ("sgd_fits", "adaptive"):
        assert len({d[key] for d in three[0]["digests"]}) == 1, f"{key}: parameters differ between ranks"
    f = three[0]["sgd_fits"]     # all state fits: one pack, the step on the device after a wait
    ok, worst = _close(f["params"], three["ref"]["sgd"], 1e-5, 1e-6)
    assert ok, f"max difference to eager full batch {worst}"
    assert f["where"] == {"device"} and "wait" in f["ops"] and "swap_in" not in f["ops"]
    assert f["stats"][-1]["comm_wire_bytes"] == f["totals"]["wire_bytes_per_step"] == f["totals"]["fp32_bytes_per_step"]
    assert f["stats"][-1]["measured_peak"] <= f["stats"][-1]["predicted_peak"]


def test_adaptive_bits_are_fixed_after_the_warmup_and_agree(three):
    a = three[0]["adaptive"]
    bits = [s.get("adaptive_bits") for s in a["stats"]]
    assert bits[:3] == [None] * 3 and bits[3] and bits[3] == bits[4]       # 3 warm-up steps, then fixed
    assert three[1]["adaptive"]["stats"][-1]["adaptive_bits"] == bits[4]
    assert set(bits[4].values()) <= {2, 3, 4, 6, 8}
    warm, after = a["stats"][2]["comm_wire_bytes"], a["stats"][4]["comm_wire_bytes"]
    assert warm == a["stats"][2]["comm_fp32_bytes"] and after < warm / 4
    assert a["totals"]["adaptive_layer_bytes"] <= a["totals"]["adaptive_uniform_bytes"]
    assert a["totals"]["wire_bytes_after_warmup"] == after
    assert a["totals"]["warmup_wire_bytes_per_step"] == warm and after <= a["totals"]["wire_bytes_per_step"] * 1.05
    per_pack = [c.split(":") for row in a["rows"] for c in row["bits"].split()]
    assert sum(int(k) for _, k in per_pack) == len(bits[4])


def test_a_dead_rank_makes_the_others_fail_instead_of_hanging(three):
    for r in (0, 1):
        kind, seconds, msg = three[r]["dead"]
        assert kind == "CommunicationError", three[r]["dead"]
        assert seconds < 25 and "restart" in msg


# -- one process --------------------------------------------------------------------------------
def test_one_process_inserts_nothing_and_checks_its_world(monkeypatch):
    model, data = _case(8)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=2, compression="4bit")
    assert not any(n.target is ops.allreduce for n in sm.graph.nodes if n.op == "call_function")
    assert [h[0] for h in sm.history][2:4] == ["offload", "compress"]
    assert sm.program.config.world_size == 1 and not sm.program.config.data_parallel
    sm(*data[0])
    assert not any(k.startswith("comm_") for k in sm.stats)
    monkeypatch.setattr(harmony.runtime.comm.world, "current_world", lambda: 4)   # as under torchrun with 4 ranks
    with pytest.raises(ConfigError, match="compiled for 1 rank but runs in a group of 4 ranks"):
        sm(*data[0])
    sm.close()
    alone = harmony.compile(model, example_batch=data[0], memory_budget="64MiB", data_parallel=False)
    alone(*data[0])                            # data_parallel=False: each process trains alone, unchecked
    alone.close()


def test_bad_data_parallel_arguments_are_config_errors():
    model, data = _case(8)
    with pytest.raises(ConfigError, match="torchrun"):
        harmony.compile(model, example_batch=data[0], data_parallel=True)
    with pytest.raises(ConfigError, match="shard_state=True .* trains alone"):
        harmony.compile(model, example_batch=data[0], shard_state=True)
    with pytest.raises(ConfigError, match="1..8"):
        harmony.compile(model, example_batch=data[0], compression="12bit")
    with pytest.raises(ConfigError, match="compression='zip'"):
        harmony.compile(model, example_batch=data[0], compression="zip")
    with pytest.raises(ConfigError, match="min_size"):
        harmony.compile(model, example_batch=data[0], min_size=-1)
    assert compression.parse_compression("fp16")[0].kind == "fp16"
    assert compression.parse_compression("adaptive") == (compression.CompressionSpec(bits=4), True)
    assert compression.parse_compression("2bit")[0].bits == 2


def test_shard_gives_each_rank_its_rows():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = [harmony.data.shard((x, y), rank=r, world=3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    d = harmony.data.shard({"ids": x, "n": 5}, rank=1, world=2)
    assert torch.equal(d["ids"], x[3:]) and d["n"] == 5
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    assert [int(ds_i[0]) for ds_i in harmony.data.shard(ds, rank=1, world=3)] == [1, 4, 7]
    assert harmony.data.shard(x) is not None                     # no process group: the whole batch
    assert torch.equal(harmony.data.shard(x), x)
    with pytest.raises(InputError, match="evenly"):
        harmony.data.shard(x, rank=0, world=4)
    with pytest.raises(ConfigError, match="rank"):
        harmony.data.shard(x, rank=2, world=2)


def test_predicted_wire_bytes_match_the_collective():
    from harmony.runtime.comm.compression import CompressionSpec, spec_for
    ts = [torch.zeros(64, 96), torch.zeros(300), torch.zeros(3, 5), torch.zeros(40, 128), torch.zeros(7, 11, 13)]
    for spec in (CompressionSpec("none"), CompressionSpec("fp16"), CompressionSpec(bits=4),
                 CompressionSpec(bits=3, bucket_size=100)):
        specs = [spec_for(t, spec) for t in ts]
        for world in (2, 3, 4):
            got = compress.predict_wire(ts, specs, world)
            assert got > 0 and (spec.kind != "none" or got == 2 * (world - 1) * 4 * sum(t.numel() for t in ts) // world)


# -- heterogeneous ranks: balance ----------------------------------------------------------------
HETERO_BATCH = 18
SHARES = [(2, 1), (3, 2), (5, 2)]          # 2, 6 and 10 samples in 1, 2 and 2 microbatches
BUDGETS = (0.5, 0.8, 4.0)                  # of the training state: different packs on every rank


def _hetero_train(rank, model, data, hw, steps=STEPS, **kw):
    sm = harmony.compile(model, example_batch=data[0], hardware=hw, data_parallel=True, **kw)
    for i in range(steps):
        sm(*data[i % len(data)])              # the global batch: each rank takes its rows
    sm.close()
    params = [p.detach() for p in model.parameters()]
    balance, compress_report = sm.program.reports[0], next(r for r in sm.program.reports
                                                           if r.title.startswith("compress"))
    optim = sum(v.numel() * v.element_size() for o in sm.optimizers for st in o.state.values()
                for v in st.values() if isinstance(v, torch.Tensor))
    return dict(params=[p.numpy().copy() for p in params], digest=_digest(params), packs=len(sm.plan.packs),
                optim_bytes=optim, stats=dict(sm.stats), bits=sm.stats.get("adaptive_bits"),
                rows=sm.program.rows, microbatches=sm.plan.microbatches, budget=sm.program.config.memory_budget,
                balance=dict(title=balance.title, rows=balance.rows, totals=balance.totals, notes=balance.notes),
                groups=[r["groups"] for r in compress_report.rows], text=sm.report(),
                weights={n.kwargs.get("weight") for n in sm.graph.nodes if n.target is ops.allreduce})


def _hetero_ranks(rank, world):
    from harmony.compiler.hardware import Hardware
    from harmony.errors import BudgetError
    from harmony.runtime.comm.collectives import allreduce
    from harmony.runtime.comm.compression import CompressionSpec

    out = {}
    model, data = _case(HETERO_BATCH)
    budgets = [int(training_state_bytes(model) * f) for f in BUDGETS]
    cpu = Hardware.this_machine()
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)            # compile broadcasts rank 0's weights
    out["shares"] = _hetero_train(rank, model, data, cpu.logical(budgets), balance=SHARES, **SGD)
    out["replicated"] = _hetero_train(rank, _case(HETERO_BATCH)[0], data, cpu.logical(budgets), balance=SHARES,
                                      shard_state=False, **SGD)
    out["q4"] = _hetero_train(rank, _case(HETERO_BATCH)[0], data, cpu.logical(budgets), balance=SHARES,
                              compression="4bit", **SGD)
    out["adaptive"] = _hetero_train(rank, _case(HETERO_BATCH)[0], data, cpu.logical(budgets), balance=SHARES,
                                    compression="adaptive", steps=5, **SGD)
    out["uniform"] = _hetero_train(rank, _case(HETERO_BATCH)[0], data, cpu.logical(budgets), balance="uniform",
                                   microbatches=2, **SGD)
    out["auto"] = _hetero_train(rank, _case(HETERO_BATCH)[0], data, cpu.logical(budgets, speed_factors=[1, 2, 4]),
                                steps=1, balance="auto", **SGD)
    # weighted all-reduce in every kind: sum_r w_r t_r (fp32 exactly up to rounding, compressed near it)
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(64, 96, generator=g)
    w = [0.125, 0.25, 0.625][rank]
    out["weighted"] = {}
    for spec in (CompressionSpec("none"), CompressionSpec("fp16"), CompressionSpec(bits=8)):
        x = t.clone()
        allreduce([x], spec, weight=w, min_size=0)
        out["weighted"][spec.kind] = x.numpy().copy()
    out["inputs"] = t.numpy().copy()
    from harmony.runtime.comm.process_group import measure_network, measure_socket_rate
    out["network"] = measure_network(1 << 20, repeats=3)
    out["socket"] = measure_socket_rate(1 << 20, repeats=3)
    for key, kw in (("wrong_count", dict(hardware=cpu.logical(budgets[:2]), balance="auto")),
                    ("too_small", dict(hardware=cpu.logical([1 << 16] * 3), balance="auto")),
                    ("bad_shares", dict(hardware=cpu.logical(budgets), balance=[(2, 1), (2, 1), (2, 1)])),
                    ("budget_given", dict(hardware=cpu.logical(budgets), balance="auto", memory_budget="1GiB")),
                    # given shares are not checked against memory: rank 0's own compile fails, and tells the others
                    ("rank0_fails", dict(hardware=cpu.logical([1 << 16] + budgets[1:]), balance=SHARES))):
        try:
            harmony.compile(_case(HETERO_BATCH)[0], example_batch=data[0], data_parallel=True, **kw, **SGD)
            out[key] = ("no error", "", None)
        except (ConfigError, BudgetError) as e:
            out[key] = (type(e).__name__, str(e), getattr(e, "min_budget", None))
    return out


@pytest.fixture(scope="module")
def hetero():
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_reference, HETERO_BATCH, **SGD)
        res = _spawn(3, _hetero_ranks, timeout=360)
        res["ref"] = ref.result()
    _ok({r: v for r, v in res.items() if r != "ref"}, 3)
    return res


@pytest.mark.slow
def test_balanced_ranks_on_one_host_are_simulated_together(hetero):
    """The three ranks share this machine's cores: each rank's report has the node's step (every rank's plan
    simulated together, gathered from the ranks), no shorter than its own plan simulated alone, and says so."""
    s = [hetero[r]["auto"] for r in range(3)]
    totals = [x["balance"]["totals"] for x in s]
    assert len({t["simulated_step_s"] for t in totals}) == 1
    assert all(t["simulated_step_s"] >= t["simulated_alone_s"] - 1e-12 for t in totals)
    text = " ".join(s[0]["text"].split())             # (the report wraps its notes)
    assert "simulated node: 3 devices" in text and "host 0: devices 0, 1, 2 share" in text
    assert "simulated together on the node" in " ".join(s[1]["balance"]["notes"])


@pytest.mark.slow
def test_uneven_shares_train_like_one_process_on_the_global_batch(hetero):
    ref = hetero["ref"]
    for key in ("shares", "uniform"):
        assert len({hetero[r][key]["digest"] for r in range(3)}) == 1, f"{key}: ranks differ"
    s = [hetero[r]["shares"] for r in range(3)]
    assert [x["rows"] for x in s] == [(0, 2), (2, 8), (8, 18)] and [x["microbatches"] for x in s] == [1, 2, 2]
    assert [x["weights"] for x in s] == [{2 / 18}, {6 / 18}, {10 / 18}]
    assert len({x["packs"] for x in s}) > 1         # budgets differ, so do the packs: groups keep ranks in step
    assert any(g > 1 for x in s for g in x["groups"])
    # allclose, not bitwise: each rank's gradient is scaled by its weight x 3 before the sum and divided by 3
    # after it, and the samples' contributions are summed in another order than one backward over 18 samples
    ok, worst = _close(s[0]["params"], ref, 1e-5, 1e-6)
    assert ok, f"uneven shares vs one process on the global batch: max difference {worst}"
    ok, worst = _close(s[0]["params"], [torch.from_numpy(a) for a in hetero[0]["uniform"]["params"]], 1e-5, 1e-6)
    assert ok, f"uneven shares vs a homogeneous 3-rank run: max difference {worst}"
    u = hetero[0]["uniform"]
    assert u["rows"] == (0, 6) and u["weights"] == {1 / 3}
    # the planned state shares are applied to the optimizer state: each rank keeps about its share of it,
    # and training is bitwise the run that replicates the state on every rank
    rep = [hetero[r]["replicated"] for r in range(3)]
    assert s[0]["digest"] == rep[0]["digest"] == rep[2]["digest"]
    whole = rep[0]["optim_bytes"]
    assert all(x["optim_bytes"] == whole for x in rep) and sum(x["optim_bytes"] for x in s) == whole
    planned = [row["state_share_planned"] for row in s[0]["balance"]["rows"]]
    for x, share in zip(s, planned):       # whole tensors, cut by bytes: within one tensor of the plan
        assert abs(x["optim_bytes"] / whole - share) < 0.2, ([y["optim_bytes"] / whole for y in s], planned)
        st = x["stats"]
        assert st["h2d_bytes"] == st["predicted_h2d"] and st["d2h_bytes"] == st["predicted_d2h"]
    assert "OPTIMIZER STATE" in " ".join(s[0]["balance"]["notes"])
    assert "not applied" in " ".join(rep[0]["balance"]["notes"])
    ad = [hetero[r]["adaptive"] for r in range(3)]          # adaptive bits: chosen alike on ranks cut differently
    assert len({x["digest"] for x in ad}) == 1 and ad[0]["bits"] and all(x["bits"] == ad[0]["bits"] for x in ad)
    q = [hetero[r]["q4"] for r in range(3)]                 # 4-bit: weighted too, identical on every rank
    assert len({x["digest"] for x in q}) == 1
    ok, worst = _close(q[0]["params"], ref, 0, 0.01)        # measured 0.0036; with equal weights 0.031 (so fp32)
    assert ok and worst > 1e-6, worst


@pytest.mark.slow
def test_auto_balance_gives_slower_ranks_fewer_samples_and_reports_every_rank(hetero):
    a = [hetero[r]["auto"] for r in range(3)]
    rows = a[0]["balance"]["rows"]
    samples = [row["samples"] for row in rows]
    assert sum(samples) == HETERO_BATCH and samples[0] > samples[2]       # rank 2 is emulated 4x slower
    assert [x["rows"][1] - x["rows"][0] for x in a] == samples
    assert [x["budget"] for x in a] == [int(training_state_bytes(_case(8)[0]) * f) for f in BUDGETS]
    assert rows[2]["speed"] == "1/4x EMULATED" and "(this)" in str(a[1]["balance"]["rows"][1]["rank"])
    notes = " ".join(a[0]["balance"]["notes"])
    assert "EMULATION" in notes and "OPTIMIZER STATE" in notes
    assert a[0]["balance"]["totals"]["status"] == "optimal" and a[0]["balance"]["totals"]["simulated_step_s"] > 0
    assert "balance: each rank's share" in a[0]["text"] and "EMULATED" in a[0]["text"]


@pytest.mark.slow
def test_weighted_allreduce_sums_weighted_tensors_in_every_kind(hetero):
    xs = [torch.from_numpy(hetero[r]["inputs"]) for r in range(3)]
    want = 0.125 * xs[0] + 0.25 * xs[1] + 0.625 * xs[2]
    got = {k: torch.from_numpy(v) for k, v in hetero[0]["weighted"].items()}
    assert torch.allclose(got["none"], want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got["fp16"], want, atol=2e-3)
    span = float(want.max() - want.min())
    assert float((got["quantized"] - want).abs().max()) < 4 * span / 255     # 8-bit buckets, requantized once
    assert float((got["quantized"] - xs[0].add(xs[1]).add(xs[2]).div(3)).abs().max()) > 0.1   # not the plain mean
    bandwidth, latency = hetero[0]["network"]             # measured once, the same figures on every rank
    assert bandwidth > 0 and latency > 0 and all(hetero[r]["network"] == (bandwidth, latency) for r in (1, 2))
    # gloo's socket work per byte, by CPU time: finite, the same figure on every rank
    assert 0 < hetero[0]["socket"] < float("inf") and all(hetero[r]["socket"] == hetero[0]["socket"] for r in (1, 2))


@pytest.mark.slow
def test_balance_bad_inputs_are_clear_errors_on_every_rank(hetero):
    for r in range(3):
        h = hetero[r]
        assert h["wrong_count"][0] == "ConfigError" and "2 devices but 3 ranks" in h["wrong_count"][1]
        assert h["too_small"][0] == "BudgetError" and "missing" in h["too_small"][1] and h["too_small"][2] > 0
        assert h["bad_shares"][0] == "ConfigError" and "add up" in h["bad_shares"][1]
        assert h["budget_given"][0] == "ConfigError" and "memory_budget" in h["budget_given"][1]
    assert hetero[0]["rank0_fails"][0] == "BudgetError" and "smallest budget that works" in hetero[0]["rank0_fails"][1]
    for r in (1, 2):      # not left waiting for rank 0 in the compress pass: its error, named (driver/agree.py)
        kind, message = hetero[r]["rank0_fails"][:2]
        assert kind == "BudgetError" and "rank 0 failed while" in message and "smallest budget" in message


def test_clipping_uses_the_global_norm_of_the_averaged_gradients(two):
    """Every rank clips by the same norm (that of the averaged gradients, which each holds whole): the ranks agree,
    sharded state is bitwise the replicated run, and the result is eager clip_grad_norm_ on the whole batch's."""
    for key in ("clip", "clip_shard", "clip_fits"):
        assert two[0][key]["digest"] == two[1][key]["digest"], f"{key}: ranks differ"
        norms = [s["grad_norm"] for s in two[0][key]["stats"]]
        assert norms == [s["grad_norm"] for s in two[1][key]["stats"]] and min(norms) > CLIP, norms
        ok, worst = _close(two[0][key]["params"], two["ref"]["clip"], 1e-3, 1e-4)
        assert ok, f"{key}: max difference to eager clip_grad_norm_ on the whole batch {worst}"
    assert two[0]["clip_shard"]["digest"] == two[0]["clip"]["digest"]
    assert two[0]["clip"]["digest"] != two[0]["adamw"]["digest"]       # clipping changed the update
