"""What a compiled program is and what every pass did, as text, markdown or JSON.

>>> print(render(sm))                       # or sm.report(); "markdown" and "json" alike
Harmony report: GPT, 120,576 parameters
training state  1.84 MiB (params 471.00 KiB, grads 471.00 KiB, optimizer 942.23 KiB)
budget          1.84 MiB per device (100% of the training state), policy harmony,
                4 microbatches of 2 (batch 8), optimizer AdamW
precision       fp32: device copies in the model's dtype (471.00 KiB), masters 471.00 KiB on the host
between steps   device 1.84 MiB resident, host 471.00 KiB, disk 0 B
compile         1.30 s (trace 816 ms, cost 267 ms, passes 217 ms)
...
== last step ==
peak       1.55 MiB measured vs 1.58 MiB predicted (ratio 0.98), budget 1.84 MiB (84% used)
moved h2d  434.50 KiB measured vs 1.34 MiB predicted (ratio 0.32)

All three formats are views of one plain dict (``summary(sm)``), so the JSON holds
exactly what the text shows, unformatted.
"""
from __future__ import annotations

import json
import textwrap

from harmony.base.errors import ConfigError
from harmony.base.process import huge_pages_note, idle_priority_note, idle_threads_note
from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes, nbytes
from harmony.compiler.trace import TRACE_INFO
from harmony.compiler.verify import state_sizes
from harmony.runtime.ops import carried_names, ops_of, state_names
from harmony.runtime.plan import STATE_KINDS
from harmony.runtime.precision import device_bytes
from harmony.viz.formats import fmt_seconds, fmt_value, is_number, plain, wrap

FORMATS = ("text", "markdown", "json")

# The report's words that are Harmony's own, explained once at its end (only those it used).
TERMS = {
    "units": "how many of the partition's layers (the graph cut at its narrowest gaps) a pack holds",
    "need_MiB": "the device memory a pack's forward and backward need at the microbatch size",
    "objective_s": "what the partition's dynamic program minimised: the sum of each pack's cost-model seconds "
                   "(compute or copies, whichever is longer), before overlap between packs",
    "predicted_step_s": "the cost model's whole step for the chosen packs, overlap and host steps included",
    "usable_budget_MiB": "the bytes the planner may fill: the budget less the device libraries' share and a "
                         "headroom for prediction error",
    "grads_out_MiB": "gradients a pack sends to the host for its optimizer step, per step",
    "in_memory_MiB": "files of the disk tier the host budget has room to keep in memory",
    "saves_per_byte": "what keeping an item on the device saves, per byte it holds: bytes of copy traffic "
                      "(a recompute saved is priced as the bytes the host link moves in that time); the swap "
                      "pass keeps the highest first",
    "params between visits": "weights held on the device from a pack's forward to its backward within a step "
                             "instead of being copied in twice; (4/8): 4 of the pack's 8 weights (parameters "
                             "and buffers)",
    "params across steps": "weights left on the device from their step to the next step's forward",
    "forward outputs": "a pack's output kept on the device for the next pack instead of stashed to the host",
    "input grads": "the gradient a pack's backward hands to the pack before it, kept on the device",
    "activations (no recompute)": "a pack's saved activations kept, so its backward does not rerun its forward",
    "recompute": "the backward reruns the pack's forward from its stashed input (activation checkpointing)",
    "h2d": "host to device copies",
    "d2h": "device to host copies",
}


