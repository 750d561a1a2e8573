"""Trace a model and its loss into one ``torch.fx.GraphModule``: the compiler's model graph.

The graph takes the batch and returns the scalar loss. It reads the user's own
parameter and buffer objects (the runtime trains them in place and the user
reads them back), and every node records the dotted path of the user module
that created it under ``node.meta[MODULE_PATH]``.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> batch = (torch.randn(2, 4), torch.tensor([0, 2]))
    >>> gm = trace(model, batch, loss_fn=torch.nn.CrossEntropyLoss())
    >>> [(n.name, module_path_of(n)) for n in gm.graph.nodes if n.op == "call_module"]
    [('_0', '0'), ('_1', '1'), ('_2', '2'), ('loss_fn', '')]
    >>> gm(*batch).shape
    torch.Size([])

Two front ends give the same kind of graph. ``"fx"`` is ``torch.fx.symbolic_trace``
at module level (``leaf_modules`` run as single ``call_module`` nodes); its
``node.meta["val"]`` comes from fake-tensor propagation on the example batch.
``"export"`` is ``torch.export.export(strict=False)``: aten-level, with the
batch dimension dynamic where the model allows it, so ``node.meta["val"]``
holds the batch size as a symbol. ``"auto"`` tries fx, then export.

``gm.parameters()`` and ``gm.buffers()`` are the model's own objects under the
model's names (tied weights once, plus any state of a ``loss_fn`` module).
Tensors a front end creates (export's lifted constants) are plain attributes
listed in ``gm.meta[TRACE_INFO].constants``. Buffers the forward updates in
place (BatchNorm statistics) are updated in the user's module when gm runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.nn.utils.stateless import _reparametrize_module

from harmony.base.errors import ConfigError, HarmonyError, TraceError
from harmony.compiler.fake import device_of_batch, fake_twins
from harmony.compiler.loss_weighting import counted
from harmony.compiler.meta import MODULE_PATH
from harmony.compiler.trace.batch import Batch, BatchForm
from harmony.compiler.trace.branches import Branches, record, replayed, replaying
from harmony.compiler.trace.effects import watch
from harmony.compiler.trace.errors import (
    data_dependent,
    eager_error,
    first_line,
    input_error,
    untraceable,
    user_stack,
)
from harmony.compiler.trace.export import export_graph, retarget, torch_output_held
from harmony.compiler.trace.functions import functions_kept
from harmony.compiler.trace.info import TraceInfo, sizes_of
from harmony.compiler.trace.inplace import InPlaceProxy, functionalize_inplace

__all__ = ["FRONTENDS", "MODULE_PATH", "TRACE_INFO", "TraceInfo", "module_path_of", "retarget", "trace"]

TRACE_INFO = "harmony.trace"  # gm.meta key (the graph module's, not a node's): a TraceInfo
FRONTENDS = ("auto", "fx", "export")

# Inside the traced wrapper the user's model is this attribute; its dotted
# paths are stripped of the prefix so that graph names match the user's names.
_MODEL = "model"
_LOSS = "loss_fn"


def module_path_of(node: torch.fx.Node) -> str:
    """Dotted path of the user module that created ``node`` ("" for top-level code)."""
    return node.meta.get(MODULE_PATH, "")


def trace(
    model: torch.nn.Module,
    example_batch: tuple | list | Mapping,
    *,
    loss_fn: Callable | None = None,
    leaf_modules: Sequence[type | str] = (),
    frontend: str = "auto",
    dtype: torch.dtype | None = None,
    items: torch.Tensor | None = None,
) -> torch.fx.GraphModule:
    """Trace one training step's forward, ``batch -> scalar loss``, into a GraphModule.

    ``example_batch`` is a tuple of tensors passed positionally, or a dict (any
    ``Mapping``) passed as keywords (placeholders follow its key order; call the
    graph positionally). Items that are not tensors (``use_cache=False``, an int,
    None, ...) are constants of the trace: the model is called with them fixed and
    they are no placeholders (``gm.meta[TRACE_INFO].form``).
    With ``loss_fn`` the last element is the target:
    ``loss = loss_fn(model(*batch[:-1]), batch[-1])``. Without it the model
    returns the loss, or an object with a ``.loss`` (a Hugging Face ``ModelOutput``).

    ``leaf_modules`` (classes, class names or module paths) run as single opaque
    nodes under the fx front end. The model is traced in training mode; its
    modules' modes are restored afterwards. ``dtype`` is the compute dtype the
    graph will run in (mixed precision): export records dtypes as constants, so it
    exports as if the float state and inputs were in it (``trace_export``); fx
    graphs read dtypes from their tensors and need nothing. ``items``: a last input, the loss's num_items_in_batch.

    Raises ``InputError`` when the batch does not fit the model and
    ``TraceError`` when the model cannot be captured (naming the source line).
    """
    if frontend not in FRONTENDS:
        raise ConfigError(f"frontend={frontend!r} is not one of {FRONTENDS}")
    _check_leaf_modules(model, leaf_modules, frontend)
    batch = Batch.of(model, example_batch, loss_fn)
    step, batch = counted(_train_step(model, loss_fn, batch), batch, items)
    start = time.perf_counter()
    notes: list[str] = []
    failures: dict[str, Exception] = {}
    with _training_mode(model):
        # a print or a counter in forward runs once, here: said (effects.py); a user's autograd.Function one node
        with watch(model, notes), functions_kept():
            raw, used = _front_ends(step, batch, leaf_modules, dtype, frontend, failures)
            if raw is None and any(data_dependent(e) for e in failures.values()):
                # a Python branch on a tensor's value: taken as on the example batch, checked per batch (branches.py)
                branches = record(step, batch.tensors)
                if branches:
                    failures.clear()
                    with replaying(branches):
                        raw, used = _front_ends(step, batch, leaf_modules, dtype, frontend, failures, branches)
                    notes += [f"a branch on tensor values is taken as the example batch took it and checked on "
                              f"every batch: {where}" for where in branches.checked]
        if raw is None:
            raise untraceable(model, step, batch, failures)
        if "fx" in failures:
            notes.append(f"torch.fx could not trace the model ({first_line(failures['fx'])}); used torch.export")
            if leaf_modules:
                notes.append("torch.export traces through leaf_modules; they are not single nodes")
        gm, constants = _rebuild(raw, model, step)
        if used == "fx":
            notes += _propagate_fake_values(gm, model, step, batch)
        if functionalize_inplace(gm):
            notes.append("in-place writes to activations run out of place (compiler/trace/inplace.py)")
    gm.meta[TRACE_INFO] = TraceInfo(used, time.perf_counter() - start, batch.names, constants, tuple(notes),
                                    sizes_of(gm, used, batch.tensors), 1 if used == "fx" else 2, batch.form)
    return gm


def _front_ends(step, batch: Batch, leaf_modules: Sequence, dtype, frontend: str, failures: dict,
                branches: Branches | None = None) -> tuple[torch.fx.GraphModule | None, str | None]:
    """The first front end's graph that captures the step, and its name; (None, None) and ``failures`` filled if
    none does."""
    for name in ("fx", "export") if frontend == "auto" else (frontend,):
        if branches is not None:
            branches.restart()
        try:
            return _FRONT_ENDS[name](step, batch, leaf_modules, dtype), name
        except HarmonyError:
            raise
        except Exception as error:  # any failure of a front end: try the next one
            failures[name] = error
    return None, None


# ------------------------------------------------------- the traced function


class _TrainStep(torch.nn.Module):
    """``model`` followed by its loss; subclassed per batch with a named ``forward``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, form: BatchForm):
        super().__init__()
        setattr(self, _MODEL, model)
        setattr(self, _LOSS, loss_fn)
        self.form = form

    def compute_loss(self, *tensors, **count):     # count: num_items_in_batch=, to the loss (loss_weighting.py)
        model, loss_fn = getattr(self, _MODEL), getattr(self, _LOSS)
        items = self.form.items(tensors)     # the batch's constants in their places, fixed in the trace
        inputs = items[:-1] if loss_fn is not None else items
        given = {} if loss_fn is not None else count
        if self.form.keyed:
            out = model(**dict(zip(self.form.names, inputs)), **given)
        else:
            out = model(*inputs, **given)
        if loss_fn is not None:
            return _checked_loss(loss_fn(out, items[-1], **count), "loss_fn returned")
        return _checked_loss(_select_loss(out, model), f"{type(model).__name__}.forward returned")


