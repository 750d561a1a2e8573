"""The op table: every schedule op as ``execute`` (real tensors), ``effect`` (predicted memory) and ``cost`` (seconds).

A schedule is a ``torch.fx.Graph`` whose ``call_function`` nodes target the stub
functions below, so ``print(sm.code)`` (compiler/printer.py) reads as the plan, each line with what it
moves and the device's memory after it (a 2-layer GPT at 80% of its state, 4 microbatches):

    # budget 1.47 MiB; predicted peak 1.40 MiB; moved per step h2d 902.50 KiB, d2h 535.00 KiB
    def forward(self):
        swap_in = swap_in(0, 'params')                    # h2d 275.25 KiB · device 275.25 KiB live, 275.25 KiB peak
        load_batch = load_batch(0, ('idx',))              # h2d 1.00 KiB · device 276.25 KiB live, 276.25 KiB peak
        wait = wait(swap_in);  swap_in = wait = None      # device 276.25 KiB live, 276.25 KiB peak
        swap_in_1 = swap_in(1, 'params')                  # h2d 65.50 KiB · device 341.75 KiB live, 341.75 KiB peak
        forward = forward(0, 0, load_batch, keep = False);  load_batch = None  # device 372.75 KiB live, 629.75 KiB peak
        ...
        release = release(0, 'params');  release = None   # device 193.50 KiB live, 468.75 KiB peak

This module is the table, the stubs and the values ops pass; the ops' implementations and their
``register`` calls live beside the runtime code they drive: ``ops_move`` (swap_in, wait, release,
load_batch, stash, unstash), ``ops_compute`` (forward, backward), ``ops_step`` (step), ``ops_comm`` (allreduce),
``partitioned`` (gather, reduce_scatter), ``pipeline`` (send, recv, ...) and ``shard`` (sync_state). Adding an op is
one stub and one ``register`` call: its ``OpDef`` holds everything the runtime, the verifier (what it needs
resident), the simulator (its stream, state copies, disk I/O), the passes and the drawings (colour, label) use,
and what it does (``fetches``, ``steps``, ``releases``, ...), which every module asks of the op
(``op_of(node).steps``) rather than of its name. ``harmony.runtime`` registers every op when it is imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.fx

from harmony.base.tiers import Tier
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE


# -- the values that flow between ops ------------------------------------------------------------
@dataclass
class Acts:
    """One microbatch's tensors at a pack boundary (outputs, or gradients of inputs)."""

    values: dict[str, torch.Tensor]
    leaves: dict[str, torch.Tensor] | None = None   # kept forward: detached inputs that collect grads
    outs: dict[str, torch.Tensor] | None = None     # kept forward: outputs still attached to the graph
    on_device: bool = True
    graph: list | None = None      # kept forward: the tensors autograd saved for the backward (``Saved``)
    arriving: object = None        # the copies bringing it back (``unstash``), which its readers join (``arrived``)


def arrived(rt, acts: Acts) -> Acts:
    """``acts`` once the copies bringing it back to the device (``unstash``, on the copy engine) have landed: every
    op that reads a value joins them first, so the copy overlaps whatever runs between the unstash and its reader."""
    if acts.arriving is not None:
        rt.state.wait(acts.arriving)
        acts.arriving = None
    return acts


class Saved:
    """A tensor a kept forward's graph saved for its backward, held where a ``stash`` can move it.

    Autograd keeps what the pack hook returns and gives it to the unpack hook in the backward, so
    the graph holds this and not the tensor: a stash sends the tensor's storage to the host and
    drops the device copy (``host`` plus the view's geometry), an unstash brings the storage back
    and rebuilds the view (``t``), all without autograd knowing."""

    __slots__ = ("t", "host", "view")

    def __init__(self, t: torch.Tensor):
        self.t, self.host, self.view = t, None, None


@dataclass
class Predicted:
    """What ``effect`` knows of a value: its bytes and where they live."""

    bytes: int
    on_device: bool = True
    kept: int = 0          # activations held for backward (a kept forward)
    graph: int = 0         # of those, the bytes a stash sends to the host (the graph's own, not inputs or outputs)
    away: int = 0          # graph bytes a stash sent to the host, which an unstash brings back


