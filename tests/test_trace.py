"""harmony.compiler.trace: one graph from batch to loss, over the user's own tensors.

Numerics are checked bitwise against eager PyTorch (fp32, CPU): the traced
graph runs the same kernels in the same order, so forward loss and gradients
must match exactly.
"""

import copy
import inspect
import os

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harmony.compiler.trace import MODULE_PATH, TRACE_INFO, module_path_of, trace
from harmony.errors import ConfigError, InputError, TraceError

FRONTENDS = ["fx", "export"]


# ------------------------------------------------------------------ helpers


def loss_and_grads(model, run):
    """Loss of ``run()`` and the gradient of every named parameter after its backward."""
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_numerics(model, gm, eager, batch):
    expected_loss, expected_grads = loss_and_grads(model, eager)
    loss, grads = loss_and_grads(model, lambda: gm(*batch))
    assert torch.equal(loss, expected_loss), (loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], expected_grads[name]), name


def assert_same_state(gm, model, extra=()):
    """The graph reads the user's own parameter and buffer objects, each once."""
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()} | {id(p) for p in extra}
    assert {id(b) for b in gm.buffers()} == {id(b) for b in model.buffers()}
    assert len(list(gm.parameters())) == len(list(model.parameters())) + len(extra)


def assert_paths_valid(gm, model):
    valid = {path for path, _ in model.named_modules()}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        assert MODULE_PATH in node.meta, node.format_node()
        assert module_path_of(node) in valid, (node.format_node(), module_path_of(node))


def layer_sequence(gm, prefix):
    """Layer index of each node under ``prefix`` ("blocks." -> 0, 0, 1, ...), in graph order."""
    indices = []
    for node in gm.graph.nodes:
        path = module_path_of(node)
        head = path[len(prefix) :].split(".")[0] if path.startswith(prefix) else ""
        if head.isdigit():
            indices.append(int(head))
    return indices


def assert_layers_in_order(gm, prefix, n_layers):
    indices = layer_sequence(gm, prefix)
    assert indices == sorted(indices), indices
    assert set(indices) == set(range(n_layers))


def line_of(function, text):
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def placeholders(gm):
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


# ------------------------------------------------------------------ models


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


