"""Models built without their weights: ``harmony.empty_weights()``, and their parameters filled as compile places them.

>>> with harmony.empty_weights():          # parameters on the meta device: no memory, no initialisation
...     model = GPT(GPTConfig(layers=72, width=2048))
>>> sm = harmony.compile(model, batch, memory_budget="2GiB", host_memory_budget="8GiB")

Built the usual way, a model holds all of its fp32 weights in host memory before compile has placed a byte: a model
whose weights exceed host memory cannot even be built, and one that fits still takes its whole weights out of the
host budget until the packs on disk are written. Built under ``empty_weights()``, its parameters are shapes only
(its buffers are made as usual: they are small, and some, such as rotary frequencies, are computed in ``__init__``
and cannot be recomputed). ``harmony.compile`` plans it on fake tensors as any model, then fills it as it places it:
the parameters of packs kept in host memory before the runtime starts, those of packs wholly on disk a group at a
time as their files are written, and under ``shard_state="full"`` (ZeRO-3) each pack's right before the rank cuts its
chunks of them (runtime/partitioned.Shares), the rest dropped before the next pack is made. The host never holds more
than its share of the plan and one disk group or one pack beside it (DeepSpeed's ``zero.Init`` does the latter for
ZeRO-3 ranks).

How a module's own parameters are filled: compile's ``init(module)`` where given; else the model's
``_init_weights(module)`` (Hugging Face models and the built-in GPT have one), with the module's
``reset_parameters()`` for what that leaves unfilled; else ``reset_parameters()``. Each module is filled under a
generator seeded with the process's seed (``torch.initial_seed()``, what ``torch.manual_seed`` set) and the module's
name, so the weights are the same whatever the plan, the budget, the order the packs are filled in or the pipeline
rank that fills them, and the process's random stream is left as it was. They are not the numbers an eager
construction of the model draws; ``harmony.materialize(model)`` fills an empty model in place the same way compile
does (to compare with, or to use the model without Harmony). Data-parallel ranks fill alike when they are seeded
alike, as any data-parallel run must be.

Parameters are filled with NaN before their init runs and checked after it: one left unfilled is a ``ConfigError``
naming it, raised before the step could train on garbage.

The init is called on the modules that own parameters, one at a time (a tied weight belongs to the first module that
holds it). The model's ``_init_weights`` then runs on each module above it, nearest first, as Hugging Face's
``init_weights`` (``Module.apply``: children before parents) reaches them, with every other real parameter under that
module standing in as a meta tensor (``Filler._only``): an init that reaches from a parent into its children's
parameters (GPT-2's scaled ``c_proj`` from ``GPT2MLP``, T5's feed-forward weights from ``T5DenseActDense``) draws
them for the module being filled, from its own generator, whatever was filled before. A user's ``init`` is called
on the owning modules only.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import time

import torch
import torch.nn as nn

from harmony.base.errors import ConfigError, InputError
from harmony.compiler.fake import is_empty
from harmony.runtime.placeholders import take

__all__ = ["Filler", "empty_weights", "from_state_dict", "is_empty", "materialize", "module_seed"]

_patch = threading.Lock()


@contextlib.contextmanager
def empty_weights():
    """Modules built inside get their parameters on the meta device (no memory, no init); buffers as usual."""
    register = nn.Module.register_parameter

    def register_empty(module, name, param):
        register(module, name, param)
        param = module._parameters[name]
        if param is not None and param.device.type != "meta":
            # the init that runs next in the module's __init__ (reset_parameters) then costs nothing
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    with _patch:
        nn.Module.register_parameter = register_empty
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def materialize(model: nn.Module, init=None, seed: int | None = None) -> nn.Module:
    """Fill every parameter of ``model`` left on the meta device, in host memory, as ``harmony.compile`` fills them
    (the module docstring); returns ``model``."""
    filler = Filler(model, init, seed)
    filler.fill(list(model.parameters()))
    return model


def from_state_dict(model: nn.Module, state_dict) -> "callable":
    """An ``init`` that fills each module's parameters from ``state_dict`` (by the model's names) instead of drawing
    them: a pretrained checkpoint read a module at a time as compile places it. With ``torch.load(path, mmap=True,
    weights_only=True)`` the checkpoint stays in its file and the host holds one module of it at a time.

    >>> init = harmony.from_state_dict(model, torch.load("model.pt", mmap=True, weights_only=True))
    >>> sm = harmony.compile(model, batch, memory_budget="2GiB", init=init)
    """
    names = {id(m): n for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        prefix = names[id(module)]
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if key not in state_dict:
                raise ConfigError(f"from_state_dict: the state dict has no {key!r} for the model's parameter of that "
                                  f"name ({len(state_dict)} keys, e.g. {next(iter(state_dict), None)!r}); give the "
                                  f"state dict of this model (model.state_dict()'s names)")
            value = state_dict[key]
            if tuple(value.shape) != tuple(p.shape):
                raise ConfigError(f"from_state_dict: {key!r} is {list(value.shape)} in the state dict and "
                                  f"{list(p.shape)} in the model")
            p.copy_(value)
    return init


def module_seed(seed: int, name: str) -> int:
    """The seed a module is filled under: the process's seed and the module's name, mixed (never the order)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Filler:
    """Fills an empty model's parameters a module at a time, on demand (``fill``)."""

    def __init__(self, model: nn.Module, init=None, seed: int | None = None):
        self.model = model
        self.init = init
        self.seed = torch.initial_seed() if seed is None else seed
        self.owner: dict[int, tuple[str, nn.Module]] = {}    # id(param) -> the first module that holds it
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                if p.device.type == "meta":
                    self.owner.setdefault(id(p), (name, module))
        self.filled = 0           # bytes filled so far
        self.stand_ins: dict[int, nn.Parameter] = {}     # meta twins of filled parameters, while another module inits
        self.seconds = 0.0        # spent filling them
        self._check()

    def _check(self) -> None:
        """Refuse, before anything is made, a model whose empty state cannot be filled."""
        meta = [n for n, b in self.model.named_buffers() if b.device.type == "meta"]
        if meta:
            raise InputError(f"{len(meta)} buffers of the model are on the meta device (first: {meta[0]}), and a "
                             f"buffer's value cannot be made again once its module is built: build the model under "
                             f"harmony.empty_weights(), which leaves buffers real and only parameters empty")
        if self.init is not None or callable(getattr(self.model, "_init_weights", None)):
            return
        bare = sorted({f"{name or 'the model'} ({type(m).__name__})" for name, m in self.owner.values()
                       if not callable(getattr(m, "reset_parameters", None))})
        if bare:
            raise ConfigError(f"the model was built without its weights (meta), and {len(bare)} modules that hold "
                              f"parameters have no reset_parameters() to fill them (first: {bare[0]}); pass "
                              f"init=fn to harmony.compile, fn(module) filling the module's own parameters, or give "
                              f"the model an _init_weights(module) method")

    def fill(self, params) -> None:
        """Fill the modules that own ``params`` (Parameter objects) where they are still empty."""
        t0 = time.perf_counter()
        try:
            self._fill(params)
        finally:
            self.seconds += time.perf_counter() - t0

    def _fill(self, params) -> None:
        for p in params:
            if p.device.type != "meta":
                continue
            if id(p) not in self.owner:
                raise ConfigError(f"a parameter of shape {tuple(p.shape)} on the meta device is not the model's (a "
                                  f"loss_fn module's?): build only the model under harmony.empty_weights()")
            self._fill_module(*self.owner[id(p)])

    def _fill_module(self, name: str, module: nn.Module) -> None:
        # a weight tied into several modules is its first module's: filled there whichever module asks first
        empty = [(n, p) for n, p in module.named_parameters(recurse=False)
                 if p.device.type == "meta" and self.owner[id(p)][1] is module]
        for _, p in empty:     # the same Parameter objects, now in host memory (the graph and optimizers hold them)
            take(p, torch.full(p.shape, float("nan"), dtype=p.dtype) if p.is_floating_point()
                 else torch.zeros(p.shape, dtype=p.dtype))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            if self.init is not None:
                self.init(module)
            else:
                own = getattr(self.model, "_init_weights", None)
                mine = {id(p) for _, p in empty}
                if callable(own):
                    with self._only(module, mine):
                        own(module)
                reset = getattr(module, "reset_parameters", None)
                if callable(reset) and (own is None or _unfilled(empty)):
                    reset()
                for parent in self._ancestors(name) if callable(own) else ():
                    with self._only(parent, mine):    # as Hugging Face's init() reaches it: children first
                        own(parent)
        left = _unfilled(empty)
        if left:
            how = "init" if self.init is not None else "its _init_weights and reset_parameters"
            where = f"{name}.{left[0]}" if name else left[0]
            raise ConfigError(f"{where} ({type(module).__name__}) was left unfilled by {how} (it still holds the NaN "
                              f"it was made with): pass init=fn to harmony.compile that fills every parameter of "
                              f"such a module, e.g. with torch.nn.init")
        self.filled += sum(p.numel() * p.element_size() for _, p in empty)


    def _ancestors(self, name: str) -> list[nn.Module]:
        """The modules above ``name``, the nearest first, the model last (the order ``Module.apply`` reaches them)."""
        parts = name.split(".") if name else []
        return [self.model.get_submodule(".".join(parts[:i])) for i in reversed(range(len(parts)))]

    @contextlib.contextmanager
    def _only(self, target: nn.Module, keep: set[int]):
        """While an init runs on ``target``: every real parameter under it but ``keep``'s (by id) stands in as a meta
        tensor of its shape, which an init draws nothing for, so the module being filled gets the draws an
        ancestor's init makes for it (GPT-2's scaled ``c_proj``, T5's feed-forward) whatever was filled before."""
        swapped = []
        for mod in target.modules():
            for key, p in mod._parameters.items():
                if p is not None and id(p) not in keep and p.device.type != "meta":
                    swapped.append((mod, key, p))
        for mod, key, p in swapped:
            stand_in = self.stand_ins.get(id(p))
            if stand_in is None:
                stand_in = self.stand_ins[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                requires_grad=p.requires_grad)
            mod._parameters[key] = stand_in
        try:
            yield
        finally:
            for mod, key, p in swapped:
                mod._parameters[key] = p


def _unfilled(params) -> list[str]:
    return [n for n, p in params if p.is_floating_point() and bool(torch.isnan(p).any())]

