"""The cost model: exact per-node bytes and FLOPs, symbolic in the batch size, with no real memory."""
import subprocess
import sys
import textwrap

import pytest
import sympy
import torch

import harmony
from harmony.compiler import cost, measured, pack_cost
from harmony.compiler.meta import COST
from harmony.compiler.trace import trace
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.optim import optimizer_kwargs


def test_linear_costs_are_exact_and_symbolic_in_the_batch():
    c = GPTConfig(layers=1, width=64, vocab=32, seq=16, heads=2, tie=False)
    model = GPT(c)
    x, y = next(copy_task(c, 8, 1))
    gm = trace(model, (x, y))
    cost.annotate(gm, (x, y), microbatch=2)
    qkv = next(n for n in gm.graph.nodes if n.name == "blocks_0_qkv")
    rec = qkv.meta[COST]
    B = cost.B
    assert sympy.simplify(rec.out_bytes.expr - 16 * 3 * 64 * 4 * B) == 0          # [B, T, 3W] fp32
    assert sympy.simplify(rec.fwd_flops.expr - 2 * 16 * 64 * 3 * 64 * B) == 0    # 2 * B*T * W * 3W
    assert rec.bwd_flops.at(2) == 2 * rec.fwd_flops.at(2)                        # input and weight grads
    assert rec.saved_inputs == (0,)                                              # keeps its input for backward
    attn = next(n for n in gm.graph.nodes if "scaled_dot_product" in n.name)
    assert attn.meta[COST].fwd_flops.at(2) > 0                                   # CPU attention is counted


