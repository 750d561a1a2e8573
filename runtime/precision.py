"""Mixed precision: the compute dtype of device copies, and dynamic loss scaling for fp16.

With ``precision="bf16"`` or ``"fp16"`` the device holds compute copies of the float
parameters and buffers in that dtype (2 bytes each), the activations and gradients the
packs make on it are in that dtype too, and the host keeps the fp32 master weights the
optimizer steps, with fp32 gradients and fp32 optimizer state (ZeRO-Offload). Frozen parameters
(``requires_grad=False``) have no master: compile casts them to the compute dtype on the host (``frozen_to``).
Where the bytes are made:

- ``swap_in`` of parameters casts the fp32 master into a new device copy (``TieredState.fetch``);
  the master is never on the device, and the copy is dropped, not written back, on release;
- gradients accumulate over the microbatches in the compute dtype on the device, by
  autograd, exactly as an eager model cast to that dtype accumulates them; they leave the
  device in that dtype and become fp32 on the host right before the pack's step
  (``master_grads``);
- float batch tensors are cast on ``load_batch``; integer ones (token ids) are not.

Updates that must wait for the last gradient (fp16's overflow check, clipping's global norm) wait in one
``StepGate``, whatever asks for the wait.

fp16's narrow exponent range needs loss scaling; ``LossScaler`` has torch.amp.GradScaler's
semantics and uses torch's own kernels for them: the loss is multiplied by the scale before
backward, every gradient is unscaled in fp32 and checked for inf/nan before any parameter
steps, a step with a non-finite gradient is skipped whole (every pack) and the scale is
multiplied by ``backoff_factor``, and after ``growth_interval`` clean steps in a row it is
multiplied by ``growth_factor``.
"""
from __future__ import annotations

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALING_DEFAULTS = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype of device copies of float state and activations; None for fp32 (no cast anywhere)."""
    return PRECISIONS[precision]


def device_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` has on the device: the compute dtype for float tensors, its own otherwise."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def device_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``t``'s copy on the device (``t`` may be real or fake)."""
    return t.numel() * torch.empty((), dtype=device_dtype(t, dtype)).element_size()


