"""Mixed precision: the compute dtype of device copies, and dynamic loss scaling for fp16.

With ``precision="bf16"`` or ``"fp16"`` the device holds compute copies of the float
parameters and buffers in that dtype (2 bytes each), the activations and gradients the
packs make on it are in that dtype too, and the host keeps the fp32 master weights the
optimizer steps, with fp32 gradients and fp32 optimizer state (ZeRO-Offload). Where the
bytes are made:

- ``swap_in`` of parameters casts the fp32 master into a new device copy (``TieredState.fetch``);
  the master is never on the device, and the copy is dropped, not written back, on release;
- gradients accumulate over the microbatches in the compute dtype on the device, by
  autograd, exactly as an eager model cast to that dtype accumulates them; they leave the
  device in that dtype and become fp32 on the host right before the pack's step
  (``master_grads``);
- float batch tensors are cast on ``load_batch``; integer ones (token ids) are not.

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


def master_grads(params) -> None:
    """Give each parameter an fp32 gradient (its master's dtype) from the compute-dtype one, on the host."""
    for p in params:
        if p.grad is not None and p.grad.dtype != p.dtype:
            p.grad = p.grad.to(p.dtype)


class LossScaler:
    """Dynamic loss scaling for one runtime, as ``torch.amp.GradScaler`` does it.

    Per iteration: ``begin()``; the loss seed of backward is ``scale_loss(loss)``; each
    pack's host step calls ``unscale`` on its fp32 gradients and hands its update to
    ``defer``; ``finish()``, after the last backward, runs the deferred updates only if no
    gradient was inf or nan, and updates the scale with ``torch._amp_update_scale_``.
    The updates wait for the last gradient because one overflow anywhere skips the whole
    step: fp16 gives up overlapping the host steps with backward (bf16 keeps it).
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.found_inf = torch.zeros(1)
        self.inv_scale = torch.ones(1)
        self.deferred: list = []
        self.skipped = 0            # iterations whose update was skipped for an inf/nan gradient

    def begin(self) -> None:
        self.found_inf = torch.zeros(1)
        self.inv_scale = self.scale.double().reciprocal().float()
        self.deferred = []

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide fp32 gradients by the scale in place, noting any inf or nan (GradScaler.unscale_'s kernel)."""
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.inv_scale)

    def defer(self, update) -> None:
        """Queue ``update(skip: bool)``, a pack's step, until every gradient has been checked."""
        self.deferred.append(update)

    def finish(self) -> bool:
        """Run (or skip) the deferred updates in order and update the scale; True if the step was taken."""
        skip = bool(self.found_inf.item())
        updates, self.deferred = self.deferred, []
        for update in updates:
            update(skip)
        self.skipped += skip
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        return not skip

    def state_dict(self) -> dict:
        """What a resumed run needs (plain numbers: checkpoints keep it in their JSON manifest)."""
        return dict(scale=self.scale.item(), growth_tracker=int(self.growth_tracker.item()), skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.skipped = int(state.get("skipped", 0))
