"""Writes through views (compiler/trace/inplace.py, compiler/trace/views.py): slice assignment into a fresh buffer
(multi-head latent attention's queries and keys), ``copy_`` into a ``narrow``/``select``, ``index_put_``,
``masked_fill_``, ``add_``, ``fill_``/``zero_`` and ``scatter_`` into views, and reads of the base and of another,
overlapping view afterwards. Each traces to a graph without in-place writes to activations whose loss and
gradients are eager's bitwise, and trains three AdamW steps of two microbatches as eager gradient accumulation;
what cannot be planned is a ``TraceError`` naming the op and the line.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harmony.base.errors import TraceError
from harmony.compiler.trace import trace
from harmony.compiler.trace.views import write_through_view
from models import assert_bitwise, assert_graph_is_eager, call, eager_accumulate, run_compiled, training_state_bytes

MICROBATCHES = 2


class _Two(nn.Module):
    """Two maps of the input (what the writes write) and a head after them, each two layers deep: under half the
    training state as a budget the write and its readers fall in several packs."""

    def __init__(self, width=8):
        super().__init__()
        self.a, self.b, self.head = _deep(8, width), _deep(8, width), _deep(width, 3)

    def loss(self, h, y):
        return F.cross_entropy(self.head(torch.tanh(h)), y)


class SliceAssign(_Two):
    """DeepSeek's multi-head latent attention: ``query_states = k_pe.new_empty(...)`` and its two halves assigned."""

    def forward(self, x, y):
        nope, pe = self.a(x)[:, :4], self.b(x)[:, 4:]
        q = pe.new_empty(x.shape[0], 8)
        q[:, :4] = nope
        q[:, 4:] = pe
        return self.loss(q, y)


class SliceAssignZeros(_Two):
    """Slice assignment into a ``zeros`` buffer, one half of it, the rest read as zeros; then a row of it."""

    def forward(self, x, y):
        q = torch.zeros(x.shape[0], 8, device=x.device)
        q[:, 2:6] = self.a(x)[:, :4]
        q[0] = q[0] * 2
        return self.loss(q + self.b(x), y)


class CopyNarrowSelect(_Two):
    def forward(self, x, y):
        h = self.a(x)
        h.narrow(1, 0, 3).copy_(self.b(x)[:, :3])
        h.select(1, 7).copy_(h[:, 0] * 3)
        return self.loss(h, y)


class IndexPutSlice(_Two):
    def forward(self, x, y):
        h = self.a(x)
        v = h[:, 2:6]
        v.index_put_((torch.arange(2, device=x.device),), self.b(x)[:2, :4])
        return self.loss(h, y) + v.sum()


class MaskedFillView(_Two):
    """``masked_fill_`` into a view, and ``*=`` (``operator.imul`` under fx) into another."""

    def forward(self, x, y):
        h = self.a(x)
        v = h[:, 1:5]
        v.masked_fill_(v > 0.1, 0.5)
        w = h[:, 5:]
        w *= 2.0
        return self.loss(h * self.b(x), y)


class AddThroughView(_Two):
    """``add_`` into a view, then the base, the view and the write's own result read."""

    def forward(self, x, y):
        h = self.a(x)
        v = h[:, :4]
        w = v.add_(self.b(x)[:, 4:])
        return self.loss(h, y) + v.pow(2).sum() + w.mean()


class OverlappingViews(_Two):
    """A write through one view; the base and another, overlapping view made before it read after it."""

    def forward(self, x, y):
        h = self.a(x)
        first, second = h[:, :5], h[:, 3:].t()
        first.mul_(self.b(x)[:, :5])
        return self.loss(h, y) + (second * 2).sum()


class FillZeroScatter(_Two):
    def forward(self, x, y):
        h = self.a(x) * self.b(x)
        h[:, 0].zero_()
        h[:, -1].fill_(1.5)
        rows = h.view(-1, 4, 2)[:, 1]
        rows.scatter_(1, torch.zeros_like(rows[:, :1], dtype=torch.long), -1.0)
        return self.loss(h, y)


class WriteBaseReadView(_Two):
    """A write into the base (``relu_``) read afterwards through a view made before it (refused before)."""

    def forward(self, x, y):
        h = self.a(x) * self.b(x)
        v = h.view(-1)
        h.relu_()
        return self.loss(h, y) + v.sum()


