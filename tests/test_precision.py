"""Mixed precision: bf16/fp16 compute copies on the device, fp32 masters and optimizer state on the host.

The eager reference (``eager_mixed``) does by hand what the runtime does: a copy of the model
cast to the compute dtype runs every microbatch and accumulates its gradients in that dtype
(autograd, in microbatch order, as the runtime does on the device); the gradients become fp32
on the host, the user's optimizer steps fp32 master weights, and the masters are cast back
into the compute copy. fp16 goes through ``torch.amp.GradScaler`` itself.
"""
import copy

import pytest
import torch

import harmony
from harmony.compiler.printer import plain
from harmony.errors import ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.optim import optimizer_kwargs
from models import CASES, call, run_compiled, split, training_state_bytes


def eager_mixed(model, data, microbatches, dtype, scaler=None, optimizer=torch.optim.AdamW, clip=None, **kw):
    """The fp32 master model after training ``data`` with compute copies in ``dtype``; and the losses.
    ``clip``: ``clip_grad_norm_`` of the fp32 (unscaled) gradients before the step, as AMP recipes do."""
    compute = copy.deepcopy(model).to(dtype)
    master = copy.deepcopy(model)
    opt = optimizer(master.parameters(), **optimizer_kwargs(optimizer, kw))   # as Harmony builds it
    losses = []
    for batch in data:
        total = []
        for mb in split(batch, microbatches):
            mb = {k: _cast(v, dtype) for k, v in mb.items()} if isinstance(mb, dict) else [_cast(v, dtype) for v in mb]
            loss = call(compute, mb)
            seed = loss.float() / microbatches
            (seed if scaler is None else scaler.scale(seed)).backward()
            total.append(loss.detach().float())
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad, c.grad = (None if c.grad is None else c.grad.float()), None
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
        losses.append(torch.stack(total).mean())
    return master, losses


def _cast(t, dtype):
    return t.to(dtype) if t.is_floating_point() else t


def _assert_bitwise(ours, ref):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32, f"{name} is {a.dtype} after training: its master must stay fp32"
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_bf16_matches_eager_mixed_precision_bitwise(case, policy):
    """Under a budget a fifth of the fp32 training state (so packs swap), parameters after 3 steps equal
    the eager reference's bitwise, the device's peak stays in the budget and verify predicts it within 10%."""
    model, data = CASES[case]()
    ref, ref_losses = eager_mixed(model, data, 4, torch.bfloat16)
    ours = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.2)
    sm, stats, losses = run_compiled(ours, data, 4, budget, policy, precision="bf16")
    assert len(sm.plan.packs) > 1
    assert any(n.target.__name__ == "swap_in" for n in sm.graph.nodes if n.op == "call_function")
    _assert_bitwise(ours, ref)
    assert losses == [x.item() for x in ref_losses]
    for s in stats:
        assert s["measured_peak"] <= budget
        assert abs(s["measured_peak"] - s["predicted_peak"]) <= 0.1 * s["measured_peak"], s


def train_bf16_as_eager(case: str, policy: str, **kw):
    """Train ``case`` in bf16 under a fifth of its training state; assert the run bitwise eager mixed precision's,
    within the budget, its peak within 10% and (after the first step, which makes the optimizer state) every byte
    moved as predicted. Returns the module and its stats per step."""
    model, data = CASES[case]()
    ref, ref_losses = eager_mixed(model, data, 4, torch.bfloat16)
    ours = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.2)
    sm, stats, losses = run_compiled(ours, data, 4, budget, policy, precision="bf16", **kw)
    _assert_bitwise(ours, ref)
    assert losses == [x.item() for x in ref_losses]
    for i, s in enumerate(stats):
        assert s["measured_peak"] <= budget
        assert abs(s["measured_peak"] - s["predicted_peak"]) <= 0.1 * s["measured_peak"], s
        if i:
            assert (s["h2d_bytes"], s["d2h_bytes"]) == (s["predicted_h2d"], s["predicted_d2h"])
    return sm, stats


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_bf16_steps_on_the_device_match_eager_bitwise(case, policy):
    """optimizer_on='device' under bf16: each fp32 master comes to the device with its optimizer state for its
    step; the run is bitwise eager's as the host-stepped one is, within the budget, its peak and every byte moved
    as predicted, and between steps the model holds its fp32 masters (no compute copy stays on the device)."""
    sm, stats = train_bf16_as_eager(case, policy, optimizer_on="device")
    assert set(sm.plan.by_pack("step_on").values()) == {"device"} and len(sm.plan.packs) > 1
    masters = sum(spec.stepped_master_bytes for spec in sm.plan.packs)
    assert stats[-1]["d2h_bytes"] >= masters      # every master went back


