"""The executor: one loop over the schedule graph and the op table, with a trace event per op."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.fx

from harmony.base.tiers import Tier
from harmony.runtime.comm.communicator import existing
from harmony.runtime.ops import op_of, ops_of, resident_state
from harmony.runtime.pipeline import norm_exchange
from harmony.runtime.plan import Plan, mean_loss
from harmony.runtime.precision import GradClip, LossScaler, StepGate, compute_dtype
from harmony.runtime.rng import MicrobatchStreams, rng_state, set_rng_state
from harmony.runtime.safety import SafetyNet
from harmony.runtime.tiers.link import EmulatedLink
from harmony.runtime.tiers.memory import AllocatorMeter, CountAllocations, MemoryMeter
from harmony.runtime.tiers.state import TieredState
from harmony.runtime.transaction import COMMITTED, JOBWIDE, Transaction


@dataclass
class TraceEvent:
    """One op as it ran: the same record the simulator produces, so viz/ draws both alike."""

    name: str
    kind: str          # compute | copy | sync
    stream: str
    start: float       # seconds since the step began
    end: float
    live_bytes: int    # device bytes after the op
    peak_bytes: int    # device bytes at the op's peak


def last_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """node -> values whose last use is that node (so the loop frees them right after it)."""
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            last[inp] = node
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in graph.nodes}
    for value, user in last.items():
        out[user].append(value)
    for node in graph.nodes:   # values nobody reads die at once
        if node not in last:
            out[node].append(node)
    return out


def run_graph(rt, graph: torch.fx.Graph, free_after: dict, txn: Transaction) -> None:
    """The loop: each op of ``graph`` executed on ``rt`` in order, a trace event per op in ``rt.events``, every value
    freed after its last use (``free_after``)."""
    env: dict[torch.fx.Node, object] = {}
    t0 = time.perf_counter()
    status = getattr(rt, "status", None) if txn.what in JOBWIDE else None    # several ranks: the job's step
    net = rt.safety
    if net is not None:       # a plan miss makes room instead of failing (runtime/safety.py)
        net.begin(rt, graph, env)
    try:
        _loop(rt, graph, free_after, txn, env, t0, status, net)
    except BaseException:
        if net is not None:   # the rollback releases the step's holds, then brings back the weights (Runtime.run)
            net.end(restore=False)
        raise
    if net is not None:       # the plan's weights back on the device, as the next step expects them
        net.end()


def _loop(rt, graph, free_after, txn, env, t0, status, net) -> None:
    meter = rt.meter
    emulated = rt.speed_factor != 1.0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if status is not None:       # a meet found a rank's step failed: stop here (runtime/comm/jobwide.py)
            status.check()
        op = op_of(node)
        if net is not None:
            net.before(node)
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        start = time.perf_counter() - t0
        cpu = time.thread_time() if emulated else 0.0      # a system call: only where an op is stretched
        peak, meter.peak = meter.peak, meter.live
        if op.steps and not (getattr(rt, "gate", None) is not None and node.kwargs.get("where") == Tier.HOST):
            txn.stepping(node.args[0])     # a deferred host update counts when the gate runs it
        env[node] = op.execute(rt, *args, **kwargs)
        if emulated and op.kind == "compute" and kwargs.get("where", Tier.DEVICE) != Tier.HOST:
            # EMULATION of a slower device: a compute op on it takes speed_factor x as long, so this
            # thread idles for the rest (a sleep leaves the core to other ranks, as a device of its own
            # would). A step on host copies is the host's work, not the device's: not stretched.
            time.sleep(emulation_pause(rt.speed_factor, time.thread_time() - cpu,
                                       time.perf_counter() - t0 - start))
        rt.events.append(TraceEvent(node.name, op.kind, "compute" if op.kind == "compute" else "copy",
                                    start, time.perf_counter() - t0, meter.live, meter.peak))
        meter.peak = max(peak, meter.peak)
        for dead in free_after[node]:
            env.pop(dead, None)


def emulation_pause(factor: float, cpu: float, wall: float) -> float:
    """Seconds a compute op that took ``wall`` seconds, ``cpu`` of them on its thread's CPU, idles after it so that
    it lasts ``factor`` x its time alone on a core.

    Its time alone is its thread's CPU time where torch computes on the calling thread (one intra-op thread):
    ranks that share this machine's cores wait for one another, and a device of their own would not, so the time
    an op spent waiting for a core is not stretched ``factor`` times over (it was, once: four emulated ranks on
    two cores paid their contention four times). With several intra-op threads the op's CPU is spread over
    threads this one does not see: its wall time is the measure then."""
    alone = cpu if torch.get_num_threads() == 1 else wall
    return max(0.0, factor * alone - wall)


@contextlib.contextmanager
def module_modes(modules, training: bool):
    """``modules`` in training mode (or eval mode) for the block, each back to its own mode after it.

    The fx front end keeps the model's own leaf modules (``nn.Dropout``, ``nn.BatchNorm2d``) whole in the
    packs' graphs, and they read their ``training`` flag as they run: a step runs them in training mode and
    an evaluation in eval mode, whatever mode the user's model is in (compiler/trace/eval.py)."""
    saved = [(m, m.training) for m in modules]
    for m, _ in saved:
        m.training = training
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