class Attention(nn.Module):
    def __init__(self, dim, heads, seq):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, c = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        scores = scores.masked_fill(~self.causal, float("-inf"))  # t == seq: fx cannot slice by a traced size
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads, seq):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, seq)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT with the token embedding tied to the output head; returns the loss itself."""

    def __init__(self, vocab=32, dim=16, heads=2, seq=8, n_layers=3):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, seq) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.lin(x)
        if x.sum().item() > 0:  # a number compared in Python: not traced (a bool() of a tensor is, branches.py)
            return x * 2
        return -x


class BranchyNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), Branchy(), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def classification_batch(n=5, features=6, classes=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def token_batch(vocab, batch=2, seq=8, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.randint(0, vocab, (batch, seq), generator=g)


# -------------------------------------------------------------- plain models


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_mlp_with_loss_fn_matches_eager_bitwise(frontend):
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    batch = classification_batch()
    gm = trace(model, batch, loss_fn=loss_fn, frontend=frontend)

    assert gm.meta[TRACE_INFO].frontend == frontend
    assert placeholders(gm) == ["input", "target"]  # nn.Sequential.forward(input) + the target
    assert gm.graph.output_node().args[0].op != "placeholder"
    assert_same_state(gm, model)
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert_same_numerics(model, gm, lambda: loss_fn(model(batch[0]), batch[1]), batch)
    assert_paths_valid(gm, model)
    assert_layers_in_order(gm, "", 5)
    loss_nodes = [n for n in gm.graph.nodes if n.op != "output" and gm.graph.output_node().args[0] is n]
    assert module_path_of(loss_nodes[0]) == ""  # the loss is top-level code


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_batchnorm_buffers_update_like_eager(frontend):
    eager_model = cnn()
    model = copy.deepcopy(eager_model)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    gm = trace(model, batch, loss_fn=loss_fn, frontend=frontend)
    # Tracing runs nothing for real: the statistics are untouched.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert_same_state(gm, model)

    eager_loss = loss_fn(eager_model(batch[0]), batch[1])
    eager_loss.backward()
    loss = gm(*batch)
    loss.backward()
    assert torch.equal(loss, eager_loss)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    expected = eager_model.state_dict()
    for name, value in model.state_dict().items():  # running_mean/var, num_batches_tracked
        assert torch.equal(value, expected[name]), name
    assert model[1].num_batches_tracked.item() == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_unused_state_still_belongs_to_the_graph_module(frontend):
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(6, 4), nn.Linear(2, 2)
            self.register_buffer("step", torch.zeros(()))

        def forward(self, x):
            return self.used(x)

    model = WithSpare()
    gm = trace(model, classification_batch(), loss_fn=nn.CrossEntropyLoss(), frontend=frontend)
    assert_same_state(gm, model)
    assert gm.get_parameter("unused.weight") is model.unused.weight
    assert set(gm.state_dict()) == set(model.state_dict())


def test_trace_restores_modes_and_traces_training():
    model = cnn().eval()
    batch = (torch.randn(2, 3, 6, 6), torch.tensor([0, 1]))
    gm = trace(model, batch, loss_fn=nn.CrossEntropyLoss(), frontend="export")
    assert not any(m.training for m in model.modules())
    # The graph is the training step: batch statistics, running stats updated.
    gm(*batch).backward()
    assert model[1].num_batches_tracked.item() == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_tied_gpt_appears_once_and_matches_eager(frontend):
    model = TinyGPT()
    batch = token_batch(32)
    gm = trace(model, batch, frontend=frontend)

    assert placeholders(gm) == ["idx", "targets"]
    assert model.head.weight is model.wte.weight
    assert_same_state(gm, model)  # the tied weight counted once
    assert gm.get_buffer("blocks.0.attn.causal") is model.blocks[0].attn.causal
    assert "blocks.0.attn.causal" not in gm.state_dict()  # non-persistent stays non-persistent
    assert_same_numerics(model, gm, lambda: model(*batch), batch)
    assert_paths_valid(gm, model)
    assert_layers_in_order(gm, "blocks.", 3)
    paths = [module_path_of(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert paths.index("wte") < paths.index("blocks.0.ln_1") < paths.index("ln_f") < paths.index("head")


def test_export_graph_serves_other_batch_sizes():
    model = TinyGPT()
    gm = trace(model, token_batch(32, batch=4), frontend="export")
    for size in (1, 3, 6):
        batch = token_batch(32, batch=size, seed=size)
        assert torch.equal(gm(*batch), model(*batch))


def test_aliased_inputs_stay_distinct():
    # labels=input_ids passed as the same tensor must not fuse the two inputs.
    model = TinyGPT()
    ids, _ = token_batch(32)
    gm = trace(model, (ids, ids), frontend="export")
    other_ids, other_targets = token_batch(32, seed=7)
    assert torch.equal(gm(other_ids, other_targets), model(other_ids, other_targets))


def test_dict_batch_names_placeholders_in_key_order():
    model = TinyGPT()
    ids, targets = token_batch(32)
    gm = trace(model, {"targets": targets, "idx": ids}, frontend="fx")
    assert placeholders(gm) == ["targets", "idx"]
    assert torch.equal(gm(targets, ids), model(ids, targets))


# -------------------------------------------------------------- Hugging Face

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def bert():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return transformers.BertForMaskedLM(config)


def test_hf_gpt2_through_export(gpt2):
    ids, labels = token_batch(128, seq=16)
    batch = {"input_ids": ids, "labels": labels}
    gm = trace(gpt2, batch)  # auto: fx cannot trace it, export can

    info = gm.meta[TRACE_INFO]
    assert info.frontend == "export" and any("torch.fx" in note for note in info.notes)
    assert placeholders(gm) == ["input_ids", "labels"]
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert_same_state(gm, gpt2)
    assert_same_numerics(gpt2, gm, lambda: gpt2(**batch).loss, tuple(batch.values()))
    assert_paths_valid(gm, gpt2)
    assert_layers_in_order(gm, "transformer.h.", 2)
    # Nodes export makes itself (batch sizes, weights) sit with their first user, not at the top level.
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    assert first.target == torch.ops.aten.sym_size.int and module_path_of(first) == "transformer"
    paths = {p for p, _ in gpt2.named_modules()} - {""}
    assert {module_path_of(n) for n in gm.graph.nodes if n.op == "get_attr"} <= paths


def test_hf_bert_through_export(bert):
    ids, labels = token_batch(128, seq=16, seed=5)
    batch = {"input_ids": ids, "labels": labels}
    gm = trace(bert, batch, frontend="export")

    assert_same_state(gm, bert)
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert_same_numerics(bert, gm, lambda: bert(**batch).loss, tuple(batch.values()))
    assert_paths_valid(gm, bert)
    assert_layers_in_order(gm, "bert.encoder.layer.", 2)


def test_export_graph_carries_no_trace_time_dtype_or_device_asserts():
    """torch.export records ``_assert_tensor_metadata`` (the dtype and device a ``.to(...)`` saw: fp32 on the CPU)
    at every ``.to`` of Llama's rotary embedding; the trace drops them, or a bf16 copy or a GPU fails them; and
    ``retarget`` points the CPU device constants the graph recorded (``arange(device=cpu)``) at another device."""
    from harmony.compiler.trace.export import graph_modules as _graph_modules, retarget
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32,
                                   use_cache=False)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    gm = trace(model, {"input_ids": ids, "labels": ids})
    nodes = [n for m in _graph_modules(gm) for n in m.graph.nodes]
    assert not [n for n in nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    cpu = [n for n in nodes if torch.device("cpu") in (*n.args, *n.kwargs.values())]
    assert cpu                       # arange, _to_copy, ... name the CPU they were traced on
    managed = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    retarget(gm, torch.device("meta"), managed)
    nodes = [n for m in _graph_modules(gm) for n in m.graph.nodes]
    assert not [n for n in nodes if torch.device("cpu") in (*n.args, *n.kwargs.values())]
    assert all(t.device.type == "cpu" for t in [*gm.parameters(), *gm.buffers()])   # the runtime moves state


def test_hf_positional_batch_is_an_input_error(gpt2):
    # GPT2LMHeadModel.forward(input_ids, past_key_values, ...): labels would land in past_key_values.
    # (newer transformers call the second parameter ``cache``: the message names whichever it is)
    with pytest.raises(InputError, match=r"GPT2LMHeadModel\.forward\(input_ids, (past_key_values|cache)"):
        trace(gpt2, token_batch(128, seq=16))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
def test_untraceable_model_names_the_line_and_the_leaf_fix(frontend):
    model = BranchyNet()
    with pytest.raises(TraceError) as raised:
        trace(model, classification_batch(features=4, classes=3), loss_fn=nn.CrossEntropyLoss(), frontend=frontend)
    message = str(raised.value)
    line = line_of(Branchy.forward, "if x.sum().item() > 0")
    assert f"{os.path.basename(__file__)}:{line}" in message
    assert "if x.sum().item() > 0" in message
    assert "'blocks.1'" in message
    assert "leaf_modules=[Branchy]" in message


class AliasedWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        h[:, :2].unsqueeze_(0)
        return h.sum()


def test_an_in_place_write_that_cannot_be_rewritten_names_its_source_line():
    """The fx tracer records each node's user frames (``trace._user_stack``): the error names this file, the line
    of the write and its code, and every node of a model's forward carries a stack."""
    with pytest.raises(TraceError) as raised:
        trace(AliasedWrite(), (torch.randn(3, 4),), frontend="fx")
    line = line_of(AliasedWrite.forward, "h[:, :2].unsqueeze_(0)")
    assert f"{os.path.basename(__file__)}:{line} in forward: h[:, :2].unsqueeze_(0)" in str(raised.value)
    gm = trace(BranchyNet(), classification_batch(features=4, classes=3), loss_fn=nn.CrossEntropyLoss(),
               leaf_modules=[Branchy], frontend="fx")
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert ops and all(n.stack_trace and "in forward" in n.stack_trace for n in ops)


