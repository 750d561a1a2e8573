"""Fake twins of a model's parameters and buffers: what the trace and the cost analysis run the model on, and
the fake run the cost analysis keeps (``FakeRun``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from harmony.runtime.precision import device_dtype


def fake_twin(t: torch.Tensor, mode: FakeTensorMode, dtype=None, batch_device=None) -> torch.Tensor:
    """A fake twin of a parameter or buffer as the device holds it (cast to the compute dtype if float).

    A model built without its weights (``harmony.empty_weights``: parameters on the meta device) and compiled to
    run has its twins on the batch's device, where the weights will be once compile has made them."""
    device = batch_device if t.device.type == "meta" and batch_device is not None else t.device
    if device_dtype(t, dtype) == t.dtype and device == t.device:
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=device_dtype(t, dtype), device=device)


def device_of_batch(batch) -> torch.device | None:
    return next((t.device for t in batch if isinstance(t, torch.Tensor)), None)


@contextlib.contextmanager
def fake_state_if_empty(module: torch.nn.Module, batch: tuple):
    """Where ``module`` was built without its weights (meta parameters): the block runs it on fake twins of its state
    on the batch's device, yielding ``(mode, fake batch)`` of one fake mode, so that every op sees the devices it will
    run on (a model that compares ``device.type`` takes the branch it will take) and nothing is computed; export
    takes them, and an eager check of the batch meets the model's errors, not the meta device's. Parameters stay
    Parameters (export wants them so; tied ones one object). Yields ``(None, batch)`` for any other model."""
    if not is_empty(module):
        yield None, batch
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    twins = fake_twins(state, mode, device_of_batch(batch))
    params: dict[int, torch.nn.Parameter] = {}
    for name, t in state.items():
        if isinstance(t, torch.nn.Parameter):
            twins[name] = params.setdefault(id(t), torch.nn.Parameter(twins[name], t.requires_grad))
    with _reparametrize_module(module, twins, tie_weights=True):
        yield mode, tuple(mode.from_tensor(t) for t in batch)


def fake_twins(state: dict, mode: FakeTensorMode, batch_device=None) -> dict:
    """``fake_twin`` of each named tensor; tied tensors (one object under two names) get one twin."""
    twins: dict[int, torch.Tensor] = {}
    for t in state.values():
        if id(t) not in twins:
            twins[id(t)] = fake_twin(t, mode, batch_device=batch_device)
    return {name: twins[id(t)] for name, t in state.items()}


def is_empty(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (built under ``harmony.empty_weights`` or
    ``torch.device("meta")``)."""
    return any(p.device.type == "meta" for p in model.parameters())


@dataclass
class FakeRun:
    """The fake values of one analysis run, kept so packs can be measured at the same microbatch size."""

    mode: FakeTensorMode
    vals: dict            # node -> fake value
    state: dict           # id(real parameter or buffer) -> its fake twin
    dtype: torch.dtype | None = None   # compute dtype of the twins and float inputs (None: as the model's)