class ChainedWrites(_Two):
    """Writes one after another into one tensor: through a select, a transposed row, a view of a view, the base
    itself, a clamp, and a flat view, with a view made before all of them read at the end."""

    def forward(self, x, y):
        h = self.a(x) * self.b(x)
        v = h[:, :3]
        h[:, 0].zero_()
        h[:, 1:].t()[2].fill_(1.0)
        h[:, :4][:, 1:3].mul_(2)
        h.mul_(self.b(x))
        h[:, 5:].clamp_(-0.5, 0.5)
        u = h.view(-1, 2)
        u[:18, 0].add_(v.reshape(-1))
        return self.loss(h, y) + v.sum() + u.sum()


def _deep(inputs, outputs, hidden=64):
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs))


MODELS = [SliceAssign, SliceAssignZeros, CopyNarrowSelect, IndexPutSlice, MaskedFillView, AddThroughView,
          OverlappingViews, FillZeroScatter, WriteBaseReadView, ChainedWrites]
FX = {CopyNarrowSelect, IndexPutSlice, MaskedFillView, AddThroughView, OverlappingViews, FillZeroScatter,
      WriteBaseReadView, ChainedWrites}   # the others assign to slices (x[a:b] = y), which torch.fx cannot trace
CASES = [(m, f) for m in MODELS for f in ("fx", "export") if f == "export" or m in FX]


def _data(seed=0, rows=6):
    torch.manual_seed(seed)
    return [(torch.randn(rows, 8), torch.randint(0, 3, (rows,))) for _ in range(3)]


def _budget(model) -> int:
    return int(training_state_bytes(model) * 0.5) + 2 ** 12


def _writes(gm):
    """Nodes that still write in place: a target named like ``mul_``, ``copy_``, ``iadd``."""
    found = []
    for n in gm.graph.nodes:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        base = str(name).split(".")[0]
        if n.op in ("call_function", "call_method") and base.endswith("_") and not base.startswith("_"):
            found.append(n.name)
        elif n.op == "call_function" and name in ("iadd", "imul", "isub", "itruediv"):
            found.append(n.name)
    return found


@pytest.mark.parametrize("model_class,frontend", CASES, ids=lambda x: getattr(x, "__name__", x))
def test_write_through_a_view_traces_without_writes_and_computes_eager_bits(model_class, frontend):
    torch.manual_seed(1)
    model = model_class()
    x, y = _data()[0]
    gm = trace(model, (x, y), frontend=frontend)
    assert gm.meta["harmony.trace"].frontend == frontend
    assert _writes(gm) == [], gm.graph
    assert_graph_is_eager(gm, model, (x, y))


def test_slice_assignment_is_the_root_rewritten_twice():
    """The MLA pattern's graph: two ``write_through_view`` of the buffer, the second on the first's result, and the
    head reads the second; nothing reads the buffer's old value."""
    gm = trace(SliceAssign(), _data()[0], frontend="export")
    writes = [n for n in gm.graph.nodes if n.target is write_through_view]
    assert len(writes) == 2 and writes[1].args[0] is writes[0]
    assert {s[0] for s in writes[0].args[1]} == {"aten.slice.Tensor"}
    assert writes[0].args[2] == "aten.copy_.default"
    assert len(writes[0].users) == 1 and len(writes[1].users) == 1


def test_a_write_nothing_else_reads_stays_a_twin_on_the_view():
    """``v = h[:, :2]; v.relu_()`` with only ``v`` read afterwards needs no copy of ``h``: ``relu`` of the view."""
    class Twin(_Two):
        def forward(self, x, y):
            v = self.a(x)[:, :4]
            v.relu_()
            return self.loss(v, y)
    gm = trace(Twin(width=4), _data()[0], frontend="fx")
    assert not any(n.target is write_through_view for n in gm.graph.nodes)
    assert any(n.target == "relu" for n in gm.graph.nodes)


@pytest.mark.parametrize("model_class", [SliceAssign, OverlappingViews, FillZeroScatter, AddThroughView,
                                         WriteBaseReadView],
                         ids=lambda m: m.__name__)
def test_writes_through_views_train_bitwise_as_eager(model_class):
    torch.manual_seed(2)
    model = model_class(width=8)
    data = _data(seed=3)
    ref, _ = eager_accumulate(model, data, MICROBATCHES)
    ours = copy.deepcopy(model)
    sm, _, _ = run_compiled(ours, data, MICROBATCHES, _budget(model))
    assert len(sm.plan.packs) > 1
    assert_bitwise(sm, {n: p.detach() for n, p in ref.named_parameters()})