def render(sm, fmt: str = "text") -> str:
    """``sm``'s report in ``fmt`` ("text", "markdown" or "json")."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown report format {fmt!r}; choose one of {', '.join(FORMATS)}")
    data = summary(sm)
    if fmt == "json":
        return json.dumps(plain(data), indent=2)
    return _Writer(markdown=fmt == "markdown").document(data)


# -- the content -------------------------------------------------------------------------------
def summary(sm) -> dict:
    """Everything the report shows, as plain data: model, compile times, passes, packs, last step."""
    program = sm.program
    cfg = program.config
    return dict(
        model=_model(program),
        config=dict(memory_budget=cfg.memory_budget, plan_margin=cfg.plan_margin, policy=cfg.policy,
                    margin_learned=getattr(cfg, "margin_learned", False), microbatches=cfg.microbatches,
                    microbatch_size=cfg.microbatch_size, batch_size=cfg.batch_size,
                    optimizer=getattr(cfg.optimizer, "__name__", str(cfg.optimizer)) + _implementation(cfg),
                    precision=getattr(cfg, "precision", "fp32")),
        tiers=tiers_of(program),
        compile_seconds=dict(getattr(sm, "compile_seconds", {}) or {}),
        filled=getattr(sm, "filled", None),
        passes=[dict(title=r.title, seconds=r.seconds, rows=list(r.rows), totals=dict(r.totals),
                     notes=list(r.notes)) for r in program.reports],
        packs=_packs(program),
        tied=_tied(program),
        last_step=dict(sm.stats) if getattr(sm, "stats", None) else None,
        evaluation=_evaluation(sm),
        shapes=sm.shapes.summary() if getattr(sm, "shapes", None) is not None else [],
        shapes_served=len(sm.shapes.served) if getattr(sm, "shapes", None) is not None else 0,
        constants=dict(getattr(program, "constants", {}) or {}),
        trace_notes=list(getattr(program.gm.meta.get(TRACE_INFO), "notes", ()) if program.gm is not None else ()),
        node=_node(getattr(sm, "node_simulation", None)),
    )


def _node(node) -> dict | None:
    """A simulated node (a pipeline rank's ``sm.simulate()``, a balanced rank's node): a row per device, and a line
    per host whose devices shared its cores."""
    if node is None:
        return None
    return dict(title=f"simulated node: {len(node.devices)} devices, step {fmt_seconds(node.step_seconds)}",
                rows=node.rows(), notes=list(getattr(node, "sharing", [])))


def _evaluation(sm) -> dict | None:
    """The evaluation schedule, once the first ``sm.evaluate(...)`` built it (driver/evaluate.py), and the last
    evaluation's figures."""
    ev = getattr(sm, "_evaluation", None)
    if ev is None:
        return None
    r = ev.report
    return dict(title=r.title, seconds=ev.seconds, rows=list(r.rows), totals=dict(r.totals), notes=list(r.notes),
                last=dict(getattr(sm, "eval_stats", {}) or {}))


def _implementation(cfg) -> str:
    """Which of torch's implementations steps: " (fused)", " (foreach)", or "" for torch's default."""
    kw = getattr(cfg, "optimizer_kwargs", {}) or {}
    return " (fused)" if kw.get("fused") else " (foreach)" if kw.get("foreach") else ""


def _model(program) -> dict:
    gm = program.gm
    params = list(gm.parameters())          # unique: a tied weight counts once
    param_bytes = sum(nbytes(p) for p in params)
    grad_bytes = sum(nbytes(p) for p in params if p.requires_grad)
    buffer_bytes = sum(nbytes(b) for b in gm.buffers())
    optim_bytes = sum(s.optim_bytes for s in program.plan.packs) if program.plan else 0
    return dict(name=type(program.model).__name__, params=sum(p.numel() for p in params),
                param_bytes=param_bytes, grad_bytes=grad_bytes, optim_bytes=optim_bytes,
                buffer_bytes=buffer_bytes,
                state_bytes=param_bytes + grad_bytes + optim_bytes + buffer_bytes)