def _train_step(model: torch.nn.Module, loss_fn: Callable | None, batch: Batch) -> _TrainStep:
    # Both front ends name placeholders after forward's parameters, so the
    # forward of the traced root is generated with the batch's names.
    args = ", ".join(batch.names)
    source = f"def forward(self, {args}):\n    return self.compute_loss({args})\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<harmony train step>", "exec"), namespace)
    cls = type("TrainStep", (_TrainStep,), {"forward": namespace["forward"]})
    return cls(model, loss_fn, batch.form)


def _select_loss(out: Any, model: torch.nn.Module) -> Any:
    if isinstance(out, (torch.Tensor, torch.fx.Proxy)):
        return out
    if isinstance(out, Mapping) and out.get("loss") is not None:
        return out["loss"]
    if not isinstance(out, Mapping) and getattr(out, "loss", None) is not None:
        return out.loss
    hint = ""
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        hint = " (Hugging Face models return .loss only when the batch includes labels: pass a dict batch with them)"
    raise TraceError(
        f"{type(model).__name__}.forward returned {type(out).__name__}, not a scalar loss and without a .loss{hint}. "
        "Pass loss_fn=... to harmony.compile: the loss is then loss_fn(model(*batch[:-1]), batch[-1])."
    )


def _checked_loss(loss: Any, what: str) -> Any:
    if isinstance(loss, torch.fx.Proxy):  # checked after fake-tensor propagation
        return loss
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TraceError(
            f"{what} {shape}; training needs a scalar loss. Reduce it (e.g. .mean()) or pass loss_fn=... to "
            f"harmony.compile."
        )
    return loss


