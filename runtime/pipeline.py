"""Pipeline across the devices of one node (``parallel="pipeline"``): what a rank knows of the other ranks' packs,
and the ops that pass a microbatch's values between ranks, registered in the op table (runtime/ops/).

``recv`` brings one message from another rank: a microbatch's outputs of one of its packs that this rank's packs
read, or the gradients of those outputs that one of its packs computed; ``send`` is the other end. A message is a
mask of the values it carries (a backward leaves no gradient for an input it does not depend on) and then each
value, on ``torch.distributed`` point-to-point (gloo here, the same calls on NCCL). A send copies the values to the
host first and returns at once (``isend``): the device copy is free for the schedule to drop, and no rank ever
waits for a peer to take what it sent, which is what keeps the ranks' schedules free of deadlock (each is the
single-device order restricted to its packs: every recv comes after its send in that order). ``share_loss`` ends
the step: the sends are joined, and the rank that holds the loss broadcasts its mean to the others.

Under ``clip_grad_norm`` every rank's steps follow its last backward, after ``share_norms``: each rank takes the
per-tensor norms of its packs' gradients (bitwise eager's: the gradients are) and all ranks all-gather them, so each
stacks every parameter's norm in ``model.parameters()`` order as ``clip_grad_norm_`` does: the same global norm,
the same clipped updates, bit for bit.

A peer that dies or stalls fails a wait within the module's ``comm_timeout`` with ``CommunicationError``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harmony.base.units import nbytes
from harmony.runtime.comm.failures import guarded, wait_work
from harmony.runtime.comm.jobwide import ABORT, STEP_KEY, Aborted, Words, ghost
from harmony.runtime.ops import Acts, Predicted, arrived, register
from harmony.runtime.ops.reduce import replay_tied
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY, mean_loss

SLOTS = 256          # tags per message: the mask, then one per value


@dataclass
class Stages:
    """The packs of the whole model and the rank each runs on; ``plan.packs`` holds this rank's, re-indexed."""

    rank: int
    world: int
    rank_of: list[int]                  # global pack -> the rank that holds, runs and steps it
    local: list[int]                    # this rank's pack i -> its global index
    inputs: list[list[str]]             # global pack -> the values it reads
    outputs: list[list[str]]            # global pack -> the values it makes
    names: list[str]                    # global pack -> its layers' name
    values: dict = field(default_factory=dict)   # value crossing ranks -> (shape, dtype name) or ("const", value)
    placement: str = "contiguous"
    timeout: float = 300.0
    grid: object = None                 # parallel=("pipeline", "data"): runtime/comm/grid.Grid; None: one pipeline
    tied: dict = field(default_factory=dict)   # a weight packs on several ranks use -> those (pipeline) ranks, sorted
    tied_bytes: dict = field(default_factory=dict)     # those weights -> their bytes
    weight: float | None = None         # a balanced grid's pipeline: its rows / the global batch (None: equal shares)

    @property
    def loss_rank(self) -> int:
        return self.rank_of[-1]

    def peer(self, rank: int) -> int:
        """The job rank of pipeline rank ``rank`` (itself in a pipeline alone; in a grid, of this rank's pipeline)."""
        return rank if self.grid is None else self.grid.pipeline_ranks()[rank]

    def tied_sets(self) -> dict[tuple, list[str]]:
        """Each set of job ranks (this rank's pipeline's) holding copies of tied weights -> those weights, in
        name order: one all-reduce group each (passes/tied.py)."""
        out: dict = {}
        for n in sorted(self.tied):
            out.setdefault(tuple(self.peer(r) for r in self.tied[n]), []).append(n)
        return dict(sorted(out.items()))

    @property
    def job(self) -> tuple[int, int]:
        """(this process's rank, ranks) in the whole job: a grid's, else the pipeline's."""
        return (self.rank, self.world) if self.grid is None else (self.grid.rank, self.grid.world)