@dataclass
class MemoryModel:
    """Predicted device bytes while a schedule runs; mirrors ``TieredState`` refcounts."""

    plan: object
    sizes: dict[tuple, int]                 # (kind, name) -> bytes
    refs: dict = field(default_factory=dict)
    live: int = 0
    grads_exist: set = field(default_factory=set)
    dirty: set = field(default_factory=set)
    moved: dict = field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    handed: dict = field(default_factory=dict)   # pack -> gradient bytes its release left for a disk step
    overlapping: int = 0   # bytes an overlapped disk step holds on the device (gradients, handed weights) until the
                           # next

    def hold(self, kind, names, moves: bool = True):
        """Take a reference to each; the first brings its bytes onto the device (``moves``: copied in, else
        already there, as weights the last step left)."""
        for n in names:
            k = (kind, n)
            self.refs[k] = self.refs.get(k, 0) + 1
            if self.refs[k] == 1 and (kind != "grads" or n in self.grads_exist):
                self.live += self.sizes.get(k, 0)
                if moves:
                    self.moved["h2d"] += self.sizes.get(k, 0)

    def drop(self, kind, names, write_back=False, stays=False) -> int:
        """Drop a reference to each; the last takes its bytes off the device, unless ``stays``: released by
        the schedule but still on the device (handed to a disk step, carried to the next iteration).
        Returns those bytes."""
        freed = 0
        for n in names:
            k = (kind, n)
            self.refs[k] -= 1
            if self.refs[k] == 0 and (kind != "grads" or n in self.grads_exist):
                freed += self.sizes.get(k, 0)
                if kind != "params" or write_back:
                    self.moved["d2h"] += self.sizes.get(k, 0)
        if not stays:
            self.live -= freed
        return freed

    def resident(self, kind, name) -> bool:
        return self.refs.get((kind, name), 0) > 0

    def carry_in(self, graph) -> None:
        """The weights the last step left on the device for this one (``swap_in(..., carried=True)``): live from
        the start, held until the forward that takes them releases them; nothing moves."""
        for n, op in ops_of(graph.nodes):
            if op.fetches and n.kwargs.get("carried"):
                self.hold("params", carried_names(self.plan, n.args[0]), moves=False)


def _needs_nothing(kwargs) -> tuple:
    return ()


def label_args(args, kwargs) -> str:
    return ", ".join(short_label(a) for a in args)


def short_label(a) -> str:
    if hasattr(a, "name") and not isinstance(a, str):   # a value another op made
        return a.name
    if isinstance(a, (tuple, list)):
        return ",".join(short_label(x) for x in a) or "()"
    return str(a)


@dataclass(frozen=True)
class OpDef:
    """Everything the runtime, verifier, simulator, passes and drawings know about one schedule op."""

    stub: Callable       # the function a schedule graph calls (its name is the op's name)
    execute: Callable    # (runtime, *args, **kwargs) -> value: real tensors
    effect: Callable     # (model, *args, **kwargs) -> (Predicted | None, transient bytes above live)
    cost: Callable       # (plan, hw, *args, **kwargs) -> (stream name, seconds)
    kind: str            # "compute" | "copy" | "sync": the stream family it runs on
    needs: Callable = _needs_nothing   # (kwargs) -> state kinds of its pack (args[0]) resident on the device
    state_copy: bool = False           # moves its pack's state of one kind (args (pack, kind)) across the link:
                                       # the simulator times what the effect really moves
    disk_io: Callable | None = None    # (plan, node, hw) -> {"read": s, "write": s} of disk I/O around it
    colour: str = ""                   # fill in drawings ("": its kind's)
    label: Callable = label_args      # (args, kwargs) -> the second line of its label in drawings
    # What it does, as the simulator, executor, passes, shape cache and reports ask (``op_of(node).steps``), never
    # by its name: an op is each of these it declares, and none it does not.
    fetches: bool = False        # brings its pack's state of one kind (args (pack, kind)) onto the device: swap_in,
                                 # gather. It reads what the last release of that state wrote back, and the weights
                                 # a host step updates (the thread issuing it waits for that step)
    releases: bool = False       # takes its pack's state of one kind off the device, writing back what changed
    steps: bool = False          # an optimizer step of its pack (args[0]): its gradients taken, weights and state
                                 # changed; the schedule's step ops give the order packs step in
    runs_forward: bool = False   # runs its pack (args (pack, mb)) forward on a microbatch
    runs_backward: bool = False  # runs its pack backward on a microbatch: makes the pack's gradients
    loads_batch: bool = False    # copies a microbatch's inputs onto the device
    stashes: bool = False        # sends a value to the host; a kept forward's graph going out passes the forward's
                                 # outputs on at once (its readers do not wait for the copy)
    unstashes: bool = False      # brings a stashed value back: it waits for the whole copy out, not the outputs
    joins: bool = False          # waits for a copy in flight (its argument's handle) on the compute stream
    copy_thread: bool = False    # its copies run on the runtime's copy thread, not the thread issuing ops: where
                                 # copies block compute (``sync_copies``) the compute stream goes on meanwhile
    disk_read_ahead: bool = False   # its disk read (``disk_io``) starts ahead, once the step before its pack's in
                                    # step order has started; otherwise when the op is ready
    sends: bool = False          # sends values to a peer rank (kwargs ``dst``, ``tag``)
    receives: bool = False       # receives values from a peer rank (kwargs ``src``, ``tag``): done once the peer's
                                 # matching send is
    reduces: bool = False        # reduces gradients over the data-parallel ranks, on the host thread (which then
                                 # may not idle: the other ranks wait for it)
    partitioned: bool = False    # works on its pack's partitioned share (``shard_state="full"``): each rank's chunks

    @property
    def name(self) -> str:
        return self.stub.__name__