def test_bf16_differs_from_fp32():
    """The reference comparison above is not vacuous: bf16 training lands elsewhere than fp32."""
    model, data = CASES["mlp"]()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.2)
    run_compiled(a, data, 4, budget, precision="bf16")
    run_compiled(b, data, 4, budget)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("case, first_pack_reads", [("gpt", torch.int64), ("mlp", torch.bfloat16)])
def test_loss_is_fp32_and_only_float_inputs_are_cast(case, first_pack_reads):
    """The GPT's first pack reads token ids, which stay int64; the MLP's reads features, cast to bf16."""
    model, data = CASES[case]()
    budget = int(training_state_bytes(model) * 0.2)
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget, microbatches=2,
                         precision="bf16")
    seen = {}
    forward = sm.plan.packs[0].module.forward

    def spy(*xs):
        seen.update({i: x.dtype for i, x in enumerate(xs) if isinstance(x, torch.Tensor)})
        return forward(*xs)
    sm.plan.packs[0].module.forward = spy
    loss = sm(*data[0])
    sm.close()
    assert loss.dtype == torch.float32
    assert first_pack_reads in seen.values() and torch.float32 not in seen.values(), seen


def test_bf16_device_peak_is_clearly_below_fp32_at_the_same_plan():
    """The same packs and schedule in fp32 and bf16 (bf16 planned under half the budget, which
    gives the planner the same choices at 2 B per value): the bf16 device copies (2 B/param),
    gradients and activations take about half the fp32 peak; each run stays within its budget
    and within 10% of its prediction."""
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.4)
    runs = {}
    for precision, share in (("fp32", 1.0), ("bf16", 0.5)):
        sm, stats, _ = run_compiled(copy.deepcopy(model), data[:1], 4, int(budget * share), optimizer_on="host",
                                    precision=precision, recompute="device")   # (graphs on the host are priced
        # by the compute they save, which bf16 does not halve)
        s = stats[-1]
        assert s["measured_peak"] <= budget * share
        assert abs(s["measured_peak"] - s["predicted_peak"]) <= 0.1 * s["measured_peak"], (precision, s)
        runs[precision] = (s["measured_peak"], [p.name for p in sm.plan.packs], plain(sm.graph))   # (sm.code's
        # comments give each op's bytes, which differ: the same ops in the same order)
    assert runs["bf16"][1:] == runs["fp32"][1:] and len(runs["fp32"][1]) > 1
    assert runs["bf16"][0] < 0.55 * runs["fp32"][0], runs


def _gpt(**cfg):
    torch.manual_seed(0)
    c = GPTConfig(**{"layers": 2, "width": 32, "vocab": 32, "seq": 16, "tie": False, **cfg})
    return GPT(c), c


@pytest.mark.parametrize("policy, optimizer_state", [("harmony", "host"), ("sequential", "host"), ("harmony", "disk")])
def test_fp16_matches_grad_scaler_bitwise(policy, optimizer_state, tmp_path):
    """fp16 with loss scaling equals the eager reference driven by torch.amp.GradScaler, with the
    scale starting where the first step overflows (skipped, scale halved) and growing every 2 clean
    steps; also with the optimizer state on disk, whose packs are read and written in a skipped step too."""
    model, data = CASES["mlp"]()
    data = data * 3
    scaling = dict(init_scale=2.0 ** 18, growth_interval=2)   # the seed scale / 4 overflows fp16 at first
    scaler = torch.amp.GradScaler("cpu", **scaling)
    ref, _ = eager_mixed(model, data, 4, torch.float16, scaler=scaler)
    ours = copy.deepcopy(model)
    disk = dict(host_memory_budget=int(4.5 * 4 * sum(p.numel() for p in model.parameters())), offload_dir=tmp_path)
    sm, stats, _ = run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.15), policy, precision="fp16",
                                loss_scaling=scaling, **(disk if optimizer_state == "disk" else {}))
    assert len(sm.plan.packs) > 1
    assert ("disk" in sm.plan.by_pack("optim_on").values()) == (optimizer_state == "disk")
    _assert_bitwise(ours, ref)
    assert sm.loss_scale == scaler.get_scale()
    skipped = [s["skipped_steps"] for s in stats]
    assert skipped[0] == 1 and skipped[-1] < len(data) - 2, skipped     # skipped, then stepped
    assert sm.loss_scale > 2.0 ** 16                                     # and grew again


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    model, c = _gpt()
    data = list(copy_task(c, 4, 2))
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.3),
                         microbatches=2, precision="fp16", loss_scaling=dict(init_scale=2.0 ** 60))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sm(*data[0])
    assert sm.stats["skipped_steps"] == 1 and sm.loss_scale == 2.0 ** 59
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(not opt.state for opt in sm.optimizers)      # the optimizer never stepped
    sm.close()