# -- stubs: the names a schedule graph calls ----------------------------------------------------
def recv(pack: int, mb: int, *, src: int, tag: int, names: tuple, grads: bool = False): ...
def send(value, pack: int, mb: int, *, dst: int, tag: int, names: tuple, grads: bool = False): ...
def share_loss(src: int, *, weight: float | None = None): ...
def share_norms(): ...


def _receive(rt, src, tag, names, what) -> dict | None:
    """One message from ``src``: its mask (the sender's word on the step first, runtime/comm/jobwide.py), then the
    values it says are there, on the host. None where the sender's step failed (its mask says ``ABORT``)."""
    import torch.distributed as dist
    st, status = rt.plan.stage, rt.status
    mask = torch.zeros(_header_length(st, names), dtype=torch.int64)
    if status is not None and status.active:
        status.done[("recv", src)] += 1
    work = guarded(what, dist.irecv, mask, st.peer(src), tag=tag * SLOTS, timeout=st.timeout, peer=src)
    wait_work(work, what, st.timeout, peer=src)
    if int(mask[0]) == ABORT:
        if status is not None:
            status.heard(("recv", src), [], True)
        return None
    out, works = {}, []
    dims = iter(mask[1 + len(names):].tolist())
    for i, n in enumerate(names):
        shape, dtype = st.values[n]
        if shape == "const":
            out[n] = dtype
            continue
        shape = [next(dims) for _ in shape]       # the sender's (a batch smaller than the example's: smaller)
        if not mask[1 + i]:
            continue
        host = torch.empty(shape, dtype=getattr(torch, dtype))
        works.append(guarded(what, dist.irecv, host, st.peer(src), tag=tag * SLOTS + 1 + i, timeout=st.timeout,
                             peer=src))
        out[n] = host
    for w in works:
        wait_work(w, what, st.timeout, peer=src)
    return out


def _recv_execute(rt, pack, mb, *, src, tag, names, grads=False):
    what = f"recv of {'gradients' if grads else 'activations'} (microbatch {mb}) from rank {src}"
    out = _receive(rt, src, tag, names, what)
    if out is None or (rt.status is not None and rt.status.seen):    # the sender's step failed, or another's
        raise Aborted(f"rank {rt.plan.stage.rank}: a rank's step failed before its {what}")
    for n, host in out.items():      # on the device, counted by its meter (the CPU device: the buffer itself)
        if isinstance(host, torch.Tensor):
            dst = host if rt.device.type == "cpu" else host.to(rt.device)
            rt.meter.track(dst)
            out[n] = dst
    return Acts(out)


def _header_length(st: Stages, names) -> int:
    """A message's header: the sender's word, whether each value follows, and each tensor value's sizes."""
    return 1 + len(names) + sum(len(st.values[n][0]) for n in names if st.values[n][0] != "const")


def _send_mask(rt, dst, tag, present: list[bool], what: str, shapes: list) -> bool:
    """Post a message's header to ``dst``: this rank's word on the step, which values follow, and their sizes
    (``shapes``: each tensor value's, None where absent). False: the step failed here (or this rank knows one did):
    the header says ``ABORT`` and no value follows."""
    import torch.distributed as dist
    st, status = rt.plan.stage, rt.status
    aborted = status is not None and status.active and (status.failed or status.seen)
    if status is not None and status.active:
        status.done[("send", dst)] += 1
    mask = torch.tensor([ABORT if aborted else 0] + [p and not aborted for p in present]
                        + [d for shape in shapes for d in shape], dtype=torch.int64)
    rt.__dict__.setdefault("sends", []).append(
        (guarded(what, dist.isend, mask, st.peer(dst), tag=tag * SLOTS, timeout=st.timeout, peer=dst), mask,
         what, dst))
    return not aborted