def tiers_of(program) -> dict:
    """Bytes of training state per tier between steps, and the device copies' dtype and bytes.

    The host always holds the master of every trainable parameter and buffer (fp32, or the model's own
    dtype) and the frozen parameters (in the compute dtype: they have no master); the device holds what the
    plan keeps resident, and within a step the compute copies (in the compute dtype under mixed precision) of
    the packs it swaps in.
    """
    plan = program.plan
    if plan is None:
        return {}
    gm, cfg = program.gm, program.config
    dtype = cfg.compute_dtype
    state = list(gm.parameters()) + list(gm.buffers())
    frozen = {n: p for n, p in gm.named_parameters() if not p.requires_grad}   # no gradient, optimizer state, master
    masters = sum(nbytes(t) for t in state) - sum(nbytes(p) for p in frozen.values())
    sizes = state_sizes(program)
    resident = {(kind, n) for pack, kind in plan.kept() for n in state_names(plan.packs[pack], kind)}
    optim = dict.fromkeys(Tier, 0)    # optimizer state bytes per tier
    on_disk = disk_masters = 0    # fp32 weights (and optimizer state) of wholly-disk packs, less files kept in memory
    for spec in plan.packs:
        record = plan.at(spec.index)
        if record.shares is not None:   # partitioned over ranks: this rank's host holds its chunk of the masters
            masters -= sum(nbytes(t) for n, t in gm.named_parameters() if n in set(spec.owned)) - spec.master_bytes
        if record.master_on == Tier.DISK:
            mine = set(spec.owned)
            owned = sum(nbytes(t) for n, t in gm.named_parameters() if n in mine)
            if record.shares is not None:     # this rank's file holds its chunk and that chunk's optimizer state
                owned = spec.master_bytes     # (the chunk the host figure above counted)
            masters -= owned
            disk_masters += owned
            on_disk += (owned + spec.optim_bytes) * (1 - record.in_memory_share)
            optim[Tier.HOST] += (owned + spec.optim_bytes) * record.in_memory_share
            continue
        kept = spec.stepped and all(("optim", n) in resident for n in spec.stepped)
        # (a device step streams its state in and out: between steps it is on the host)
        where = Tier.DEVICE if kept else Tier.DISK if record.optim_on == Tier.DISK else Tier.HOST
        optim[where] += spec.optim_bytes
    # weights the last step left on the device for the next forward (``Residency.carried``): a copy, also on disk
    carried = sum(sizes.get(("params", n), 0)
                  for p, record in plan.residency.items() if record.carried for n in carried_names(plan, p))
    frozen_bytes = sum(nbytes(p) for p in frozen.values())
    return dict(precision=getattr(cfg, "precision", "fp32"),
                compute_dtype=str(dtype).replace("torch.", "") if dtype else "the model's dtype",
                device_copy_bytes=sum(device_bytes(t, dtype) for t in state), master_bytes=masters,
                disk_master_bytes=disk_masters,
                device_bytes=sum(sizes.get(k, 0) for k in resident if k[0] != "optim") + optim[Tier.DEVICE],
                carried_bytes=carried, host_bytes=masters + frozen_bytes + int(optim[Tier.HOST]),
                frozen_bytes=frozen_bytes, frozen_dtypes=sorted({str(p.dtype)[6:] for p in frozen.values()}),
                frozen_resident_bytes=sum(sizes.get(k, 0) for k in resident if k[0] == "params" and k[1] in frozen),
                disk_bytes=optim[Tier.DISK] + int(on_disk))


def _tied(program) -> list[dict]:
    """Each weight the model shares between modules (a tied embedding and head): its names and the packs reading it.

    DESIGN's one exception to bitwise numerics: two packs' gradient contributions to one weight are
    added in another order than eager's single backward adds them, so the weight is allclose to eager.
    """
    names: dict[int, list[str]] = {}
    for n, p in program.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    canonical = {n: p for n, p in program.gm.named_parameters()}
    out = []
    for group in (g for g in names.values() if len(g) > 1):
        name = next((n for n in group if n in canonical), group[0])
        packs = [s.index for s in (program.plan.packs if program.plan else ()) if name in s.params]
        out.append(dict(names=group, packs=packs))
    return out


def _packs(program) -> list[dict]:
    if program.plan is None:
        return []
    resident: dict[int, list[str]] = {}
    for s in program.plan.packs:
        record = program.plan.at(s.index)
        resident[s.index] = [k for k in STATE_KINDS if record.has(k)]
        if record.held:
            resident[s.index].append("params (within a step)")
        kept, parts, stepping = record.optim_kept, record.params_held, record.device_parts
        held = sum(1 for n in s.stepped if n in stepping)
        if held:
            resident.setdefault(s.index, []).append(f"all state ({held}/{len(s.stepped)} params, device step)")
        weights = s.params + s.buffers
        held = sum(1 for n in weights if n in parts)
        if held:
            resident.setdefault(s.index, []).append(f"params ({held}/{len(weights)} within a step)")
        held = sum(1 for n in s.stepped if n in kept)
        if held:
            resident.setdefault(s.index, []).append(f"optim ({held}/{len(s.stepped)} params)")
    numel = {n: p.numel() for n, p in program.gm.named_parameters()}
    # packs whose backward recomputes the forward (the swap pass keeps the others' graphs)
    recomputes = {n.args[0] for n, op in ops_of(program.schedule.nodes if program.schedule is not None else ())
                  if op.runs_backward and n.kwargs.get("saved") is None}
    return [dict(pack=s.index, name=s.name, params=sum(numel.get(n, 0) for n in s.params),
                 param_bytes=s.param_bytes, saved_bytes=s.saved_bytes,
                 fwd_GFLOP=s.fwd_flops / 1e9, bwd_GFLOP=s.bwd_flops / 1e9, recompute=s.index in recomputes,
                 resident="+".join(resident.get(s.index, [])) or "-")
            for s in program.plan.packs]


