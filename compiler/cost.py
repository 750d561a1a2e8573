"""Cost model: bytes and FLOPs of every node, measured without real memory, symbolic in the batch size.

Each node of the model graph is run under ``FakeTensorMode`` twice, at two
microbatch sizes; every quantity is linear in the batch size ``B`` for the
models we train (attention is quadratic in sequence length, not in batch), so two
measurements give exact affine expressions ``c0 + c1*B`` (sympy via ``.expr``).

>>> gm = trace(model, batch); annotate(gm, batch, microbatch=4)
>>> gm.graph.nodes[5].meta["harmony.cost"].out_bytes.expr
524288*B
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from harmony.base.errors import InputError
from harmony.compiler import measured
from harmony.compiler.fake import FakeRun, device_of_batch, fake_twin
from harmony.compiler.meta import COST, STATE
from harmony.compiler.signature import Unknown, describe, getattr_path, graph_signature, module_signature
from harmony.compiler.trace.inplace import inplace_error
from harmony.runtime.precision import device_dtype
from harmony.runtime.tiers.memory import CountAllocations, MemoryMeter

B = sympy.Symbol("B", positive=True, integer=True)


def _register_cpu_attention_flops():
    """torch counts the CUDA attention kernels but not the CPU one: count it the same way."""
    from torch.utils import flop_counter as fcm
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or fwd.default in fcm.flop_registry:
        return

    @fcm.register_flop_formula(fwd)
    def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fcm.sdpa_flop_count(query_shape, key_shape, value_shape)

    if bwd is not None:
        @fcm.register_flop_formula(bwd)
        def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fcm.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_flops()


@dataclass(frozen=True)
class Affine:
    """``c0 + c1 * B``: a byte or FLOP count as a function of the microbatch size ``B``."""

    c0: float
    c1: float

    def at(self, b: int) -> float:
        return self.c0 + self.c1 * b

    @property
    def expr(self) -> sympy.Expr:
        return sympy.nsimplify(round(self.c0)) + sympy.nsimplify(round(self.c1)) * B

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.c0 + other.c0, self.c1 + other.c1)

    @staticmethod
    def fit(b1: int, v1: float, b2: int, v2: float) -> "Affine":
        c1 = (v2 - v1) / (b2 - b1)
        return Affine(v1 - c1 * b1, c1)



@dataclass(frozen=True)
class NodeCost:
    """What one node of the model graph costs. Bytes are of new storages the node allocates."""

    out_bytes: Affine          # the node's outputs
    saved_bytes: Affine        # new tensors autograd keeps for backward (may include the output)
    saves_output: bool         # the output itself is kept for backward
    saved_inputs: tuple        # positions in node.all_input_nodes whose values backward keeps
    fwd_extra: Affine          # transient bytes above what survives the node, during forward
    bwd_peak: Affine           # bytes the node's backward allocates at its peak (grads + temporaries)
    fwd_flops: Affine
    bwd_flops: Affine
    alias_of: int | None = None  # position in node.all_input_nodes whose storage the output shares (a view)
    mutates: tuple = ()        # buffers the node writes in place (BatchNorm running stats)
    random: bool = False       # draws random numbers (dropout): recompute must replay the RNG


_RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "multinomial")


def state_names(gm: torch.fx.GraphModule) -> dict[int, str]:
    """id(tensor) -> canonical name, for every parameter and buffer (a tied tensor gets its first name)."""
    names: dict[int, str] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        names.setdefault(id(t), name)
    return names


def _node_state(gm, node, names) -> tuple:
    if node.op == "get_attr":
        t = getattr_path(gm, node.target)
        return (names[id(t)],) if isinstance(t, torch.Tensor) and id(t) in names else ()
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        ts = list(mod.parameters()) + list(mod.buffers())
        return tuple(dict.fromkeys(names[id(t)] for t in ts))
    return ()


class Writes(TorchDispatchMode):
    """Records the storages every op writes in place, from the op schemas (``Tensor(a!)`` arguments)."""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    # ops that update running statistics without saying so in their schema: (training flag, written args)
    UNANNOTATED = {"aten::native_batch_norm": (5, (3, 4)), "aten::cudnn_batch_norm": (5, (3, 4)),
                   "aten::miopen_batch_norm": (5, (3, 4))}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        for arg, value in zip(func._schema.arguments, values):
            if arg.alias_info is not None and arg.alias_info.is_write:
                self.written.update(id(t.untyped_storage()) for t in tensors_of(value))
        if func._schema.name in self.UNANNOTATED:
            flag, written = self.UNANNOTATED[func._schema.name]
            if values[flag]:
                self.written.update(id(t.untyped_storage()) for i in written for t in tensors_of(values[i]))
        return func(*args, **kwargs)


class _Measure(torch.fx.Interpreter):
    """Runs the graph on fake tensors and records, per node, bytes, FLOPs and saved tensors."""

    def __init__(self, gm, state_ids, reuse: dict | None = None):
        super().__init__(gm, garbage_collect_values=False)
        self.state_ids = state_ids  # storage ids of fake parameters and buffers
        self.records = {}
        self.vals = {}   # node -> its fake output value, at this microbatch size
        self.reuse = reuse          # signature -> the record of a node measured before (None: measure every node)
        self.signatures = {}        # node -> its signature (None: it has none), where ``reuse`` is given
        self.current = None         # the node running (errors name it)

    def run_node(self, n):
        self.current = n
        if n.op in ("placeholder", "output", "get_attr"):
            self.vals[n] = super().run_node(n)
            return self.vals[n]
        key = self.signatures[n] = self._signature(n) if self.reuse is not None else None
        if key is not None and key in self.reuse:     # the same op on the same kind of inputs: run it, no measuring
            # its inputs as they are, not detached as ``_measure`` detaches them: the outputs' storages, aliases and
            # gradient flags are the same either way, and a fake detach costs more than the op's autograd record
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = self.vals[n] = getattr(self, n.op)(n.target, args, kwargs)
            self.records[n] = dict(self.reuse[key])
            return out
        try:
            out = self._measure(n, real=False)
            if key is not None and not self.records[n]["mutates"]:   # buffers written are named per node
                self.reuse[key] = self.records[n]
        except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode):
            # a leaf module that branches on data cannot run on fake tensors: measure it once on zeros
            with unset_fake_temporarily():
                out = self._measure(n, real=True)
            out = tree_map_only(torch.Tensor, lambda t: self.mode.from_tensor(t.detach()).requires_grad_(
                t.requires_grad), out)
        self.vals[n] = out
        return out

    def _signature(self, n) -> tuple | None:
        """Everything a node's measurement depends on, or None where that cannot be told (it is then measured):
        the op (a function, a method name, or a leaf module as ``signature.module_signature`` sees it) and its
        arguments as ``signature.describe`` sees them. The 24 blocks of a GPT are then measured once, the other 23
        only run."""
        inputs = {a: i for i, a in enumerate(n.all_input_nodes)}
        storages: dict = {}

        def node(a):
            return inputs[a], describe(self.env[a], node, storages, self._is_state)
        try:
            op = module_signature(self.module.get_submodule(n.target)) if n.op == "call_module" else n.target
            return n.op, op, describe((tuple(n.args), dict(n.kwargs)), node, storages, self._is_state)
        except Unknown:
            return None

    def _is_state(self, storage_id: int) -> bool:
        return storage_id in self.state_ids or storage_id in self.real_state_ids

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(t.shape), dtype=t.dtype).requires_grad_(t.requires_grad)

    def _call(self, n, args, kwargs, real: bool):
        if not real or n.op != "call_module":
            return getattr(self, n.op)(n.target, args, kwargs)
        mod = self.module.get_submodule(n.target)
        state = {k: self.real_of[id(v)].to(v.dtype)    # the compute dtype's twin under mixed precision
                 for k, v in list(mod.named_parameters()) + list(mod.named_buffers())}
        return torch.func.functional_call(mod, state, args, kwargs)

    def _measure(self, n, real: bool):
        inputs = [self.env[a] for a in n.all_input_nodes]
        if real:
            inputs = [tree_map_only(torch.Tensor, self._real, t) for t in inputs]
        in_storages = {id(s.untyped_storage()) for s in tensors_of(inputs)}
        saved = {}

        def pack(t):
            saved.setdefault(id(t.untyped_storage()), t)
            return t

        meter = MemoryMeter("analysis")
        writes = Writes()
        # detached inputs keep the node's autograd graph local, so its backward is measured alone
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if real:
            swap = {id(a): r for a, r in zip(tensors_of([self.env[a] for a in n.all_input_nodes]), tensors_of(inputs))}
            args, kwargs = tree_map_only(torch.Tensor, lambda t: swap.get(id(t), t), (args, kwargs))
        leaves = {}

        def shared_leaf(t):
            return leaves.setdefault(id(t), leaf(t))
        args, kwargs = tree_map_only(torch.Tensor, shared_leaf, (args, kwargs))
        inputs = [tree_map_only(torch.Tensor, shared_leaf, t) for t in inputs]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with FlopCounterMode(display=False) as fc, CountAllocations(meter), writes:
                out = self._call(n, args, kwargs, real)
        fwd_flops = fc.get_total_flops()
        outs = list(tensors_of(out))
        out_ids = {id(t.untyped_storage()) for t in outs}
        out_bytes = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in outs
                         if id(t.untyped_storage()) not in in_storages}.values())
        saved_new = {k: t for k, t in saved.items() if k not in in_storages and not self._is_state(k)}
        saved_bytes = sum(t.untyped_storage().nbytes() for t in saved_new.values())
        alias_of = next((i for i, a in enumerate(inputs) for t in tensors_of(a)
                         if id(t.untyped_storage()) in out_ids), None)
        saved_inputs = tuple(i for i, a in enumerate(inputs)
                             if any(id(t.untyped_storage()) in saved for t in tensors_of(a)))
        survivors = meter.live
        fwd_extra = max(0, meter.peak - survivors)
        own = list(self.module.get_submodule(n.target).parameters()) if n.op == "call_module" else []
        if real:
            own = [self.real_of[id(p)] for p in own]
        bwd_peak, bwd_flops = self._backward(inputs, outs, own)
        mutated = tuple(name for name, t in self.state_bufs if id(t.untyped_storage()) in writes.written)
        random = any(r in str(getattr(n.target, "__name__", n.target)).lower() for r in _RANDOM_OPS)
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            random = random or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mod.modules())
        self.records[n] = dict(out_bytes=out_bytes, saved_bytes=saved_bytes,
                               saves_output=bool(out_ids & saved_new.keys()),
                               saved_inputs=saved_inputs, alias_of=alias_of, fwd_extra=fwd_extra, bwd_peak=bwd_peak,
                               fwd_flops=fwd_flops, bwd_flops=bwd_flops, mutates=mutated, random=random)
        return out

    def _backward(self, inputs, outs, own_params):
        outs = [t for t in outs if t.requires_grad and t.grad_fn is not None]
        wrt = [t for t in tensors_of(inputs) if t.requires_grad]
        wrt += [p for p in own_params if p.requires_grad and not any(p is w for w in wrt)]
        if not outs or not wrt:
            return 0, 0
        meter = MemoryMeter("analysis-bwd")
        with FlopCounterMode(display=False) as fc, CountAllocations(meter):
            grads = [torch.ones_like(t) for t in outs]
            torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)
        return meter.peak, fc.get_total_flops()


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A float tensor detached into a leaf that needs a gradient where ``t`` did; others as they are."""
    return t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t