def _send_execute(rt, value, pack, mb, *, dst, tag, names, grads=False):
    import torch.distributed as dist
    st = rt.plan.stage
    what = f"send of {'gradients' if grads else 'activations'} (microbatch {mb}) to rank {dst}"
    vals = arrived(rt, value).values
    present = [isinstance(vals.get(n), torch.Tensor) for n in names]
    if not _send_mask(rt, dst, tag, present, what, _shapes(st, names, vals)):
        return
    pending = rt.__dict__["sends"]
    for i, n in enumerate(names):
        if present[i]:       # a host copy: the device's may be dropped as soon as the schedule is done with it
            rt.state.landed(vals[n])     # (a stashed value: its copy from the device may be in flight)
            host = vals[n].detach().to("cpu", copy=True)
            work = guarded(what, dist.isend, host, st.peer(dst), tag=tag * SLOTS + 1 + i, timeout=st.timeout,
                           peer=dst)
            pending.append((work, host, what, dst))


def _shapes(st: Stages, names, vals: dict) -> list:
    """Each tensor value's sizes for the header, in ``names`` order: the value's, or zeros where it is absent."""
    out = []
    for n in names:
        shape = st.values[n][0]
        if shape != "const":
            v = vals.get(n)
            out.append(tuple(v.shape) if isinstance(v, torch.Tensor) else (0,) * len(shape))
    return out


def join_sends(rt) -> None:
    """Wait for this step's sends to be taken."""
    timeout = rt.plan.stage.timeout
    for work, _, what, dst in rt.__dict__.pop("sends", []):
        wait_work(work, what, timeout, peer=dst)


def _share_loss_execute(rt, src, weight=None):
    """Join this step's sends; the job's loss to every rank, in one all-reduce that carries each rank's word on the
    step too (runtime/comm/jobwide.py). The loss rank adds its step's loss as one process returns it (``mean_loss``:
    by rows, or a token mean's term) and every other rank zeros, so each rank returns the loss rank's bits; in a grid
    the pipelines' loss ranks all add theirs, and the step returns their mean; ``weight`` (a balanced grid's step:
    this pipeline's rows over the global batch) weighs each pipeline's loss by its rows, the global batch's mean."""
    st = rt.plan.stage
    join_sends(rt)
    status = rt.status if rt.status is not None and rt.status.active else None
    # on the host, as the words it travels with (a GPU's losses are its tensors: copied here, after their kernels)
    loss = mean_loss(rt.losses, rt.rows, rt.token_scale).reshape(1).cpu() if st.rank == src else torch.zeros(1)
    if weight is not None and st.rank == src:
        loss = loss * (weight * st.grid.replicas)      # the mean over the pipelines is then the weighted sum
    summed = _loss_exchange(rt, loss, Words(status, STEP_KEY, None) if status is not None else None, src)
    if status is not None and status.seen:
        raise Aborted(f"rank {st.rank}: a rank's step failed before the loss was shared")
    rt.shared_loss = summed[0] if st.grid is None else summed[0] / st.grid.replicas


def _loss_exchange(rt, loss: torch.Tensor, words, src: int) -> torch.Tensor:
    """The all-reduce of ``loss`` (zeros but on the loss rank) with ``words`` after it; their sum. Over the whole
    job: in a grid every rank hears every rank's word on the step, and the loss is the sum of the pipelines'."""
    import torch.distributed as dist
    st = rt.plan.stage
    me, world = st.job
    buf = torch.cat([loss, words.vector(world, me) if words is not None else torch.zeros(world)])
    what = f"the broadcast of the loss from rank {src}"
    wait_work(guarded(what, dist.all_reduce, buf, async_op=True, timeout=st.timeout), what, st.timeout)
    if words is not None:
        words.read(buf[1:])
        words.settle(raises=False)
    return buf


def norm_exchange(stage: Stages, status=lambda: None):
    """``GradClip``'s exchange on a pipeline rank: this rank's per-tensor gradient norms (by name) to every rank,
    every rank's back, merged (each parameter lives on one rank of a pipeline). In a grid the gather spans the job
    (every rank meets it once a step, as the loss's all-reduce) and each rank takes its own pipeline's norms: those
    of its averaged gradients, which every replica holds alike."""
    def exchange(local: dict) -> dict:
        import torch.distributed as dist
        what = "all-gather of the gradient norms (clip_grad_norm)"
        step = status()
        if step is not None:     # every rank's step got here (runtime/comm/jobwide.py)
            step.go(STEP_KEY, None, what)
        got: list = [None] * stage.job[1]
        guarded(what, dist.all_gather_object, got, {n: t.detach().cpu() for n, t in local.items()},
                timeout=stage.timeout)
        mine = range(len(got)) if stage.grid is None else stage.grid.pipeline_ranks()
        return {n: t for r in mine for n, t in got[r].items()}
    return exchange