# -- writing -----------------------------------------------------------------------------------
class _Writer:
    """Turns ``summary()`` into aligned text tables or markdown tables."""

    def __init__(self, markdown: bool):
        self.md = markdown
        self.lines: list[str] = []

    def document(self, d: dict) -> str:
        self.header(d)
        for p in d["passes"]:
            self.heading(f"{p['title']}  ({fmt_seconds(p['seconds'])})")
            self.table(p["rows"])
            if p["totals"]:
                self.pairs([(k, fmt_value(k, v)) for k, v in p["totals"].items()], inline=True)
            self.notes(p["notes"])
            if not (p["rows"] or p["totals"] or p["notes"]):
                self.lines.append("(nothing reported)")
        self.heading("packs")
        self.table(d["packs"])
        if len(d["shapes"]) > 1 or d.get("shapes_served"):     # batches of other shapes (driver/shapes.py)
            self.heading("batch shapes")
            self.table(d["shapes"])
            self.notes(["every batch up to the example's shapes runs the compiled plan (sm.code), others their own"])
        if d.get("node"):
            self.heading(d["node"]["title"])
            self.table(d["node"]["rows"])
            self.notes(d["node"].get("notes", []))
        self.heading("last step")
        self.last_step(d["last_step"], d["config"]["memory_budget"])
        if d.get("evaluation"):
            self.evaluation(d["evaluation"])
        self.terms()
        return "\n".join(self.lines).rstrip() + "\n"

    def terms(self):
        """One paragraph explaining the report's own words that appear above (TERMS)."""
        text = "\n".join(self.lines)
        used = [f"{k}: {v}" for k, v in TERMS.items() if k in text]
        if used:
            self.heading("terms")
            self.lines.append("; ".join(used) + "." if self.md else textwrap.fill("; ".join(used) + ".", 100))

    def header(self, d):
        m, c, t = d["model"], d["config"], d["compile_seconds"]
        title = f"Harmony report: {m['name']}, {m['params']:,} parameters"
        self.lines.append(f"# {title}" if self.md else title)
        if self.md:
            self.lines.append("")
        state = (f"{fmt_bytes(m['state_bytes'])} (params {fmt_bytes(m['param_bytes'])}, "
                 f"grads {fmt_bytes(m['grad_bytes'])}, optimizer {fmt_bytes(m['optim_bytes'])}"
                 + (f", buffers {fmt_bytes(m['buffer_bytes'])}" if m["buffer_bytes"] else "") + ")")
        budget = (f"{fmt_bytes(c['memory_budget'])} per device "
                  f"({c['memory_budget'] / max(m['state_bytes'], 1):.0%} of the training state), "
                  f"policy {c['policy']}, {c['microbatches']} microbatches of {c['microbatch_size']} "
                  f"(batch {c['batch_size']}), optimizer {c['optimizer']}")
        parts = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in t.items() if k != "total")
        compile_ = f"{fmt_seconds(t['total'])} ({parts})" if "total" in t else (parts or "-")
        items = [("training state", state), ("budget", budget)]
        margin = c.get("plan_margin")
        if margin:     # left unplanned for what the cost model under-predicts (driver/misses.py)
            how = "learned from an earlier plan miss of this model" if c.get("margin_learned") else "set"
            items.append(("plan margin", f"{fmt_bytes(margin)} of the budget left unplanned ({how})"))
        tiers = d.get("tiers")
        if tiers:
            copies = (f"{tiers['precision']}: device copies in {tiers['compute_dtype']} "
                      f"({fmt_bytes(tiers['device_copy_bytes'])}), "
                      f"masters {fmt_bytes(tiers['master_bytes'])} on the host"
                      + (f", {fmt_bytes(tiers['disk_master_bytes'])} on disk" if tiers.get("disk_master_bytes") else "")
                      + (", optimizer steps fp32 masters on the host" if tiers["precision"] != "fp32" else ""))
            rest = (f"device {fmt_bytes(tiers['device_bytes'])} resident"
                    + (f" + {fmt_bytes(tiers['carried_bytes'])} of weights carried to the next forward"
                       if tiers.get("carried_bytes") else "")
                    + f", host {fmt_bytes(tiers['host_bytes'])}, disk {fmt_bytes(tiers['disk_bytes'])}")
            items += [("precision", copies), ("between steps", rest)]
            if tiers["frozen_bytes"]:     # requires_grad=False (LoRA's base): read, never stepped or written back
                resident = tiers["frozen_resident_bytes"]
                items.append(("frozen", f"{fmt_bytes(tiers['frozen_bytes'])} of weights in "
                                        f"{', '.join(tiers['frozen_dtypes'])} on the host"
                                        + (f" ({fmt_bytes(resident)} also resident on the device)" if resident else "")
                                        + ": no gradient, optimizer state or master; never written back"))
        for t in d.get("tied", ()):
            same = " = ".join(t["names"])
            if len(t["packs"]) > 1:
                packs = " and ".join(", ".join(map(str, t["packs"])).rsplit(", ", 1))
                items.append(("tied weights", f"{same} (read by packs {packs}): the packs' gradient contributions "
                                              f"are added in another order than in eager's backward so this weight "
                                              f"trains allclose to eager PyTorch and not bitwise as the others do"))
            else:
                items.append(("tied weights", f"{same} (one pack reads it)"))
        for note in d.get("trace_notes", ()):     # what tracing saw: the front end used, a forward's side effects
            items.append(("trace", note))
        if d.get("constants"):     # the batch's non-tensor items, fixed in the trace (driver/constants.py)
            items.append(("batch constants", ", ".join(f"{k}={v!r}" for k, v in d["constants"].items())))
        if d.get("filled"):
            items.append(("weights", f"{fmt_bytes(d['filled']['bytes'])} made by compile as it placed them, a disk "
                                     f"group at a time (the model was built under harmony.empty_weights)"))
        self.pairs(items + [("compile", compile_)])

    def heading(self, title: str):
        self.lines += ["", f"## {title}", ""] if self.md else ["", f"== {title} =="]

    def notes(self, notes: list[str]):
        if self.md and notes:
            self.lines.append("")
        for note in notes:
            self.lines.append(f"- *{note}*" if self.md else wrap(f"note: {note}"))

    def pairs(self, items, inline: bool = False):
        if not items:
            return
        if self.md:
            if inline:
                self.lines += [""] if self.lines[-1] else []
                self.lines += ["**totals:** " + ", ".join(f"{k} **{v}**" for k, v in items)]
            else:
                self.lines += [f"- **{k}**: {v}" for k, v in items]
            return
        if inline:
            self.lines.append(wrap("totals: " + ", ".join(f"{k} {v}" for k, v in items)))
            return
        width = max(len(k) for k, _ in items)
        self.lines += [wrap(f"{k:<{width}}  {v}", indent=width + 2) for k, v in items]

    def table(self, rows: list[dict]):
        if not rows:
            return
        cols = list(dict.fromkeys(k for r in rows for k in r))
        cells = [[fmt_value(c, r.get(c)) for c in cols] for r in rows]
        numeric = [all(is_number(r.get(c)) or r.get(c) is None for r in rows) for c in cols]
        if self.md:
            self.lines.append("| " + " | ".join(cols) + " |")
            self.lines.append("|" + "|".join("---:" if n else "---" for n in numeric) + "|")
            self.lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells]
            return
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

        def line(values):
            return "  ".join(v.rjust(w) if n else v.ljust(w)
                             for v, w, n in zip(values, widths, numeric)).rstrip()

        self.lines.append(line(cols))
        self.lines.append("  ".join("-" * w for w in widths))
        self.lines += [line(row) for row in cells]

    def evaluation(self, ev: dict):
        self.heading(f"{ev['title']}  (built in {fmt_seconds(ev['seconds'])} by the first sm.evaluate)")
        self.table(ev["rows"])
        self.pairs([(k, fmt_value(k, v)) for k, v in ev["totals"].items()], inline=True)
        self.notes(ev["notes"])
        s = ev["last"]
        if s:
            self.pairs([("last evaluation", f"{fmt_seconds(s['eval_seconds'])}, peak {fmt_bytes(s['measured_peak'])} "
                                            f"measured vs {fmt_bytes(s['predicted_peak'])} predicted, h2d "
                                            f"{fmt_bytes(s['h2d_bytes'])} ({s['evaluations']} so far)")])

    def last_step(self, s: dict | None, budget: int):
        if not s:
            self.lines.append("no step run yet: call sm(*batch) once to measure memory and traffic")
            return
        items = []
        if "measured_peak" in s:
            meas, pred, bud = s["measured_peak"], s.get("predicted_peak"), s.get("budget") or budget
            line = f"{fmt_bytes(meas)} measured"
            if pred:
                line += f" vs {fmt_bytes(pred)} predicted (ratio {meas / pred:.2f})"
            if bud:
                line += f", budget {fmt_bytes(bud)} ({meas / bud:.0%} used)"
            items.append(("peak", line))
        if "cuda_allocated_peak" in s:   # the CUDA allocator's own counts: what the meter sees plus the libraries'
            bud = s.get("budget") or budget
            reserved = s.get("device_reserved", 0)
            items.append(("CUDA allocator", f"{fmt_bytes(s['cuda_allocated_peak'])} allocated at peak, "
                                            f"{fmt_bytes(s['cuda_reserved_peak'])} reserved, against a budget of "
                                            f"{fmt_bytes(bud + reserved)} ({fmt_bytes(reserved)} of it for the CUDA "
                                            f"libraries' workspaces)"))
        for way in ("h2d", "d2h"):
            if f"{way}_bytes" in s:
                meas, pred = s[f"{way}_bytes"], s.get(f"predicted_{way}")
                line = f"{fmt_bytes(meas)} measured"
                if pred is not None:
                    line += f" vs {fmt_bytes(pred)} predicted"
                    if pred:
                        line += f" (ratio {meas / pred:.2f})"
                items.append((f"moved {way}", line))
        if s.get("plan_misses"):      # allocations over the budget the safety net absorbed (runtime/safety.py)
            ops = ", ".join(f"{op} +{fmt_bytes(over)}" for op, over in s["plan_miss_ops"][:4])
            items.append(("plan misses", f"{s['plan_misses']} allocations went over the budget (at {ops}); the "
                                         f"runtime moved {fmt_bytes(s['plan_miss_released_bytes'])} off the device "
                                         f"to make room, and the next compile of this model plans around them"))
        elif "plan_misses" in s:
            items.append(("plan misses", "none: the plan held"))
        if "step_seconds" in s:
            items.append(("step time", fmt_seconds(s["step_seconds"])))
        if "peak_rss_bytes" in s:
            items.append(("process RSS", f"{fmt_bytes(s['peak_rss_bytes'])} peak resident memory of this process "
                                         f"(getrusage; host and the CPU's logical device together)"))
        if "huge_pages" in s:
            items.append(("huge pages", huge_pages_note(s["huge_pages"])))
        if "idle_threads_sleep" in s:
            items.append(("OpenMP waits", idle_threads_note(s["idle_threads_sleep"])))
        if "background_idle_priority" in s:
            items.append(("host thread", idle_priority_note(s["background_idle_priority"])))
        known = {"measured_peak", "predicted_peak", "budget", "h2d_bytes", "d2h_bytes", "predicted_h2d",
                 "predicted_d2h", "step_seconds", "peak_rss_bytes", "huge_pages", "idle_threads_sleep",
                 "background_idle_priority", "cuda_allocated_peak", "cuda_reserved_peak", "device_reserved",
                 "plan_misses", "plan_miss_over_bytes", "plan_miss_released_bytes", "plan_miss_ops"}
        items += [(k, fmt_value(k, v)) for k, v in s.items() if k not in known]
        self.pairs(items)
