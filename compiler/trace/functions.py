"""A user's ``torch.autograd.Function`` kept as one node of an exported graph, so its own backward runs.

``torch.export`` (non-strict) traces through ``Function.apply``: the graph records the forward's aten ops, and
autograd then differentiates those ops instead of calling the Function's ``backward``. Where the two compute the
same gradient in other ops (BLOOM's GELU: its backward evaluates the tanh approximation's derivative in its own
order of operations) the gradients differ in their last bits from eager's, and where a backward is not the
forward's derivative at all (a straight-through estimator, a gradient reversal layer, a clipped or scaled
gradient) they differ outright.

``torch.fx.symbolic_trace`` traces
through it the same way. So while either front end traces, each ``apply`` of a Function defined outside torch
makes one node that calls ``Function.apply`` by its import path at run time (export: through torch's
``allow_in_pre_dispatch_graph``, a ``flat_apply`` node; fx: a call of the function that node calls), so autograd
records the Function and calls its ``backward``, as in eager. A Function the node could not import again (one
defined inside a function) is traced through as before.
"""
from __future__ import annotations

import contextlib
import importlib

import torch
import torch.fx
from torch._export.wrappers import allow_in_pre_dispatch_graph
from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch as call_by_name
from torch.utils._pytree import tree_leaves

__all__ = ["functions_kept", "importable"]


def importable(cls: type) -> bool:
    """Whether ``cls`` is found again by its module and qualified name (how the graph's node calls it)."""
    try:
        found = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is cls


@contextlib.contextmanager
def functions_kept():
    """For the block: ``apply`` of a user's importable ``autograd.Function`` makes one graph node (see above)."""
    Function = torch.autograd.Function
    original = Function.__dict__["apply"]
    kept = allow_in_pre_dispatch_graph(original.__func__)
    seen: dict[type, bool] = {}

    def apply(cls, *args, **kwargs):
        if cls not in seen:
            seen[cls] = not cls.__module__.startswith("torch.") and importable(cls)
        if not seen[cls]:
            return original.__func__(cls, *args, **kwargs)
        proxy = next((x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.fx.Proxy)), None)
        if proxy is not None:        # torch.fx: the node calls it by name, as export's does
            return proxy.tracer.create_proxy("call_function", call_by_name,
                                             (f"{cls.__module__}.{cls.__qualname__}", *args), kwargs)
        return kept(cls, *args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original