# -- stubs: the names a schedule graph calls ----------------------------------------------------
def swap_in(pack: int, what: str, held: tuple = (), carried: bool = False): ...
def wait(handle): ...
def release(pack: int, what: str, handoff: bool = False, held: tuple = (), carry: bool = False): ...
def load_batch(mb: int, names: tuple): ...
def forward(pack: int, mb: int, *inputs, keep: bool = False): ...
def backward(pack: int, mb: int, *inputs, saved=None, grads=(), chain=(), totals=()): ...
def stash(value): ...
def unstash(value): ...
def step(pack: int, stream: bool = False, where: Tier = Tier.DEVICE, overlap: bool = False): ...
def allreduce(pack: int, kind: str = "none", *, world: int = 1, where: Tier = Tier.DEVICE, sync: bool = False,
              min_size: int = DEFAULT_MIN_SIZE, warmup: int = 0, weight: float | None = None, **spec): ...


OPS: dict[Callable, OpDef] = {}   # stub -> its definition; filled as harmony.runtime is imported
_NAMED: dict[str, OpDef] = {}     # the same definitions by name (op_named), written beside OPS


def register(stub, execute, effect, cost, kind, **more) -> OpDef:
    """Add an op: ``stub`` is what schedule graphs call; ``more`` any other ``OpDef`` field."""
    OPS[stub] = op = OpDef(stub, execute, effect, cost, kind, **more)
    _NAMED[op.name] = op
    return op


def op_of(node) -> OpDef | None:
    """The table entry of the op ``node`` calls; None for a node that calls none (a placeholder, the output). A
    schedule calls only registered ops: a call of any other function is a KeyError."""
    return OPS[node.target] if node.op == "call_function" else None


def ops_of(nodes) -> Iterator[tuple[torch.fx.Node, OpDef]]:
    """(node, its op) for each of ``nodes`` that calls an op (a graph's ``nodes``, a node's ``users``)."""
    for n in nodes:
        if n.op == "call_function":
            yield n, OPS[n.target]


def op_named(name: str) -> OpDef | None:
    """The registered op called ``name`` (a schedule's group keys and drawings name ops): a lookup, as the swap
    pass asks it for every stash group of every schedule it builds; an op taken out of ``OPS`` is not found."""
    op = _NAMED.get(name)
    return op if op is not None and OPS.get(op.stub) is op else None


def state_names(spec, what: str) -> list[str]:
    """The state of one kind a pack needs: params (with buffers), grads, or optimizer state."""
    if what == "params":
        return spec.params + spec.buffers
    if what == "grads":
        return spec.params
    return spec.stepped


def moving_names(spec, what: str, held=()) -> list[str]:
    """The names a ``swap_in`` or ``release`` moves: the pack's state of that kind but those ``held`` on the device
    across it (weights of a host-stepped pack kept between two visits, parameter by parameter)."""
    names = state_names(spec, what)
    if not held:
        return names
    held = set(held)
    return [n for n in names if n not in held]


def carried_names(plan, pack: int) -> list[str]:
    """The weights of a wholly-disk pack that its step can leave on the device for the next iteration's forward
    (``Residency.carried``, the graph's ``carry``/``carried``): those of its files on disk. A file kept in host
    memory (``Residency.in_memory``) is stepped there and copied in for each use, carried or not. A partitioned
    pack (``shard_state="full"``) whose share is on disk carries the weights it partitions, which its step
    all-gathers into the device copy (runtime/partitioned/); before the shard pass has cut the shares (the swap
    pass), its ``owned`` weights."""
    record = plan.at(pack)
    if record.master_on == Tier.DISK and not record.disk_groups:     # partitioned: no files of whole weights
        return record.shares.names() if record.shares is not None else list(plan.packs[pack].owned)
    return [n for i, names in enumerate(record.disk_groups) if i not in record.in_memory for n in names]


def resident_state(plan):
    """(kind, names) held on the device for the whole run: whole packs' state, single parameters' optimizer state,
    and all the state of single parameters of host-stepped packs that step on the device."""
    for pack, what in plan.kept():
        yield what, state_names(plan.packs[pack], what)
    kept = plan.per_param("optim_kept")
    if kept:
        yield "optim", sorted(kept)
    parts = sorted(plan.per_param("device_parts"))
    if parts:            # single parameters of host-stepped packs that step on the device: all their state stays
        for what in ("params", "grads", "optim"):
            yield what, parts
