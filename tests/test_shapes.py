"""Batches of other shapes than the example's (driver/shapes.py): a smaller last batch, another sequence length.

Every batch up to the example's shapes runs the compiled plan (its microbatches cut evenly: 7 rows in 2 are 4 and 3);
a batch with fewer rows than the plan has microbatches gets a plan of its own; a larger one is refused. Each trains
the same state as eager PyTorch does: gradient accumulation over the same microbatches, each microbatch's mean loss
weighted by its rows (``loss_i / m`` where the microbatches are alike), bitwise in fp32.
"""
import copy
import logging

import pytest
import torch

import harmony
from harmony.runtime.optim import optimizer_kwargs
from harmony.driver.shapes import split_rows
from harmony.runtime.plan import even_rows
from models import call, eager_full, gpt_case, hf_gpt2_case, training_state_bytes


def plan_rows(n: int, microbatches: int, size: int) -> tuple:
    """How a plan of ``microbatches`` microbatches of ``size`` rows cuts a batch of ``n`` rows: the compiled plan
    evenly where each microbatch gets a row, else a plan of its own (``split_rows``)."""
    return even_rows(n, microbatches) if n >= microbatches else split_rows(n, size)


def eager_steps(model, batches, microbatches, clip=None):
    """Eager AdamW over ``batches``, each cut as a plan of ``microbatches`` microbatches compiled for the first
    batch's rows cuts it (``plan_rows``), the microbatches' losses weighted by rows (``clip``: ``clip_grad_norm_``
    before each step)."""
    model = copy.deepcopy(model)
    model.norms = []
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    losses = []
    first = batches[0] if isinstance(batches[0], dict) else dict(enumerate(batches[0]))
    size = -(-next(iter(first.values())).shape[0] // microbatches)
    for batch in batches:
        items = batch if isinstance(batch, dict) else dict(enumerate(batch))
        n = next(iter(items.values())).shape[0]
        rows = plan_rows(n, microbatches, size)
        start, total = 0, 0.0
        for r in rows:
            part = {k: v[start:start + r] for k, v in items.items()}
            loss = call(model, part if isinstance(batch, dict) else tuple(part.values()))
            (loss / len(rows) if len(set(rows)) == 1 else loss * (r / n)).backward()
            total += loss.item() * r
            start += r
        if clip is not None:
            model.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total / n)
    return model, losses


def run(sm, batches):
    return [(sm(**b) if isinstance(b, dict) else sm(*b)).item() for b in batches]


def assert_same_params(ours, ref):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


def swapping(sm) -> bool:
    return any(n.op == "call_function" and n.target.__name__ == "swap_in" for n in sm.graph.nodes)


def test_split_rows():
    assert split_rows(32, 8) == (8, 8, 8, 8)
    assert split_rows(30, 8) == (8, 8, 8, 6)
    assert split_rows(17, 8) == (6, 6, 5)
    assert split_rows(5, 8) == (5,)
    assert split_rows(7, 4) == (4, 3)
    assert all(sum(split_rows(n, b)) == n and max(split_rows(n, b)) <= b for n in range(1, 40) for b in range(1, 9))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_dataloader_epoch_with_a_smaller_last_batch_trains_as_eager(microbatches):
    """23 samples in batches of 8: the last has 7 rows, one microbatch of 7 or two of 4 and 3 (uneven)."""
    model, data = gpt_case(batch=8)
    x = torch.cat([b[0] for b in data])[:23]
    y = torch.cat([b[1] for b in data])[:23]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    batches = [tuple(b) for b in loader] * 2       # two epochs: the cached plan serves the second
    assert [b[0].shape[0] for b in batches[:3]] == [8, 8, 7]
    ref, ref_losses = eager_steps(model, batches, microbatches)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, batches[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=microbatches)
    assert swapping(sm)
    losses = run(sm, batches)
    assert_same_params(ours, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert sm.shapes.compiles == 0 and sm.steps == 6 and len(sm.shapes.plans) == 1    # the compiled plan ran all
    assert sm.shapes.served == {(((7, 16), torch.int64),) * 2: 2}
    assert sm.stats["microbatch_rows"] == list(even_rows(7, microbatches)) and sm.stats["plan"] == "compiled"
    assert sm.stats["measured_peak"] <= sm.stats["budget"]
    assert sm.stats["predicted_peak"] == sm.shapes.example.predicted.peak     # the largest batch's
    assert "batch shapes" in sm.report() and "1 smaller ones seen (2 steps at them)" in sm.report()


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
def test_a_shorter_sequence_runs_the_compiled_plan_as_eager(caplog, policy):
    model, data = gpt_case(batch=8)
    short = [(x[:, :12], y[:, :12]) for x, y in data]
    batches = [data[0], short[0], short[1], data[1], short[2], (data[2][0][:5, :7], data[2][1][:5, :7])]
    ref, _ = eager_steps(model, batches, 4)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4,
                         policy=policy)
    with caplog.at_level(logging.INFO, logger="harmony"):
        run(sm, batches)
    assert_same_params(ours, ref)
    assert not [r for r in caplog.records if "new batch shape" in r.getMessage()]
    assert sm.shapes.compiles == 0 and len(sm.shapes.plans) == 1 and len(sm.shapes.served) == 2
    assert sm.stats["microbatch_rows"] == [2, 1, 1, 1] and sm.stats["measured_peak"] <= sm.stats["budget"]
    assert sm.plan is sm.shapes.example.program.plan and sm.graph is sm.program.schedule   # the example's plan