def test_fp16_with_loss_scaling_converges_on_the_copy_task():
    """Two copy-task batches seen ten times each: the loss falls to about half (fp16 matmuls are slow on a CPU,
    so the run is short), with the default scale 2**16 never overflowing."""
    model, c = _gpt()
    data = list(copy_task(c, 8, 2)) * 10
    # rows: under token weighting this run's first step overflows at 2**16 and is skipped (issue 59's note)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=2, precision="fp16", optimizer_kwargs={"lr": 1e-2}, loss_weighting="rows")
    losses = [sm(*b).item() for b in data]
    sm.close()
    assert len(sm.plan.packs) > 1
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2]), losses
    assert sm.stats["skipped_steps"] == 0 and sm.loss_scale == 2.0 ** 16


def test_unknown_precision_names_the_choices():
    model, data = CASES["mlp"]()
    with pytest.raises(ConfigError, match="'fp32', 'bf16', 'fp16'"):
        harmony.compile(model, example_batch=data[0], precision="fp8")


@pytest.mark.parametrize("kw, match", [
    (dict(precision="fp16", optimizer_on="device"), "overflow check must see every gradient"),
    (dict(precision="bf16", optimizer_on="device", clip_grad_norm=1.0), "use optimizer_on='host'"),
    (dict(precision="bf16", policy="ondemand"), "policy='harmony'"),
    (dict(precision="bf16", loss_scaling={"init_scale": 8.0}), "loss_scaling is for precision='fp16'"),
    (dict(precision="fp16", loss_scaling={"scale": 8.0}), "unknown keys"),
    (dict(precision="fp16", loss_scaling={"backoff_factor": 2.0}), "backoff_factor"),
])
def test_bad_mixed_precision_configurations_raise(kw, match):
    model, data = CASES["mlp"]()
    with pytest.raises(ConfigError, match=match):
        harmony.compile(model, example_batch=data[0], **kw)


def test_a_model_already_in_half_precision_is_refused():
    model, data = CASES["mlp"]()
    with pytest.raises(ConfigError, match=r"model.float\(\)"):
        harmony.compile(model.to(torch.bfloat16), example_batch=data[0], precision="bf16")


def test_checkpoint_saves_fp32_masters_and_resumes_bitwise(tmp_path):
    model, data = CASES["mlp"]()
    budget = int(training_state_bytes(model) * 0.2)
    whole = copy.deepcopy(model)
    run_compiled(whole, data, 4, budget, precision="bf16")

    first = copy.deepcopy(model)
    sm = harmony.compile(first, example_batch=data[0], memory_budget=budget, microbatches=4, precision="bf16")
    sm(*data[0])
    sd = sm.training_state_dict()
    assert all(t.dtype == torch.float32 for t in sd["model"].values())
    masters = sm.runtime.state.master          # the host's fp32 masters themselves, not copies of device values
    assert all(t.data_ptr() == masters[n].data_ptr() for n, t in sd["model"].items())
    assert all(v.dtype == torch.float32 for s in sd["optimizer"].values() for v in s.values() if v.dim())
    harmony.save(sm, tmp_path / "ckpt")
    sm.close()
    second = copy.deepcopy(model)
    sm2 = harmony.compile(second, example_batch=data[0], memory_budget=budget, microbatches=4, precision="bf16")
    harmony.load(sm2, tmp_path / "ckpt")
    for b in data[1:]:
        sm2(*b)
    sm2.close()
    _assert_bitwise(second, whole)


def test_fp16_resume_continues_the_loss_scale_bitwise(tmp_path):
    """The loss scale and its growth count travel in the checkpoint: 1 step, save, load into a fresh
    module, 2 steps equals 3 uninterrupted steps, parameters and scale."""
    model, data = CASES["mlp"]()
    budget = int(training_state_bytes(model) * 0.2)
    scaling = dict(init_scale=2.0 ** 10, growth_interval=1)
    whole = copy.deepcopy(model)
    sm, _, _ = run_compiled(whole, data, 4, budget, precision="fp16", loss_scaling=scaling)
    assert sm.loss_scale == 2.0 ** 13

    first = copy.deepcopy(model)
    sm1 = harmony.compile(first, example_batch=data[0], memory_budget=budget, microbatches=4, precision="fp16",
                          loss_scaling=scaling)
    sm1(*data[0])
    assert sm1.training_state_dict()["loss_scaler"]["scale"] == 2.0 ** 11
    harmony.save(sm1, tmp_path / "ckpt")
    sm1.close()
    second = copy.deepcopy(model)
    sm2 = harmony.compile(second, example_batch=data[0], memory_budget=budget, microbatches=4, precision="fp16",
                          loss_scaling=scaling)
    harmony.load(sm2, tmp_path / "ckpt")
    assert sm2.loss_scale == 2.0 ** 11
    for b in data[1:]:
        sm2(*b)
    sm2.close()
    assert sm2.loss_scale == sm.loss_scale
    _assert_bitwise(second, whole)