@pytest.mark.parametrize("leaf", [Branchy, "Branchy", "blocks.1"])
def test_leaf_module_with_control_flow_traces_with_fx(leaf):
    model, loss_fn = BranchyNet(), nn.CrossEntropyLoss()
    batch = classification_batch(features=4, classes=3)
    gm = trace(model, batch, loss_fn=loss_fn, leaf_modules=[leaf], frontend="fx")

    leaves = [n for n in gm.graph.nodes if n.op == "call_module" and module_path_of(n) == "blocks.1"]
    assert len(leaves) == 1 and gm.get_submodule(leaves[0].target) is model.blocks[1]
    assert_same_state(gm, model)
    assert_same_numerics(model, gm, lambda: loss_fn(model(batch[0]), batch[1]), batch)
    assert any("fake tensors" in note for note in gm.meta[TRACE_INFO].notes)


def test_unknown_leaf_name_and_export_leaves_are_config_errors():
    batch = classification_batch(features=4, classes=3)
    with pytest.raises(ConfigError, match="blocks.7"):
        trace(BranchyNet(), batch, loss_fn=nn.CrossEntropyLoss(), leaf_modules=["blocks.7"])
    with pytest.raises(ConfigError, match="fx"):
        trace(BranchyNet(), batch, loss_fn=nn.CrossEntropyLoss(), leaf_modules=[Branchy], frontend="export")
    with pytest.raises(ConfigError, match="frontend"):
        trace(BranchyNet(), batch, loss_fn=nn.CrossEntropyLoss(), frontend="dynamo")