@pytest.mark.parametrize("seq", [64, 32])
def test_a_longer_sequence_is_refused_before_any_state_changes(seq):
    """Compiled at 16 tokens under a tight budget: 64 tokens do not fit the compiled packs even one row per
    microbatch, 32 would with fewer rows per microbatch; both are refused, saying to compile with the largest batch
    and what this one would need, and nothing changes."""
    model, data = gpt_case(batch=8, seq=64)
    x, y = data[0]
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, (x[:, :16], y[:, :16]), memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=4)
    sm(x[:, :16], y[:, :16])
    before = copy.deepcopy(sm.training_state_dict())
    need = "predicts a peak of" if seq == 32 else "cannot be trained"
    with pytest.raises(harmony.errors.InputError, match=rf"idx int64\[8, {seq}\].*largest batch.*{need}"):
        sm(x[:, :seq], y[:, :seq])
    after = sm.training_state_dict()
    assert sm.steps == 1 and len(sm.shapes.plans) == 1 and not sm.shapes.served
    for name, a in before["model"].items():
        assert torch.equal(a, after["model"][name]), name
    assert _flat(before["optimizer"]) == _flat(after["optimizer"])
    sm(x[:, :16], y[:, :16])
    ref, _ = eager_steps(model, [(x[:, :16], y[:, :16])] * 2, 4)
    assert_same_params(ours, ref)


def _flat(state) -> list:
    out = []
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            out += [k] + _flat(state[k])
    elif isinstance(state, (list, tuple)):
        for v in state:
            out += _flat(v)
    elif isinstance(state, torch.Tensor):
        out.append(state.clone().tolist())
    else:
        out.append(state)
    return out


def test_hugging_face_gpt2_trains_a_new_sequence_length_as_eager():
    """torch.export keeps the sequence length symbolic (``Dim.AUTO`` on every dimension): the compiled plan runs it."""
    model, data = hf_gpt2_case(batch=4)
    short = [{k: v[:, :10] for k, v in b.items()} for b in data]
    batches = [data[0], short[0], data[1], short[1]]
    ref, ref_losses = eager_steps(model, batches, 2)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=2)
    assert swapping(sm)
    losses = run(sm, batches)
    assert_same_params(ours, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert sm.shapes.compiles == 0 and sm.program.gm.meta[harmony.compiler.trace.TRACE_INFO].frontend == "export"


def test_the_cache_keeps_at_most_its_limit_and_always_the_example(caplog):
    """Batches of fewer rows than the plan's 4 microbatches get plans of their own, cached."""
    model, data = gpt_case(batch=8)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4)
    sm.shapes.limit = 2
    x, y = data[0]
    with caplog.at_level(logging.INFO, logger="harmony"):
        for n in (3, 2, 3):
            sm(x[:n], y[:n])
    assert sm.shapes.compiles == 3 and sm.shapes.dropped == 2
    assert list(sm.shapes.plans) == [sm.shapes.example.key, (((3, 16), torch.int64),) * 2]
    assert any("fewer than the plan's 4 microbatches" in r.getMessage() for r in caplog.records)
    assert any("dropped the plan" in r.getMessage() for r in caplog.records)
    sm(x, y)
    assert sm.shapes.compiles == 3


def test_weights_on_disk_train_other_shapes_as_on_the_host(tmp_path):
    """Packs wholly on disk (placeholders in the model between steps) plan and train other shapes bitwise as the
    same plan with its weights on the host."""
    results = []
    for weights_on in ("host", "disk"):
        model, data = gpt_case(batch=8)
        x, y = data[1]
        sm = harmony.compile(model, data[0], memory_budget=training_state_bytes(model) // 3, microbatches=4,
                             optimizer_on="host", disk_group_bytes="24KiB", weights_on=weights_on,
                             offload_dir=tmp_path)
        assert set(sm.plan.by_pack("master_on").values()) == {weights_on}
        losses = run(sm, [data[0], (x[:7], y[:7]), (x[:, :12], y[:, :12]), data[2], (x[:3], y[:3]), (x[:7], y[:7])])
        sm.sync_model()
        results.append((losses, [p.detach().clone() for p in model.parameters()], sm.shapes.compiles))
        sm.close()
    assert results[0][0] == results[1][0] and results[1][2] == 1     # 3 rows in 4 microbatches: a plan of its own
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_a_step_that_fails_at_a_new_shape_is_rolled_back():
    """A bad token id in a batch of a new shape: planned (shapes only), then the step raises and changes nothing;
    the module trains on as eager after the same exception."""
    model, data = gpt_case(batch=8)
    x, y = data[1]
    bad = x[:6].clone()
    bad[0, 0] = 10_000
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4)
    sm(*data[0])
    with pytest.raises(IndexError):
        sm(bad, y[:6])
    with pytest.raises(IndexError):
        sm(bad[:3], y[:3])       # a shape planned for first
    assert sm.steps == 1 and sm.shapes.compiles == 1 and not sm.shapes.served
    run(sm, [(x[:6], y[:6]), (x[:3], y[:3]), data[2]])
    ref, _ = eager_steps(model, [data[0], (x[:6], y[:6]), (x[:3], y[:3]), data[2]], 4)
    assert_same_params(ours, ref)