def test_bf16_with_optimizer_state_on_disk_matches_eager(tmp_path):
    """A host budget that holds the fp32 masters but not all the optimizer state sends packs' state to
    disk; the numerics do not change."""
    model, data = CASES["gpt"]()
    ref, _ = eager_mixed(model, data, 4, torch.bfloat16)
    masters = 4 * sum(p.numel() for p in model.parameters())
    ours = copy.deepcopy(model)
    sm, stats, _ = run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.2), precision="bf16",
                                host_memory_budget=int(masters * 3.6), offload_dir=tmp_path)
    assert "disk" in sm.plan.by_pack("optim_on").values()
    assert stats[-1]["disk_read_bytes"] > 0
    _assert_bitwise(ours, ref)


def test_report_shows_the_precision_and_bytes_per_tier():
    model, data = CASES["mlp"]()
    sm, _, _ = run_compiled(copy.deepcopy(model), data[:1], 4, int(training_state_bytes(model) * 0.2), precision="bf16")
    text, summary = sm.report(), __import__("json").loads(sm.report("json"))
    n = sum(p.numel() for p in model.parameters())
    tiers = summary["tiers"]
    assert tiers["precision"] == "bf16" and tiers["compute_dtype"] == "bfloat16"
    assert tiers["device_copy_bytes"] == 2 * n and tiers["master_bytes"] == 4 * n
    assert tiers["host_bytes"] == 4 * n + sum(s.optim_bytes for s in sm.plan.packs) and tiers["disk_bytes"] == 0
    assert "precision" in text and "bf16: device copies in bfloat16" in text and "between steps" in text


def test_tied_embedding_and_head_are_close_in_bf16():
    """The built-in GPT's default ties its embedding and head: that weight is used by two packs and gets
    its two gradient contributions per microbatch summed in another order than eager's single backward
    (DESIGN.md's one exception to bitwise), and in bf16 each order rounds at 8 bits of mantissa. With SGD
    (an update proportional to the gradient, unlike Adam's normalised one) the parameters after 3 steps
    stay close (the weights move by up to 0.07 in these steps); after the first step every weight
    feeds on the tied one, so only closeness is asserted."""
    model, data = CASES["gpt"](tie=True)
    sgd = dict(lr=0.1, momentum=0.9)
    ref, _ = eager_mixed(model, data, 4, torch.bfloat16, optimizer=torch.optim.SGD, **sgd)
    ours = copy.deepcopy(model)
    sm, _, _ = run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.3), precision="bf16",
                            optimizer=torch.optim.SGD, optimizer_kwargs=sgd)
    tied = "tok.weight"
    assert sum(tied in p.params for p in sm.plan.packs) == 2
    diffs = {n: (a - b).abs().max().item() for (n, a), b in zip(ours.named_parameters(), ref.parameters())}
    assert max(diffs.values()) < 3e-4, diffs   # measured 1.4e-4; fp32 training lands 6e-4 from this reference




@pytest.mark.parametrize("clip", [None, 1.0])
def test_host_fp32_gradients_reuse_one_buffer_unless_the_updates_wait(clip):
    """bf16 host steps convert every pack's gradients into one fp32 buffer the host thread reuses (the largest
    pack's size, the same memory every step: no fresh pages per step), and the run stays bitwise eager's; updates
    that wait for the global norm hold every pack's gradients, so those are made apart and the buffer stays unused."""
    model, data = CASES["gpt"]()
    ref, _ = eager_mixed(model, data, 4, torch.bfloat16, clip=clip)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.2),
                         microbatches=4, precision="bf16", clip_grad_norm=clip)
    buffer, places = sm.runtime.state.grad_buffer, set()
    for batch in data:
        sm(*batch)
        if buffer.flat is not None:
            places.add(buffer.flat.data_ptr())
    sm.close()
    _assert_bitwise(ours, ref)
    assert len(sm.plan.packs) > 1 and set(sm.plan.by_pack("step_on").values()) == {"host"}
    if clip is not None:
        assert buffer.flat is None
        return
    largest = max(sum(dict(sm.program.gm.named_parameters())[n].numel() for n in s.stepped) for s in sm.plan.packs)
    assert buffer.flat.numel() == largest and len(places) == 1
    assert all(p.grad is None for p in ours.parameters())