def tensors_of(tree):
    """The tensors in a nested structure of arguments or results."""
    return (t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _resize(t: torch.Tensor, batch: int, mode: FakeTensorMode, dtype=None) -> torch.Tensor:
    shape = (batch,) + tuple(t.shape[1:]) if t.dim() else ()
    with mode:
        out = torch.empty(shape, dtype=device_dtype(t, dtype), device=t.device)
    return out


def _measure_at(gm, batch, b, dtype=None, reuse: dict | None = None):
    mode = FakeTensorMode(allow_non_fake_inputs=True)   # constants the tracer lifted (GPT-2 masks) are real
    fake_state = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        fake_state[name] = fake_twin(t, mode, dtype, device_of_batch(batch))
        if isinstance(t, torch.nn.Parameter):
            fake_state[name].requires_grad_(t.requires_grad)
    # tied tensors must stay one tensor under the fake mode too
    by_id = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), fake_state[name])
        fake_state[name] = by_id[id(t)]
    inputs = [_resize(t, b, mode, dtype) for t in batch]
    interp = _Measure(gm, {id(t.untyped_storage()) for t in fake_state.values()}, reuse)
    interp.mode = mode
    reals = list(gm.parameters()) + list(gm.buffers())
    interp.real_of = {id(by_id[id(t)]): t for t in reals}
    interp.real_state_ids = {id(t.untyped_storage()) for t in reals}
    bufs = dict(gm.named_buffers())
    interp.state_bufs = [(n, by_id[id(t)]) for n, t in bufs.items()]
    with mode, _reparametrize_module(gm, fake_state, tie_weights=True):
        try:
            interp.run(*inputs)
        except Exception as e:  # noqa: BLE001 - a shape mismatch surfaces here first
            if (planned := inplace_error(interp.current, e)) is not None:
                raise planned from e
            raise InputError(f"the example batch does not fit the model at microbatch size {b}: "
                             f"{type(e).__name__}: {e}. Check that every batch tensor has the batch "
                             f"in dimension 0 and the shapes the model expects.") from e
    return interp.records, FakeRun(mode, interp.vals, by_id, dtype), interp.signatures