class EvalRun:
    """A forward-only schedule's run on a training ``Runtime``: the same state, meter and device, its own plan
    (eval-mode forwards), values, losses and trace events. Everything else is the runtime's."""

    def __init__(self, rt: "Runtime", plan: Plan, graph: torch.fx.Graph):
        self.rt, self.plan, self.graph = rt, plan, graph
        self.free_after = last_uses(graph)
        self.losses: list[torch.Tensor] = []
        self.batch: dict[str, torch.Tensor] = {}
        self.rows: tuple[int, ...] = plan.microbatch_rows()
        self.rng: dict = {}
        self.streams = None      # an evaluation's random ops draw from the generators as they find them
        self.events: list[TraceEvent] = []

    def __getattr__(self, name):
        return getattr(self.rt, name)


class Runtime:
    """Executes a schedule graph on real tensors, one device, enforcing its memory budget.

    ``speed_factor`` > 1 emulates a slower device: each compute op (forward, backward, an
    optimizer step on the device) is followed by a sleep that makes it last ``speed_factor`` times
    its time alone on a core (``emulation_pause``), as the simulator stretches the compute stream.
    Copies, all-reduces and steps on the host are not stretched by it; ``link_bandwidth`` (bytes/s, 0: none)
    emulates a slower host link instead: every copy to or from the device lasts at least its bytes over that rate
    (runtime/tiers/link.py), and copies out run on a thread of their own.

    ``accounting="allocator"`` (CUDA): the meter is the caching allocator's (``AllocatorMeter``), and no hook runs
    around each tensor op.
    """

    def __init__(self, plan: Plan, graph: torch.fx.Graph, tensors: dict, optimizers: dict,
                 budget: int | None, device: torch.device | str = "cpu", on_demand=None, speed_factor: float = 1.0,
                 accounting: str = "ops", link_bandwidth: float = 0.0):
        self.plan = plan
        self.speed_factor = speed_factor      # > 1: an emulated slower device (see ``run``)
        self.graph = graph
        self.device = torch.device(device)
        name = f"{self.device.type}:logical" if self.device.type == "cpu" else str(self.device)
        self.meter = AllocatorMeter(name, budget, self.device) if accounting == "allocator" else \
            MemoryMeter(name, budget)
        reduces = any(op.reduces for _, op in ops_of(graph.nodes))
        link = EmulatedLink(link_bandwidth, link_bandwidth) if link_bandwidth else None
        self.state = TieredState(tensors, optimizers, self.meter, self.device, idle_host=not reduces, link=link)
        self.compute_dtype = compute_dtype(getattr(plan, "precision", "fp32"))   # None: fp32, no casts
        self.state.compute_dtype = self.compute_dtype
        self.scaler = LossScaler(**plan.loss_scaling) if getattr(plan, "precision", "fp32") == "fp16" else None
        clip = getattr(plan, "clip_grad_norm", None)
        stage = getattr(plan, "stage", None)
        grad_of = self.state.grad if stage is None else self._local_grad    # a pipeline rank has its packs' only
        exchange = None if stage is None else norm_exchange(stage, lambda: self.status)
        clipper = None if clip is None else GradClip(clip, plan.clip_norm_type, plan.param_order, grad_of,
                                                settle=self.state.drain, exchange=exchange)
        # fp16 and clipping: the updates wait for the last gradient (runtime/precision.py StepGate)
        self.gate = StepGate(self.scaler, clipper) if self.scaler is not None or clipper is not None else None
        self.on_demand = on_demand(self) if on_demand is not None else None
        # a plan miss makes room rather than failing; not under ondemand (its eviction is its own net), nor where
        # the allocator counts (it reads the device after an op: too late to make room)
        self.safety = SafetyNet(self) if on_demand is None and isinstance(self.meter, MemoryMeter) else None
        self.free_after = last_uses(graph)
        self.rng: dict = {}      # (pack, microbatch): the generators at its forward, which its recompute replays
        self.streams: MicrobatchStreams | None = None    # the running step's per-microbatch generators (rng.py)
        self.losses: list[torch.Tensor] = []
        self.batch: dict[str, torch.Tensor] = {}
        self.rows: tuple[int, ...] = plan.microbatch_rows()    # the running step's rows of each microbatch
        self.token_scale: float | None = None    # tokens: the seeds' factor (runtime/plan.py loss_seed); None: rows
        self.tokens: int | None = None           # the running step's token count (driver/tokens.py)
        self.events: list[TraceEvent] = []
        self.step_packs = [n.args[0] for n, op in ops_of(graph.nodes) if op.steps]
        self.transaction: Transaction | None = None    # the last step's (runtime/transaction.py)
        self.torn: dict | None = None    # a failed step that updated some packs only: what it updated
        self.status = None       # several ranks: the job's view of each step (runtime/comm/jobwide.py StepStatus)
        for what, names in resident_state(plan):
            self.state.wait(self.state.fetch(what, names))

    def _local_grad(self, name: str):
        return self.state.grad(name) if name in self.state.tensors else None

    @contextlib.contextmanager
    def counting(self):
        """Count (and on demand, fetch) every tensor the ops inside allocate or touch."""
        if isinstance(self.meter, AllocatorMeter):    # the allocator counts; copies out in flight may take the
            m = self.meter                             # room the budget leaves above the plan's peak, no more
            slack = m.budget - m.settle_above if m.budget is not None and m.settle_above is not None else 0
            self.state.land_beyond(max(0, slack))
            yield
            m.observe()
        elif self.on_demand is None:
            with CountAllocations(self.meter):
                yield
        else:
            with self.on_demand.calls(), CountAllocations(self.meter, self.on_demand):
                yield

    def run(self, batch: dict[str, torch.Tensor], rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """One training iteration; returns the mean loss over microbatches. A step that raises is rolled back
        (runtime/transaction.py) and its error raised with a note saying so. ``rows``: the rows of each microbatch
        where the batch is smaller than the plan's (as many microbatches, each no larger: driver/shapes.py)."""
        self.rows = rows or self.plan.microbatch_rows()
        txn = self.transaction = Transaction(self, self.step_packs)
        if self.status is not None:
            self.status.begin()
            comm = existing(self)
            if comm is not None:
                comm.began = None
        random = any(spec.random for spec in self.plan.packs)
        self.streams = MicrobatchStreams(self.device, len(self.rows)) if random else None
        try:
            loss = self._run(batch, txn)
            if self.status is not None:     # a failure met at the step's last collective
                self.status.check()
        except BaseException as e:
            instead = txn.roll_back(e)
            if self.safety is not None:     # the weights the plan holds across steps, back on the device
                self.safety.restore()
            if self.streams is not None:     # as if the step had not run, its draws too; one that counts draws on
                self.streams.finish() if txn.outcome == COMMITTED else self.streams.restore()
            self.streams = None
            if instead is not None:        # another rank's failure, named now that the ranks have told each other
                raise instead from None
            raise
        finally:
            if self.status is not None:
                self.status.active = False
        if self.streams is not None:
            self.streams.finish()
        self.streams = None
        txn.commit()
        return loss

    def _run(self, batch: dict[str, torch.Tensor], txn: Transaction) -> torch.Tensor:
        self.batch, self.losses, self.events = batch, [], []
        self.state.moved.clear()
        self.state.host_step_seconds = 0.0
        self.meter.reset_peak()
        if self.gate is not None:
            self.gate.begin()
        if self.on_demand is not None:
            self.on_demand.start_step()
        run_graph(self, self.graph, self.free_after, txn)
        self.finish_updates()
        self.batch = {}
        shared = self.__dict__.pop("shared_loss", None)      # a pipeline's: the job's loss (``share_loss``)
        return mean_loss(self.losses, self.rows, self.token_scale) if shared is None else shared

    @contextlib.contextmanager
    def running(self, plan: Plan, graph: torch.fx.Graph):
        """Run ``graph`` over ``plan`` inside the block: another schedule of the same packs, parameters and residency
        (a batch of another shape, driver/shapes.py), over this runtime's state as it is."""
        saved = self.plan, self.graph, self.free_after, self.step_packs
        self.plan, self.graph, self.free_after = plan, graph, last_uses(graph)
        self.step_packs = [n.args[0] for n, op in ops_of(graph.nodes) if op.steps]
        try:
            yield
        finally:
            self.plan, self.graph, self.free_after, self.step_packs = saved

    def finish_updates(self) -> None:
        """Wait for the host's optimizer steps; run those the ``StepGate`` holds (fp16, clipping), which wait for
        every gradient's check and norm. At the end of the step, or earlier for an op that needs the updated
        weights (``sync_state``); once per step."""
        self.state.drain()
        if self.gate is not None and self.gate.open:
            self.gate.finish(self.transaction.stepping)
            self.state.drain()

    def evaluate(self, graph: torch.fx.Graph, plan: Plan, batch: dict[str, torch.Tensor], modules=(),
                 rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """Run a forward-only ``graph`` (passes/eval_schedule.py) whose packs are ``plan``'s on this runtime's state
        between two steps; returns the mean loss over microbatches, in fp32. ``modules``: those it runs in eval mode.

        It changes no training state: no gradient, no step, no buffer (``plan``'s packs mutate none), the RNG
        as it was, the weights a disk step carried for the next forward left where they were, the meter's
        live bytes and every hold as before it. An error rolls it back as a failed step is
        (runtime/transaction.py); ``run.events`` and the meter's peak are the evaluation's until the next step."""
        run = EvalRun(self, plan, graph)
        run.batch, run.rows = batch, rows or plan.microbatch_rows()
        state, pd = self.state, self.state.params_disk
        carried = pd.carried() if pd is not None else None
        shares = state.shares
        counted = dict(shares.stats) if shares is not None else None   # the next step's figures: not the evaluation's
        rng = rng_state(self.device)
        moved = dict(state.moved)
        state.moved.clear()
        self.meter.reset_peak()
        run.token_scale = None if self.token_scale is None else 1.0     # this rank's batch's own token mean
        txn = Transaction(run, [], what="evaluation")
        # a pipeline's ranks pass values and the loss: its outcome is the job's, as a step's (runtime/comm/jobwide.py)
        status = self.status if self.status is not None and plan.stage is not None else None
        if status is not None:
            status.begin()
        try:
            # not in inference mode (a caller's): its tensors could not be written by the copy thread, nor trained
            with torch.inference_mode(False), torch.no_grad(), module_modes(modules, False):
                run_graph(run, graph, run.free_after, txn)
            if status is not None:
                status.check()
            shared = run.__dict__.pop("shared_loss", None)      # a pipeline's: the loss rank's (``share_loss``)
            loss = mean_loss(run.losses, run.rows, run.token_scale) if shared is None else shared
        except BaseException as e:
            instead = txn.roll_back(e)
            if self.safety is not None:
                self.safety.restore()
            if instead is not None:        # another rank's failure, named now that the ranks have told each other
                raise instead from None
            raise
        finally:
            if status is not None:
                status.active = False
            if pd is not None:        # a carried group's swap_in took it: the next step's forward takes it again
                pd.carry_on(carried)
            if shares is not None:        # what the evaluation's gathers moved: its own figures (``eval_shares``)
                self.eval_shares = {k: v - counted.get(k, 0) for k, v in shares.stats.items()}
                shares.stats.update(counted)
                if shares.carry is not None:      # partitioned: the copies the evaluation took, for the next step
                    shares.carry.carry_on()
            set_rng_state(self.device, rng)
            self.eval_moved = dict(state.moved)
            state.moved.clear()
            state.moved.update(moved)
        txn.commit()
        self.eval_events = run.events
        return loss

    def close(self):
        self.state.close()
        if self.on_demand is not None:     # its spare host buffers (pinned on CUDA)
            self.on_demand.close()