@contextlib.contextmanager
def _training_mode(model: torch.nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


# ------------------------------------------------------------- front ends


def _check_leaf_modules(model: torch.nn.Module, leaf_modules: Sequence, frontend: str) -> None:
    if not leaf_modules:
        return
    if frontend == "export":
        raise ConfigError("leaf_modules need the fx front end (frontend='fx' or 'auto'); torch.export traces "
                          "through them")
    known = set()
    for path, module in model.named_modules():
        cls = type(module)
        known |= {path, cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            continue
        if isinstance(leaf, str) and leaf in known:
            continue
        raise ConfigError(
            f"leaf_modules entry {leaf!r} is neither an nn.Module class nor a module path or class name in "
            f"{type(model).__name__}"
        )


class _LeafTracer(torch.fx.Tracer):
    """fx tracer that also keeps the user's ``leaf_modules`` as single call_module nodes."""

    def __init__(self, leaf_modules: Sequence[type | str]):
        super().__init__()
        self.leaf_classes = tuple(x for x in leaf_modules if isinstance(x, type))
        self.leaf_names = {x for x in leaf_modules if isinstance(x, str)}

    def is_leaf_module(self, module: torch.nn.Module, module_qualified_name: str) -> bool:
        path = _user_path(module_qualified_name)
        if path is not None:
            cls = type(module)
            names = {path, cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
            if isinstance(module, self.leaf_classes) or names & self.leaf_names:
                return True
        return super().is_leaf_module(module, module_qualified_name)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        taken = replayed(obj)            # a branch on a tensor's value recorded on the example batch (branches.py)
        return super().to_bool(obj) if taken is None else taken

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return InPlaceProxy(node, self)          # records x += y as a write (fx's own Proxy runs x = x + y)

    def create_node(self, *args, **kwargs) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:
            node.stack_trace = user_stack()
        return node


def _trace_fx(step: _TrainStep, batch: Batch, leaf_modules: Sequence, dtype) -> torch.fx.GraphModule:
    tracer = _LeafTracer(leaf_modules)     # records each node's source lines itself (``user_stack``)
    return torch.fx.GraphModule(step, tracer.trace(step))


def _trace_export(step: _TrainStep, batch: Batch, leaf_modules: Sequence, dtype) -> torch.fx.GraphModule:
    return export_graph(step, batch.tensors, dtype)


_FRONT_ENDS = {"fx": _trace_fx, "export": _trace_export}


# ------------------------------------------------------------- the graph


def _user_path(qualified_name: str) -> str | None:
    """Path inside the user's model of a name inside the train step, or None if outside it."""
    if qualified_name == _MODEL:
        return ""
    if qualified_name.startswith(_MODEL + "."):
        return qualified_name[len(_MODEL) + 1 :]
    return None


def _resolve(root: Any, path: str) -> Any:
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _rebuild(raw: torch.fx.GraphModule, model: torch.nn.Module,
             step: _TrainStep) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    """A plain GraphModule over the user's own state, named as in the user's model."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(raw.graph, {})
    graph.output(out[0] if isinstance(out, (tuple, list)) else out)

    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph(), class_name="TrainStep")
    installer = _Installer(gm, model)
    constants = []
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        obj, name = _resolve(raw, node.target), node.target
        path = _user_path(node.target)
        if path is not None:
            with contextlib.suppress(AttributeError):
                mine = _resolve(model, path)
                if isinstance(mine, type(obj)) or (isinstance(obj, torch.Tensor) and isinstance(mine, torch.Tensor)):
                    obj = mine  # the user's object, whatever the front end made of it
            name = path or _MODEL
        node.target = installer.install(name, obj)
        if isinstance(obj, torch.Tensor) and not installer.is_state(obj):
            constants.append(node.target)
    # State the forward never reads still belongs to the model (the runtime and
    # checkpoints see all of it).
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if not installer.holds(tensor):
            installer.install(name, tensor)

    _sink_attributes(graph)
    _assign_module_paths(graph, model)
    for node in graph.nodes:  # names read as the user's: "h_0_attn_c_attn_weight", not "model_h_0_..."
        if node.op in ("get_attr", "call_module") and node.name.startswith(_MODEL + "_"):
            node._rename(node.target.replace(".", "_"))
    gm.graph = graph
    gm.graph.lint()
    gm.recompile()
    return gm, tuple(dict.fromkeys(constants))


class _Installer:
    """Puts objects on the GraphModule under dotted names without touching the user's modules."""

    def __init__(self, gm: torch.fx.GraphModule, model: torch.nn.Module):
        self.gm = gm
        self.created = {id(gm)}  # modules made here; only these are modified
        self.buffer_persistence: dict[int, bool] = {}
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    self.buffer_persistence[id(buffer)] = name not in module._non_persistent_buffers_set
        self.parameter_ids = {id(p) for p in model.parameters()}
        self.held: set[int] = set()

    def is_state(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.parameter_ids or id(tensor) in self.buffer_persistence

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.held

    def install(self, name: str, obj: Any) -> str:
        installed = self._try(name, obj)
        if installed is None:  # name taken or inside a user module: put it at the top
            base = "_harmony_" + name.replace(".", "_")
            candidate, i = base, 0
            while hasattr(self.gm, candidate):
                i += 1
                candidate = f"{base}_{i}"
            installed = self._try(candidate, obj)
        self.held.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            self.held |= {id(t) for t in [*obj.parameters(), *obj.buffers()]}
        return installed

    def _try(self, name: str, obj: Any) -> str | None:
        *parents, leaf = name.split(".")
        owner: torch.nn.Module = self.gm
        for part in parents:
            child = owner._modules.get(part)
            if child is None:
                if id(owner) not in self.created or hasattr(owner, part):
                    return None
                child = torch.nn.Module()
                owner.add_module(part, child)
                self.created.add(id(child))
            owner = child
        existing = getattr(owner, leaf, None)
        if existing is obj:
            return name
        if existing is not None or hasattr(owner, leaf) or id(owner) not in self.created:
            return None
        if isinstance(obj, torch.nn.Module):
            owner.add_module(leaf, obj)
        elif isinstance(obj, torch.nn.Parameter):
            owner.register_parameter(leaf, obj)
        elif isinstance(obj, torch.Tensor) and id(obj) in self.buffer_persistence:
            owner.register_buffer(leaf, obj, persistent=self.buffer_persistence[id(obj)])
        else:  # constants are plain attributes so that gm.buffers() is exactly the model's
            object.__setattr__(owner, leaf, obj)
        return name


def _sink_attributes(graph: torch.fx.Graph) -> None:
    """Move each get_attr to just before its first user, so packs cut by position own their weights."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if not node.users:
            graph.erase_node(node)
            continue
        min(node.users, key=order.__getitem__).prepend(node)


def _assign_module_paths(graph: torch.fx.Graph, model: torch.nn.Module) -> None:
    valid = {path for path, _ in model.named_modules(remove_duplicate=False)}
    order = {node: i for i, node in enumerate(graph.nodes)}
    # Reverse order: a node made by the tracer rather than by a module (export's
    # attributes and batch sizes) takes the path of its first user, already known.
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        path = _innermost_user_path(node.meta.get("nn_module_stack") or {}, valid)
        if path is None:
            first_user = min(node.users, key=order.__getitem__, default=None)
            path = module_path_of(first_user) if first_user is not None else ""
        node.meta[MODULE_PATH] = path


def _innermost_user_path(stack: Mapping, valid: set[str]) -> str | None:
    """The user's module for a ``nn_module_stack``; "" for the loss; None for nodes the tracer made."""
    qualified = list(stack.values())[-1][0] if stack else ""
    path = _user_path(qualified)
    if path is None:  # the loss is top-level code; anything else (the step, export's placeholder stacks) is not
        return "" if qualified == _LOSS or qualified.startswith(_LOSS + ".") else None
    while path and path not in valid:  # tolerate front-end spellings; keep the longest real prefix
        path = path.rpartition(".")[0]
    return path


# ------------------------------------------------------ checks and errors


def _propagate_fake_values(gm: torch.fx.GraphModule, model: torch.nn.Module, step: _TrainStep,
                           batch: Batch) -> list[str]:
    """Fill node.meta["val"] for an fx graph and check the batch fits the model (fake tensors: no compute, no side
    effects)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = dict(gm.named_parameters(remove_duplicate=False)) | dict(gm.named_buffers(remove_duplicate=False))
    device = device_of_batch(batch.tensors)
    fake_state = fake_twins(state, mode, device)
    try:
        # Fake copies of the state take in-place updates (BatchNorm statistics) away from the user's tensors.
        with _reparametrize_module(gm, fake_state, tie_weights=True), torch_output_held():
            FakeTensorProp(gm, mode).propagate(*batch.tensors)
    except Exception as error:
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
        eager = eager_error(step, batch)
        if eager is not None:
            raise input_error(model, batch, eager)
        return [f"fake tensors could not run the graph ({first_line(error)}); node.meta['val'] is not set"]
    what = "loss_fn returned" if batch.has_target else f"{type(model).__name__}.forward returned"
    _checked_loss(gm.graph.output_node().args[0].meta["val"], what)
    return []