def _share_norms_execute(rt):
    """Every rank joins the norms' all-gather here, at one point of its schedule: before its first step."""
    rt.gate.clipper.norm()


def message_bytes(plan, names) -> int:
    """Bytes of the boundary values ``names`` a send carries (their shapes and dtypes from the stage plan)."""
    total = 0
    for n in names:
        shape, dtype = plan.stage.values[n]
        if shape != "const":
            total += nbytes(torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
    return total


def _recv_effect(m, pack, mb, *, names, **kw):
    return Predicted(message_bytes(m.plan, names)), 0


def _send_effect(m, value, pack, mb, **kw):
    return None, 0         # the values go from a host copy; the device's dies with its last use


def _none(m, *args, **kwargs):
    return None, 0


def _p2p_cost(plan, hw, *args, names=(), **kw):
    """The message at the device-to-device link's speed (``p2p_bandwidth``; the network's where a device has none), on
    the ``p2p`` stream: not the link between servers, which a grid's all-reduces take."""
    bandwidth = getattr(hw, "p2p_bandwidth", None) or getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    return "p2p", message_bytes(plan, names) / bandwidth + getattr(hw, "network_latency",
                                                                         NOMINAL_NETWORK_LATENCY)


def _share_loss_cost(plan, hw, src, **kw):
    return "network", getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY)


def _label(args, kwargs) -> str:
    peer = f"from {kwargs.get('src')}" if "src" in kwargs else f"to {kwargs.get('dst')}"
    mb = args[1] if len(args) == 2 else args[2] if len(args) > 2 else "?"
    return f"mb {mb} {'grads' if kwargs.get('grads') else 'acts'} {peer}"


@ghost(recv)
def _recv_ghost(rt, node) -> None:
    """In a replay: the message taken (its values too, where its sender's step ran), its mask's word heard."""
    src, tag, names = node.kwargs["src"], node.kwargs["tag"], node.kwargs["names"]
    if not rt.status.skip(("recv", src)):
        _receive(rt, src, tag, names, f"recv from rank {src} (the step's rollback)")


@ghost(send)
def _send_ghost(rt, node) -> None:
    dst, names = node.kwargs["dst"], node.kwargs["names"]
    if not rt.status.skip(("send", dst)):
        _send_mask(rt, dst, node.kwargs["tag"], [False] * len(names), f"send to rank {dst} (the step's rollback)",
                   _shapes(rt.plan.stage, names, {}))


@ghost(share_loss)
def _share_loss_ghost(rt, node) -> None:
    replay_tied(rt)
    join_sends(rt)
    if not rt.status.skip(STEP_KEY):
        _loss_exchange(rt, torch.zeros(1), Words(rt.status, STEP_KEY, None), (node.args or [node.kwargs.get("src")])[0])


@ghost(share_norms)
def _share_norms_ghost(rt, node) -> None:
    replay_tied(rt)
    rt.status.meet(STEP_KEY, None, "the all-gather of the gradient norms")


register(recv, _recv_execute, _recv_effect, _p2p_cost, "copy", colour="#ef3b2c", label=_label, receives=True)
register(send, _send_execute, _send_effect, _p2p_cost, "copy", colour="#fb6a4a", label=_label, sends=True)
register(share_loss, _share_loss_execute, _none, _share_loss_cost, "sync", colour="#fcbba1",
         label=lambda args, kwargs: f"loss from rank {args[0]}")
register(share_norms, _share_norms_execute, _none, lambda plan, hw: _share_loss_cost(plan, hw, 0), "sync",
         colour="#fcbba1", label=lambda args, kwargs: "gradient norms")