def _deepseek(version: int):
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, f"DeepseekV{version}Config", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV{version}")
    torch.manual_seed(0)
    extra = {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
             "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1}
    cfg = config_class(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32,
                       use_cache=False, tie_word_embeddings=False, **extra)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, f"DeepseekV{version}ForCausalLM")(cfg)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 16))
        data.append({"input_ids": ids, "labels": ids.clone()})
    return model, data


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_multi_head_latent_attention_traces_to_eager_bits(version):
    """``expand_kv`` copies the keys' two parts into a ``new_empty`` buffer: in each of the two layers, two writes of
    the buffer (the MoE router's ``index_put_`` into a fresh index tensor carries no gradient and stays)."""
    model, data = _deepseek(version)
    gm = trace(model, data[0])
    assert gm.meta["harmony.trace"].frontend == "export"
    writes = [n for n in gm.graph.nodes if n.target is write_through_view]
    assert len(writes) == 4 and {n.args[2] for n in writes} == {"aten.copy_.default"}
    eager = copy.deepcopy(model)
    ref = call(eager, data[0])
    ref.backward()
    loss = gm(*data[0].values())
    loss.backward()
    assert torch.equal(loss, ref)
    grads = dict(gm.named_parameters())
    for name, p in eager.named_parameters():
        assert (p.grad is None and grads[name].grad is None) or torch.equal(grads[name].grad, p.grad), name


@pytest.mark.slow
def test_deepseek_v3_trains_bitwise_as_eager():
    model, data = _deepseek(3)
    ref, _ = eager_accumulate(model, data, MICROBATCHES)
    ours = copy.deepcopy(model)
    sm, _, _ = run_compiled(ours, data, MICROBATCHES, _budget(model) + 2 ** 18)
    assert len(sm.plan.packs) > 1
    assert_bitwise(sm, {n: p.detach() for n, p in ref.named_parameters()})


# ------------------------------------------------------------------ refused


class Half(nn.Module):
    def forward(self, x):
        return x[:, :4]


class WriteThroughLeaf(_Two):
    """A write through a view only a leaf module's own code makes: nothing outside it can replay that view."""

    def __init__(self):
        super().__init__()
        self.part = Half()

    def forward(self, x, y):
        h = self.a(x)
        self.part(h).mul_(2)
        return self.loss(h, y)


class AddThroughLeaf(WriteThroughLeaf):
    def forward(self, x, y):
        h = self.a(x)
        v = self.part(h)
        v += 1.0
        return self.loss(h, y)


class ReshapeAView(_Two):
    def forward(self, x, y):
        h = self.a(x)
        h[:, :4].unsqueeze_(0)
        return self.loss(h, y)


def _line(fn, text):
    import inspect
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("model_class,kwargs,op,code", [
    (WriteThroughLeaf, {"leaf_modules": [Half], "frontend": "fx"}, "mul_", "self.part(h).mul_(2)"),
    (AddThroughLeaf, {"leaf_modules": [Half], "frontend": "fx"}, "iadd", "v += 1.0"),
    (ReshapeAView, {"frontend": "fx"}, "unsqueeze_", "h[:, :4].unsqueeze_(0)"),
    (ReshapeAView, {"frontend": "export"}, "unsqueeze_", "h[:, :4].unsqueeze_(0)"),
], ids=["leaf-module-view", "augmented-through-leaf", "reshape-in-place-fx", "reshape-in-place-export"])
def test_a_write_that_cannot_be_planned_names_the_op_and_line(model_class, kwargs, op, code):
    with pytest.raises(TraceError) as info:
        trace(model_class(), _data()[0], **kwargs)
    text = str(info.value)
    line = _line(model_class.forward, code)
    assert op in text and f"{os.path.basename(__file__)}:{line} in forward: {code}" in text, text
    assert "cannot be planned" in text


def test_write_through_view_leaves_its_input_alone_and_replays_the_view():
    base = torch.arange(6.0).reshape(2, 3)
    out = write_through_view(base, (("select", (1, 2), {}),), "fill_", -1.0)
    assert torch.equal(base, torch.arange(6.0).reshape(2, 3))
    assert out.tolist() == [[0.0, 1.0, -1.0], [3.0, 4.0, -1.0]]


def test_the_views_module_example_runs():
    import doctest

    from harmony.compiler.trace import views
    assert doctest.testmod(views).failed == 0