def test_a_billion_parameter_model_is_analysed_without_real_memory():
    code = textwrap.dedent("""
        import resource, torch
        from harmony.models import GPT, GPTConfig
        from harmony.compiler.trace import trace
        from harmony.compiler import cost
        c = GPTConfig(vocab=50304, seq=1024, layers=24, width=1856, heads=16)
        with torch.device("meta"):
            m = GPT(c)
        n = sum(p.numel() for p in m.parameters())
        x = torch.empty(8, c.seq, dtype=torch.long, device="meta")
        gm = trace(m, (x, x.clone()), frontend="fx")
        cost.annotate(gm, (x, x.clone()), 2)
        print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    params, rss = map(int, out.stdout.split()[-2:])
    assert params > 1e9
    assert rss < 1.5 * 2**30, f"peak RSS {rss / 2**30:.2f} GiB: the analysis allocated real memory"


def test_optimizer_profile_tells_loop_from_foreach():
    loop = cost.optimizer_profile(torch.optim.AdamW, {"foreach": False})
    each = cost.optimizer_profile(torch.optim.AdamW, {"foreach": True})
    assert loop["state_per_byte"] == each["state_per_byte"] > 1.99
    assert loop["extra_follows"] == "largest" and each["extra_follows"] == "sum"
    assert cost.optimizer_profile(torch.optim.SGD, {})["state_per_byte"] == 0


def test_harmony_steps_with_the_fused_kernel_unless_the_caller_chose():
    """AdamW/SGD get fused=True on the CPU (torch has the kernel); a caller's fused or foreach stays;
    an optimizer without a fused kernel keeps its arguments; the report and every built optimizer agree."""
    assert optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3}) == {"lr": 1e-3, "fused": True}
    assert optimizer_kwargs(torch.optim.SGD, {"lr": 0.1}) == {"lr": 0.1, "fused": True}
    assert optimizer_kwargs(torch.optim.AdamW, {"fused": False}) == {"fused": False}
    assert optimizer_kwargs(torch.optim.AdamW, {"foreach": True}) == {"foreach": True}
    assert optimizer_kwargs(torch.optim.RMSprop, {"lr": 0.1}) == {"lr": 0.1}        # no fused kernel in torch
    assert optimizer_kwargs(torch.optim.AdamW, None, ("cpu", "meta")) == {}          # none for the meta device
    cfg = GPTConfig(layers=2, width=32, vocab=64, seq=16, tie=False)
    batch = next(iter(copy_task(cfg, 4, 1)))
    for given, fused in (({"lr": 1e-3}, True), ({"lr": 1e-3, "fused": False}, False)):
        sm = harmony.compile(GPT(cfg), batch, optimizer_kwargs=given, memory_budget="1MiB", microbatches=2)
        assert sm.optimizer_kwargs.get("fused", False) is fused
        assert all(bool(o.defaults.get("fused")) is fused for o in sm.optimizers)
        assert ("optimizer AdamW (fused)" in sm.report()) is fused
        sm(*batch)
        sm.close()


@pytest.mark.parametrize("case", ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert"])
def test_nodes_like_one_measured_before_get_its_figures_exactly(monkeypatch, case):
    """A node whose op and inputs match one measured before (the blocks of a transformer) runs without being
    measured and takes that one's figures: every node's costs equal those of measuring every node, and
    fewer nodes are measured where a model repeats itself."""
    from models import CASES
    model, data = CASES[case](tie=True) if case in ("gpt", "hf-gpt2") else CASES[case]()
    batch = data[0]
    example = batch if isinstance(batch, dict) else tuple(batch)
    values = tuple(batch.values()) if isinstance(batch, dict) else tuple(batch)
    counts = {False: 0, True: 0}
    real = cost._Measure._measure

    def counting(self, n, **kw):
        counts[reuse] += 1
        return real(self, n, **kw)
    monkeypatch.setattr(cost._Measure, "_measure", counting)
    measured.forget()       # none kept from earlier compiles of the process
    costs = {}
    for reuse in (False, True):
        gm = trace(model, example)
        cost.annotate(gm, values, microbatch=2, reuse=reuse)
        costs[reuse] = [(n.name, n.meta.get(COST)) for n in gm.graph.nodes]
    assert costs[True] == costs[False]
    assert 0 < counts[True] < counts[False], counts


@pytest.mark.parametrize("case", ["gpt", "hf-gpt2"])
def test_packs_like_one_measured_before_get_its_figures_exactly(monkeypatch, case):
    """The partition measures many packs, most of them the same layers at another depth: one like a pack
    measured before (``pack_signature``) takes its figures, which equal measuring it afresh."""
    from models import CASES, training_state_bytes
    model, data = CASES[case](tie=True)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.4), microbatches=4)
    program, reused = sm.program, []
    real = pack_cost._measure_pack

    def counted(*a, **kw):
        reused.append(reuse)
        return real(*a, **kw)
    monkeypatch.setattr(pack_cost, "_measure_pack", counted)
    measured.forget()       # none kept from the compile above
    by_name = {n.name: n for n in program.gm.graph.nodes}
    for spec in sm.plan.packs:
        inputs = [by_name[n] for n in spec.inputs]
        args = ([program.fake.vals[a] for a in inputs], [a.op != "placeholder" for a in inputs], program.fake)
        for keep in (False, True):
            last = "loss" in spec.outputs
            figures = {}
            for reuse in (True, False):
                figures[reuse] = pack_cost.measure_pack(spec.module, *args, loss_output=last, keep=keep, reuse=reuse)
            assert figures[True] == figures[False]
    assert 0 < reused.count(True) < 2 * len(sm.plan.packs) == reused.count(False)
    sm.close()


def test_a_second_compile_of_the_same_layers_measures_nothing_and_plans_the_same(monkeypatch):
    """Measurements are kept for the process (compiler/measured.py): compiling the same model again (another rank,
    budget or batch shape) measures no node and no pack, runs the graph at one microbatch size only, and plans
    exactly as the first compile did; another compute dtype is measured afresh (its signature differs)."""
    from models import CASES, training_state_bytes
    counts = {"node": 0, "pack": 0, "run": 0}
    node, pack, run = cost._Measure._measure, pack_cost._measure_pack, cost._measure_at

    def count(kind, real):
        def counted(*a, **kw):
            counts[kind] += 1
            return real(*a, **kw)
        return counted
    monkeypatch.setattr(cost._Measure, "_measure", count("node", node))
    monkeypatch.setattr(pack_cost, "_measure_pack", count("pack", pack))
    monkeypatch.setattr(cost, "_measure_at", count("run", run))
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.4)

    def compiled(**kw):
        counts.update(node=0, pack=0, run=0)
        sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=4, **kw)
        out = (dict(counts), sm.graph.python_code("self").src,
               [(n.name, n.meta.get(COST)) for n in sm.program.gm.graph.nodes],
               [(p.inputs, p.outputs, p.fwd_peak, p.bwd_recompute_peak, p.saved_bytes) for p in sm.plan.packs])
        sm.close()
        return out
    measured.forget()
    first, again = compiled(), compiled()
    assert first[0]["node"] > 0 and first[0]["pack"] > 0, first[0]
    assert first[0]["run"] == 2, first[0]    # the graph on fake tensors at two microbatch sizes
    assert again[0] == {"node": 0, "pack": 0, "run": 1}   # the second size's records are the graph's (GRAPHS)
    assert again[1:] == first[1:]
    assert compiled(precision="bf16")[0]["node"] > 0


def test_graph_signatures_tell_wiring_apart_where_node_signatures_do_not():
    """Two graphs whose nodes look alike one by one but are wired differently (``a - b`` against ``b - a``)
    must not share the second size's records; the same model traced twice must."""
    from harmony.compiler.signature import graph_signature

    class Sub(torch.nn.Module):
        def __init__(self, swap):
            super().__init__()
            self.swap = swap

        def forward(self, x, y):
            a, b = torch.relu(x), torch.relu(y)
            return ((b - a) if self.swap else (a - b)).sum()

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    keys = []
    for swap in (False, True, False):
        gm = torch.fx.symbolic_trace(Sub(swap))
        _, _, signatures = cost._measure_at(gm, (x, y), 2, reuse={})
        keys.append((graph_signature(gm, signatures, 4), [signatures[n] for n in gm.graph.nodes if n in signatures]))
    assert keys[0][1] == keys[1][1]             # node by node they look the same
    assert keys[0][0] != keys[1][0] and keys[0][0] == keys[2][0]