def frozen_to(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Frozen float parameters (``requires_grad=False``: a LoRA model's base weights) take the compute dtype, in
    place, where they are (the host): no optimizer steps them, so they need no fp32 master, and the device's copy
    of them is the host's as it is, never written back. Returns their bytes in ``dtype``."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return sum(p.numel() * p.element_size() for p in frozen)


def master_grads(pairs, buffer: "GradBuffer | None" = None) -> None:
    """Give each parameter of ``pairs`` (parameter, its gradient in the compute dtype) an fp32 gradient (its master's
    dtype), on the host: in ``buffer`` where given (the update that follows drops them before the next pack's are
    made), else as new tensors."""
    if buffer is not None:
        pairs = buffer.fill(pairs)
    for p, g in pairs:
        p.grad = g.to(p.dtype)


class GradBuffer:
    """One flat fp32 buffer the host thread converts each pack's gradients into, reused by every pack and step.

    A new fp32 tensor per gradient per step costs more than the conversion itself: tensors this large are fresh
    pages from the system each time (freed ones go back to it), which the host faults in and zeroes before writing
    a byte; converting into pages already mapped is one pass (``copy_`` casts as it copies). The host thread runs
    one update at a time and an update that runs at once drops its gradients (``p.grad = None``) before the next
    pack's conversion, so one buffer as large as the largest pack's fp32 gradients serves them all; the host budget
    already counts that much (passes/offload.py: two packs' gradients in both dtypes). Updates a ``StepGate``
    defers hold their gradients until the last one, so those are made as new tensors instead.
    """

    def __init__(self):
        self.flat: torch.Tensor | None = None

    def fill(self, pairs) -> list:
        """Copy the gradients of fp32 host parameters into views of the buffer (grown first where they do not fit)
        and give them to their parameters; the other pairs are returned."""
        def mine(p):
            return p.dtype == torch.float32 and p.device.type == "cpu"
        need = sum(p.numel() for p, _ in pairs if mine(p))
        if need and (self.flat is None or self.flat.numel() < need):
            self.flat = None             # the smaller one goes before the larger is made
            self.flat = torch.empty(need, dtype=torch.float32)
        at = 0
        for p, g in pairs:
            if mine(p):
                view = self.flat[at:at + p.numel()].view(p.shape)
                view.copy_(g)
                p.grad = view
                at += p.numel()
        return [(p, g) for p, g in pairs if not mine(p)]


OVERFLOW = "the ranks' agreement on an fp16 overflow"


def max_over_ranks(t: torch.Tensor) -> None:
    """``t`` becomes its maximum over the data-parallel ranks (a ``LossScaler.agree`` outside a step's job-wide
    outcome)."""
    import torch.distributed as dist

    from harmony.runtime.comm.collectives import guarded
    guarded(OVERFLOW, dist.all_reduce, t, op=dist.ReduceOp.MAX)


def overflow_agreement(rt):
    """A ``LossScaler.agree`` for ``rt``'s ranks: within a step, the found-inf flag rides on a meet of the ranks'
    words (runtime/comm/jobwide.py), which a rank whose step failed before it replays (``overflow_ghost``), so a
    peer never waits in it for a rank that will not come; else a max over the ranks."""
    from harmony.runtime.comm.jobwide import STEP_KEY

    def agree(found_inf: torch.Tensor) -> None:
        status = getattr(rt, "status", None)
        if status is None or not status.active:
            max_over_ranks(found_inf)
        else:
            status.go(STEP_KEY, None, OVERFLOW, flag=found_inf)
    return agree


def overflow_ghost(rt) -> None:
    """In a replay: the overflow agreement's meet, saying nothing overflowed here."""
    from harmony.runtime.comm.jobwide import STEP_KEY
    rt.status.meet(STEP_KEY, None, OVERFLOW, flag=torch.zeros(1))


class LossScaler:
    """Dynamic loss scaling for one runtime, as ``torch.amp.GradScaler`` does it.

    Per iteration: ``begin()``; the loss seed of backward is ``scale_loss(loss)``; each pack's host step calls
    ``unscale`` on its fp32 gradients and hands its update to the runtime's ``StepGate``, whose ``finish``, after the
    last backward, runs the updates only if no gradient was inf or nan (``found_inf``) and then calls ``end`` to
    update the scale with ``torch._amp_update_scale_``. The updates wait for the last gradient because one overflow
    anywhere skips the whole step: fp16 gives up overlapping the host steps with backward (bf16 keeps it).
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.found_inf = torch.zeros(1)
        self.inv_scale = torch.ones(1)
        self.skipped = 0            # iterations whose update was skipped for an inf/nan gradient
        # partitioned ranks (shard_state="full") each check their own chunks of the gradients: ``agree(found_inf)``
        # makes it every rank's (a max over the ranks), so all skip together
        self.agree = None

    def begin(self) -> None:
        self.found_inf = torch.zeros(1)
        self.inv_scale = self.scale.double().reciprocal().float()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide fp32 gradients by the scale in place, noting any inf or nan (GradScaler.unscale_'s kernel)."""
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.inv_scale)

    def overflowed(self) -> bool:
        """Whether any gradient unscaled this iteration was inf or nan: the whole step is skipped."""
        if self.agree is not None:
            self.agree(self.found_inf)
        return bool(self.found_inf.item())

    def end(self, skipped: bool) -> None:
        """Count a skipped iteration and update the scale for the next."""
        self.skipped += skipped
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        """What a resumed run needs (plain numbers: checkpoints keep it in their JSON manifest)."""
        return dict(scale=self.scale.item(), growth_tracker=int(self.growth_tracker.item()), skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.skipped = int(state.get("skipped", 0))


class GradClip:
    """Clipping by the global gradient norm, computed by torch's own ``get_total_norm`` and
    ``clip_grads_with_norm_`` (what ``clip_grad_norm_`` is made of), so the update is bitwise eager's.

    The norm stacks the per-tensor norms in ``order`` (``model.parameters()``'s); it is taken once per
    iteration, at the first update that needs it, when every gradient is final (``settle()`` first waits for
    those still on their way), wherever it lives (``grad_of(name)``: on the device, on the host, parked beside an
    fp32 master). Each pack's gradients are
    then multiplied by ``min(max_norm / (norm + 1e-6), 1)`` right before its update.
    """

    def __init__(self, max_norm: float, norm_type: float, order: list[str], grad_of, settle=lambda: None,
                 exchange=None):
        self.max_norm, self.norm_type, self.order, self.grad_of = float(max_norm), float(norm_type), order, grad_of
        self.settle = settle      # waits for gradients still on their way (the host thread's copies, all-reduces)
        # a pipeline rank holds its packs' gradients only: ``exchange(norms by name)`` returns every rank's
        # per-tensor norms (a collective every rank joins once per iteration, runtime/pipeline.py)
        self.exchange = exchange
        self.total: torch.Tensor | None = None     # this iteration's norm, before clipping
        # per-tensor norms computed where the gradient was whole though no rank keeps it so (shard_state="full":
        # the reduce-scatter's buffer), by name; the others are computed from ``grad_of`` at ``norm``
        self.known: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        self.total = None
        self.known = {}

    def norm(self) -> torch.Tensor:
        if self.total is None:
            self.settle()
            if self.exchange is not None:     # (with the norms of this rank's partitioned gradients, ``known``)
                local = [(n, g) for n, g in ((n, self.grad_of(n)) for n in self.order if n not in self.known)
                         if g is not None]
                norms = torch._foreach_norm([g for _, g in local], self.norm_type) if local else []
                self.known = self.exchange({**dict(zip([n for n, _ in local], norms)), **self.known})
            if not self.known:
                grads = [g for g in map(self.grad_of, self.order) if g is not None]
                self.total = torch.nn.utils.get_total_norm(grads, self.norm_type)
            else:
                self.total = self._total_with_known()
        return self.total

    def _total_with_known(self) -> torch.Tensor:
        """get_total_norm's two steps, with the per-tensor norms of ``known`` taken as given: the norm of each
        gradient by ``_foreach_norm`` (what get_total_norm uses on the CPU), then the norm of the stacked norms in
        ``order``."""
        found = []
        for n in self.order:
            if n in self.known:
                found.append((n, None))
            else:
                g = self.grad_of(n)
                if g is not None:
                    found.append((n, g))
        missing = [g for _, g in found if g is not None]
        computed = iter(torch._foreach_norm(missing, self.norm_type) if missing else ())
        norms = [self.known[n] if g is None else next(computed) for n, g in found]
        return torch.linalg.vector_norm(torch.stack(norms), self.norm_type)

    def clip(self, params: list[torch.Tensor]) -> None:
        """Scale these parameters' gradients by the iteration's clipping coefficient, in place."""
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, self.norm())


class StepGate:
    """One iteration's optimizer updates held until every gradient is in: what fp16's overflow check
    (``LossScaler``) and clipping by the global norm (``GradClip``) both need.

    A host step hands its update to ``defer(pack, update)``; ``finish``, after the last backward and once the
    host thread is drained, runs them in order, each with ``skip`` set when fp16 found an inf or nan; an update
    clips its gradients itself (``clip``) right before it steps. Under clipping every step op follows the last
    backward (passes/schedule.py), so a device step clips and steps in place; it never defers.
    """

    def __init__(self, scaler: LossScaler | None, clipper: GradClip | None):
        self.scaler, self.clipper = scaler, clipper
        self.deferred: list = []
        self.open = False            # between ``begin`` and ``finish``: updates wait

    def begin(self) -> None:
        if self.scaler is not None:
            self.scaler.begin()
        if self.clipper is not None:
            self.clipper.begin()
        self.deferred, self.open = [], True

    def defer(self, pack: int, update) -> None:
        """Queue ``update(skip: bool)``, ``pack``'s step, until every gradient has been checked."""
        self.deferred.append((pack, update))

    def clip(self, params: list[torch.Tensor]) -> None:
        """Clip these parameters' gradients by the global norm (nothing without clipping)."""
        if self.clipper is not None:
            self.clipper.clip([p for p in params if p.grad is not None])

    def finish(self, stepping) -> bool:
        """Run (or skip) the deferred updates in order, ``stepping(pack)`` before each; update the loss scale.
        True if the step was taken."""
        skip = self.scaler is not None and self.scaler.overflowed()
        updates, self.deferred, self.open = self.deferred, [], False
        for pack, update in updates:
            stepping(pack)
            update(skip)
        if self.scaler is not None:
            self.scaler.end(skip)
        return not skip

    def grad_norm(self) -> float | None:
        """The iteration's global gradient norm before clipping; None without clipping (or before it is known)."""
        return None if self.clipper is None or self.clipper.total is None else self.clipper.total.item()