def test_wrong_number_of_tensors_is_an_input_error():
    x, y = classification_batch()
    with pytest.raises(InputError, match=r"Sequential\.forward\(input\)"):
        trace(mlp(), (x, x, y), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(InputError, match="target"):
        trace(mlp(), (x,), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(InputError, match="tensors"):
        trace(mlp(), (x, 3), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(InputError, match="tuple of tensors or a dict"):
        trace(mlp(), x, loss_fn=nn.CrossEntropyLoss())


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
def test_wrong_shape_is_an_input_error(frontend):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = classification_batch(features=5)  # the model takes 6 features
    with pytest.raises(InputError) as raised:
        trace(model, (x, y), loss_fn=nn.CrossEntropyLoss(), frontend=frontend)
    message = str(raised.value)
    assert "mat1 and mat2" in message and "float32[5, 5]" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_model_without_a_loss_asks_for_loss_fn(frontend):
    with pytest.raises(TraceError, match="loss_fn"):
        trace(mlp(), classification_batch()[:1], frontend=frontend)  # returns logits [5, 4]


# ------------------------------------------------------------- properties


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(
    widths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    batch_size=st.integers(1, 4),
    frontend=st.sampled_from(FRONTENDS),
)
def test_random_mlps_trace_to_eager_numerics(widths, batch_size, frontend):
    torch.manual_seed(0)
    layers, width = [], 3
    for w in widths:
        layers += [nn.Linear(width, w), nn.ReLU()]
        width = w
    model = nn.Sequential(*layers, nn.Linear(width, 2))
    loss_fn = nn.CrossEntropyLoss()
    batch = (torch.randn(batch_size, 3), torch.randint(0, 2, (batch_size,)))
    gm = trace(model, batch, loss_fn=loss_fn, frontend=frontend)
    assert_same_state(gm, model)
    assert_same_numerics(model, gm, lambda: loss_fn(model(batch[0]), batch[1]), batch)
    assert_layers_in_order(gm, "", 2 * len(widths) + 1)