def test_the_ondemand_baseline_refuses_other_shapes():
    model, data = gpt_case(batch=8)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4,
                         policy="ondemand")
    x, y = data[0]
    with pytest.raises(harmony.errors.InputError, match="ondemand"):
        sm(x[:6], y[:6])
    sm(x, y)


def _dp_rank(rank, world):
    """Each rank trains its rows of the batches ``_dp_batches`` gives; a step whose ranks disagree is refused."""
    import harmony.data
    model, data = gpt_case(batch=8)
    sgd = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
    sm = harmony.compile(model, harmony.data.shard(data[0]), memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=2, **sgd)
    refused = None
    for i, batch in enumerate(_dp_batches(data)):
        sm(*harmony.data.shard(batch))
        if i == 1:       # rank 0's 1 row needs a plan of its own, rank 1's 2 run the compiled: both refuse
            x, y = harmony.data.shard(batch)
            try:
                sm(x[:1 + rank], y[:1 + rank])
            except harmony.errors.InputError as e:
                refused = str(e)
    return dict(params=[p.detach().numpy().copy() for p in model.parameters()], refused=refused, steps=sm.steps,
                compiles=sm.shapes.compiles)


def _dp_batches(data):
    x, y = data[1]
    return [data[0], (x[:6], y[:6]), (x[:, :12], y[:, :12]), data[2]]


def test_data_parallel_ranks_train_a_smaller_last_batch_and_a_shorter_sequence_as_eager():
    """Two gloo ranks, each with half of each batch (3 rows of a last batch of 6: microbatches of 2 and 1): the
    parameters of eager full-batch SGD on the whole batches (allclose: the all-reduce sums in another order)."""
    from test_collectives import _spawn
    res = _spawn(2, _dp_rank, timeout=300)
    assert sorted(res) == [0, 1] and all(isinstance(v, dict) for v in res.values()), res
    model, data = gpt_case(batch=8)
    ref, _ = eager_full(model, _dp_batches(data), torch.optim.SGD, lr=0.1, momentum=0.9)
    for r in (0, 1):
        assert res[r]["steps"] == 4 and res[r]["compiles"] == 0, res[r]    # 3 rows a rank, 12 tokens
        assert "different plans" in res[r]["refused"]
        for a, b in zip(res[r]["params"], ref.parameters()):
            assert torch.allclose(torch.from_numpy(a), b.detach(), rtol=1e-5, atol=1e-6)
    assert all((a == b).all() for a, b in zip(res[0]["params"], res[1]["params"]))


def test_a_checkpoint_saved_after_a_new_shape_resumes_bitwise(tmp_path):
    """The state is shared between the shapes' plans: a checkpoint is the same whatever shape stepped last, and a
    module loaded from it trains the next batches (one of a new shape) as the one that saved it."""
    model, data = gpt_case(batch=8)
    x, y = data[1]
    budget = int(training_state_bytes(model) * 0.5)
    twin = copy.deepcopy(model)
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=4)
    run(sm, [data[0], (x[:7], y[:7])])
    harmony.save(sm, tmp_path / "ckpt")
    later = [(x[:, :12], y[:, :12]), (x[:7], y[:7])]
    run(sm, later)
    resumed = harmony.compile(twin, data[0], memory_budget=budget, microbatches=4)
    harmony.load(resumed, tmp_path / "ckpt")
    run(resumed, later)
    assert resumed.steps == sm.steps == 4
    assert_same_params(twin, model)


def test_gradient_clipping_at_a_smaller_last_batch_is_eager_clip_grad_norm():
    """clip_grad_norm= clips the norm of the last batch's row-weighted gradient as eager clip_grad_norm_ does."""
    model, data = gpt_case(batch=8)
    x, y = data[1]
    batches = [data[0], (x[:7], y[:7]), (x[:, :12], y[:, :12])]
    ref, _ = eager_steps(model, batches, 2, clip=0.05)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=2,
                         clip_grad_norm=0.05)
    norms = []
    for b in batches:
        sm(*b)
        norms.append(sm.stats["grad_norm"])
    assert_same_params(ours, ref)
    assert norms == ref.norms and min(norms) > 0.05