def annotate(gm: torch.fx.GraphModule, batch: tuple, microbatch: int, dtype: torch.dtype | None = None,
             reuse: bool = True) -> FakeRun:
    """Write a ``NodeCost`` (key ``harmony.cost``) and the state it reads (``harmony.state``) on every node.

    Measures at microbatch sizes ``microbatch`` and ``2 * microbatch``; returns the fake run
    at ``microbatch`` (``pack_cost.measure_pack`` reuses it). ``dtype`` (mixed precision): float
    parameters, buffers and inputs are measured as the device holds them, in that dtype. ``reuse``: a node
    whose op and inputs look like those of one measured before, in this compile or an earlier one of the process,
    takes its figures (``_Measure._signature``, ``compiler/measured.py``), and a graph like one annotated before
    (``signature.graph_signature``) is not run at the second size at all; False measures every node.
    """
    names = state_names(gm)
    b1, b2 = microbatch, 2 * microbatch
    r1, run, signatures = _measure_at(gm, batch, b1, dtype, measured.NODES if reuse else None)
    whole = graph_signature(gm, signatures, b2) if reuse else None
    if whole is not None and whole in measured.GRAPHS:     # the same graph at the same sizes: no second run
        by_position = list(gm.graph.nodes)
        r2 = {by_position[i]: dict(record) for i, record in measured.GRAPHS[whole]["records"]}
    else:
        r2, _, _ = _measure_at(gm, batch, b2, dtype, measured.NODES if reuse else None)
        if whole is not None:
            at = {n: i for i, n in enumerate(gm.graph.nodes)}
            measured.GRAPHS[whole] = {"records": tuple((at[n], dict(r)) for n, r in r2.items())}
    for node in gm.graph.nodes:
        node.meta[STATE] = _node_state(gm, node, names)
        if node not in r1:
            continue
        a, b = r1[node], r2[node]

        def fit(k):
            return Affine.fit(b1, a[k], b2, b[k])

        node.meta[COST] = NodeCost(
            out_bytes=fit("out_bytes"), saved_bytes=fit("saved_bytes"), saves_output=a["saves_output"],
            saved_inputs=a["saved_inputs"], alias_of=a["alias_of"], fwd_extra=fit("fwd_extra"),
            bwd_peak=fit("bwd_peak"),
            fwd_flops=fit("fwd_flops"), bwd_flops=fit("bwd_flops"), mutates=a["mutates"], random=a["random"])
    return run


def optimizer_profile(optimizer: type, kwargs: dict) -> dict:
    """Optimizer-state bytes per parameter byte, and the step's transient bytes, measured on real tensors.

    Steps over one, two and three equal tensors tell a for-loop implementation (temporaries
    of the largest tensor, plus one left over from the tensor before) from a foreach or
    fused one (temporaries of every tensor at once).
    """
    n = 3000

    def measure(count, n=n):
        ps = [torch.nn.Parameter(torch.zeros(n)) for _ in range(count)]
        opt = optimizer(ps, **kwargs)
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt.step()                      # creates the state
        state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        meter = MemoryMeter("optimizer")
        with CountAllocations(meter):
            opt.step()
        return state, meter.peak / (4 * n)

    state, one = measure(1)
    double, _ = measure(1, 2 * n)      # state = a * bytes + c per tensor (Adam's step counter is c)
    _, two = measure(2)
    _, three = measure(3)
    follows = "sum" if three - two > 0.5 * max(two - one, 1e-9) and three - two > 0.5 else "largest"
    per_byte = (double - state) / (4 * n)
    return {"state_per_byte": per_byte, "state_per_tensor": state - per_byte * 4 * n, "extra_first": one,
            "extra_second": two - one, "extra_follows": follows}
