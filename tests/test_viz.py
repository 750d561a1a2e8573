"""viz/: reports in three formats, DOT drawings of the model and the schedule, the Chrome timeline, draw()."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

import harmony
from harmony.errors import ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime import ops
from harmony.viz import dot, draw, report, timeline


@pytest.fixture(scope="module")
def compiled():
    """A 2-layer GPT under a budget that forces more than one pack, and its report before any step."""
    torch.manual_seed(0)
    c = GPTConfig(layers=2, width=64)
    model = GPT(c)
    x, y = next(copy_task(c, 8, 1))
    state = sum(p.numel() for p in model.parameters()) * 16
    sm = harmony.compile(model, (x, y), memory_budget=int(state * 1.0), microbatches=4)
    before = sm.report()
    sm(x, y)
    yield sm, before
    sm.close()


def _node_ids(source: str) -> set[str]:
    return set(re.findall(r"^\s*(\w+) \[", source, flags=re.M))


def _no_dot(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)


# -- report --------------------------------------------------------------------------------------
def test_report_text_has_every_pass_and_the_last_step(compiled):
    sm, before = compiled
    text = report.render(sm, "text")
    assert text == sm.report()
    for r in sm.program.reports:
        assert r.title in text
    assert "no step run yet" in before and "no step run yet" not in text
    peak = next(line for line in text.splitlines() if line.startswith("peak"))
    assert "measured" in peak and "predicted" in peak and "budget" in peak
    assert f"{sm.stats['measured_peak'] / sm.stats['predicted_peak']:.2f}" in peak
    assert re.search(r"^moved h2d .* measured vs .* predicted", text, flags=re.M)
    assert re.search(r"^moved d2h .* measured vs .* predicted", text, flags=re.M)
    assert "step time" in text
    for spec in sm.program.plan.packs:    # the per-pack table
        assert spec.name in text


def test_report_names_the_tied_weight_and_says_it_is_allclose(compiled):
    sm, _ = compiled                       # GPT ties its embedding and head
    text = sm.report()
    line = text[text.index("tied weights"):text.index("compile ")]
    assert "tok.weight = head.weight" in line and "allclose" in line and "not bitwise" in line
    packs = [s.index for s in sm.program.plan.packs if "tok.weight" in s.params]
    assert len(packs) > 1 and f"packs {packs[0]} and {packs[-1]}" in line
    assert json.loads(sm.report("json"))["tied"] == [dict(names=["tok.weight", "head.weight"], packs=packs)]


def test_untied_models_report_no_tied_weight():
    torch.manual_seed(0)
    c = GPTConfig(layers=1, width=32, vocab=32, seq=8, tie=False)
    model = GPT(c)
    sm = harmony.compile(model, next(copy_task(c, 4, 1)), memory_budget="64MiB")
    assert "tied weights" not in sm.report() and report.summary(sm)["tied"] == []
    sm.close()


def test_the_report_ends_with_a_legend_of_the_terms_it_used(compiled):
    sm, _ = compiled
    text = sm.report()
    body, legend = text.split("== terms ==")
    assert "\n\n" not in legend.strip()                            # one paragraph, at the end
    legend = " ".join(legend.split())
    assert "saves_per_byte: what keeping an item on the device saves" in legend
    assert "objective_s: what the partition's dynamic program minimised" in legend
    for term, meaning in report.TERMS.items():                     # only the terms the report used
        assert (f"{term}: {meaning}" in legend) == (term in body), term
    assert "## terms" in sm.report("markdown")


def test_report_markdown_is_tables(compiled):
    sm, _ = compiled
    md = sm.report("markdown")
    assert md.startswith("# Harmony report")
    assert re.search(r"^\| pack \| name \|", md, flags=re.M)
    assert re.search(r"^\|(---:?\|)+$", md, flags=re.M)
    for r in sm.program.reports:
        assert f"## {r.title}" in md


def test_report_json_round_trips(compiled):
    sm, _ = compiled
    data = json.loads(sm.report("json"))
    assert [p["title"] for p in data["passes"]] == [r.title for r in sm.program.reports]
    for p, r in zip(data["passes"], sm.program.reports):
        assert len(p["rows"]) == len(r.rows) and set(p["totals"]) == set(r.totals)
    assert len(data["packs"]) == len(sm.program.plan.packs)
    assert data["last_step"]["measured_peak"] == sm.stats["measured_peak"]
    assert data["model"]["params"] == sum(p.numel() for p in sm.program.gm.parameters())


def test_report_unknown_format(compiled):
    with pytest.raises(ConfigError, match="text, markdown, json"):
        report.render(compiled[0], "html")


def test_value_formats():
    assert report.fmt_value("param_bytes", 3 * 2**20) == "3.00 MiB"
    assert report.fmt_value("solve_s", 0.0123) == "12.3 ms"
    assert report.fmt_value("GFLOP", 0.025165824) == "0.0252"
    assert report.fmt_value("params", 120576) == "120,576"
    assert report.fmt_value("recompute", True) == "yes"


# -- DOT ---------------------------------------------------------------------------------------
def test_model_dot_clusters_packs_and_draws_every_compute_node(compiled):
    sm, _ = compiled
    src = dot.model_dot(sm)
    packs = sm.program.plan.packs
    assert len(packs) >= 2
    assert len(re.findall(r"subgraph cluster_pack\d+", src)) == len(packs)
    for spec in packs:
        assert f"pack {spec.index}: {spec.name}" in src
    ids = _node_ids(src)
    for node in sm.program.gm.graph.nodes:
        assert f"n_{node.name}" in ids
    colours = {dot.pack_colour(s.index) for s in packs}
    assert all(c in src for c in colours)


def test_schedule_dot_draws_every_op(compiled):
    sm, _ = compiled
    src = dot.schedule_dot(sm)
    ids = _node_ids(src)
    calls = [n for n in sm.program.schedule.nodes if n.op == "call_function"]
    assert {f"s_{n.name}" for n in calls} <= ids
    for n in calls:
        for inp in n.all_input_nodes:
            assert f"s_{inp.name} -> s_{n.name}" in src
    assert dot.op_colour("forward") in src and dot.op_colour("backward") in src


def _synthetic_schedule(microbatches: int, packs: int) -> SimpleNamespace:
    g = torch.fx.Graph()
    for p in range(packs):
        h = g.call_function(ops.swap_in, (p, "params"))
        g.call_function(ops.wait, (h,))
        for mb in range(microbatches):
            b = g.call_function(ops.load_batch, (mb, ("idx",)))
            a = g.call_function(ops.forward, (p, mb, b), {"keep": False})
            s = g.call_function(ops.stash, (a,))
            g.call_function(ops.unstash, (s,))
        g.call_function(ops.release, (p, "params"))
        g.call_function(ops.step, (p,))
    g.output(None)
    return SimpleNamespace(program=SimpleNamespace(schedule=g, config=SimpleNamespace(policy="harmony")))


def test_big_schedule_is_valid_dot():
    sm = _synthetic_schedule(microbatches=25, packs=5)    # 5 * (4 + 4 * 25) = 520 ops
    calls = [n for n in sm.program.schedule.nodes if n.op == "call_function"]
    assert len(calls) > dot.BIG_SCHEDULE
    src = dot.schedule_dot(sm)
    assert {f"s_{n.name}" for n in calls} <= _node_ids(src)
    assert src.count("{") == src.count("}")
    if shutil.which("dot"):              # -Tcanon parses without laying out: a syntax check that is fast
        subprocess.run(["dot", "-Tcanon"], input=src.encode(), check=True, capture_output=True, timeout=20)


# -- rendering and draw() -------------------------------------------------------------------------
def test_render_without_dot_writes_source_and_one_hint(tmp_path, monkeypatch, capsys):
    _no_dot(monkeypatch)
    out = dot.render("digraph g { a -> b }", tmp_path / "g")
    assert out == tmp_path / "g.dot" and out.read_text() == "digraph g { a -> b }"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"graphviz 'dot' not found: wrote {out}; install it (apt-get install graphviz) to get SVG"]


def test_draw_without_dot(compiled, tmp_path, monkeypatch, capsys):
    sm, _ = compiled
    _no_dot(monkeypatch)
    paths = draw(sm, "plan", out_dir=tmp_path, name="gpt")
    assert [p.name for p in paths] == ["gpt_model.dot", "gpt_schedule.dot", "gpt_timeline.json"]
    assert all(p.parent == tmp_path and p.stat().st_size > 0 for p in paths)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "graphviz 'dot' not found" in err[0] and "gpt_schedule.dot" in err[0]


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_draw_with_dot(compiled, tmp_path, capsys):
    sm, _ = compiled
    paths = draw(sm, "model", out_dir=tmp_path) + draw(sm, "schedule", out_dir=tmp_path)
    assert [p.suffix for p in paths] == [".svg", ".svg"]
    assert all(p.read_text().lstrip().startswith("<?xml") or "<svg" in p.read_text()[:500] for p in paths)
    assert capsys.readouterr().err == ""


def test_draw_bad_what_names_choices(compiled, tmp_path):
    with pytest.raises(ConfigError, match="plan, model, schedule, timeline"):
        draw(compiled[0], "pictures", out_dir=tmp_path)


# -- timeline ----------------------------------------------------------------------------------
def test_timeline_of_the_last_step(compiled, tmp_path):
    sm, _ = compiled
    events = sm.runtime.events
    assert events
    [path] = draw(sm, "timeline", out_dir=tmp_path)
    trace = json.loads(path.read_text())["traceEvents"]
    xs = [e for e in trace if e["ph"] == "X"]
    assert [e["name"] for e in xs] == [e.name for e in events]
    assert all(e["dur"] >= 0 for e in xs)
    counters = [e for e in trace if e["ph"] == "C"]
    assert {c["name"] for c in counters} == {"device bytes"}
    assert [c["args"]["live"] for c in counters] == [e.live_bytes for e in events]
    threads = {e["args"]["name"]: e["tid"] for e in trace if e["name"] == "thread_name"}
    assert set(threads) == {e.stream for e in events}
    for x, e in zip(xs, events):
        assert x["tid"] == threads[e.stream]


def test_timeline_accepts_simulated_events(tmp_path):
    events = [dict(name="swap_in", kind="copy", stream="h2d", start=0.0, end=2e-3, live_bytes=10, peak_bytes=10),
              dict(name="forward", kind="compute", stream="compute", start=1e-3, end=4e-3, live_bytes=30,
                   peak_bytes=50)]
    trace = json.loads(timeline.chrome_trace(events, tmp_path / "sim.json").read_text())["traceEvents"]
    xs = [e for e in trace if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in xs] == [("swap_in", 0.0, 2000.0), ("forward", 1000.0, 3000.0)]
    assert xs[0]["tid"] != xs[1]["tid"]


def test_timeline_before_any_step_is_an_error(tmp_path):
    sm = SimpleNamespace(runtime=SimpleNamespace(events=[]), program=SimpleNamespace(model=torch.nn.Linear(1, 1)))
    with pytest.raises(ConfigError, match="call sm"):
        draw(sm, "timeline", out_dir=tmp_path)
