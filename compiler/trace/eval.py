"""A pack's forward as ``model.eval()`` runs it: the training-mode decisions a traced graph baked in, undone.

Both front ends trace the model in training mode (``trace``). What that mode decides ends up in the graph
in two ways:

* as a flag of an op: ``aten.dropout(x, p, True)`` and ``aten.batch_norm(..., True, ...)`` from
  ``torch.export``, ``F.dropout(x, training=True)`` from ``torch.fx``. ``eval_module`` copies the graph with
  those flags off, as eval mode computes them: dropout is the identity, batch norm normalises with its
  running statistics and leaves them (and ``num_batches_tracked``, which export increments in a node of its
  own) as they are. A batch norm without running statistics normalises with the batch's in eval mode too:
  left as it is.
* as a module the fx front end kept whole (``nn.Dropout``, ``nn.BatchNorm2d``, any leaf module): it reads
  its own ``training`` flag when it runs. These are the model's own modules, shared with the training
  graph, so they are not changed here: the runtime runs them in eval mode for the evaluation and back in
  training mode for a step (``runtime.executor.module_modes``).

What the model's Python decided from ``self.training`` while it was traced (a branch taken) is not in the
graph as a flag and cannot be undone: such a model evaluates as its training-mode graph computes.

>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))   # any GraphModule
>>> eval_module(gm)[1]      # (the eval-mode copy, how many ops it changed)
0
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["eval_module"]

aten = torch.ops.aten


def _overloads(*packets) -> set:
    """Every overload of each aten op packet (``aten.dropout`` -> ``aten.dropout.default``, ...)."""
    out = set()
    for packet in packets:
        for name in packet.overloads():
            out.add(getattr(packet, name))
    return out


# op -> position of its training flag; ``None`` in the running-mean position means "batch statistics anyway"
_DROPOUT = {**{op: 2 for op in _overloads(aten.dropout, aten.native_dropout, aten.feature_dropout,
                                          aten.alpha_dropout, aten.feature_alpha_dropout)},
            torch.dropout: 2, torch.alpha_dropout: 2, torch.feature_dropout: 2, torch.feature_alpha_dropout: 2,
            F.dropout: 2, F.dropout1d: 2, F.dropout2d: 2, F.dropout3d: 2, F.alpha_dropout: 2,
            F.feature_alpha_dropout: 2}
_RRELU = {**{op: 3 for op in _overloads(aten.rrelu)}, **{op: 4 for op in _overloads(aten.rrelu_with_noise)},
          F.rrelu: 3, torch.rrelu: 3}
# (position of the flag, position of running_mean): eval mode uses the running statistics only where they exist
_NORMS = {**{op: (5, 3) for op in _overloads(aten.batch_norm, aten.native_batch_norm, aten.instance_norm,
                                             aten._native_batch_norm_legit_functional, aten.cudnn_batch_norm)},
          aten._native_batch_norm_legit.default: (5, 3),     # (not its no_stats overload: batch statistics)
          torch.batch_norm: (5, 3), torch.instance_norm: (5, 3), F.batch_norm: (5, 1), F.instance_norm: (5, 1)}
_KEYWORD = {F.dropout: "training", F.dropout1d: "training", F.dropout2d: "training", F.dropout3d: "training",
            F.alpha_dropout: "training", F.feature_alpha_dropout: "training", F.rrelu: "training",
            F.batch_norm: "training", F.instance_norm: "use_input_stats", torch.batch_norm: "training",
            torch.instance_norm: "use_input_stats"}
_RUNNING_KEYWORD = {F.batch_norm: "running_mean", F.instance_norm: "running_mean"}
_INPLACE_ADD = _overloads(aten.add_) | {operator.iadd}


def eval_module(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """An eval-mode copy of ``module`` over the same parameters, buffers and submodules, and how many ops it
    changed (flags turned off, ``num_batches_tracked`` increments dropped); see the module docstring."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.output(graph.graph_copy(module.graph, env))
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _counts_batches(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
        elif _turn_off(node):
            changed += 1
    copy = torch.fx.GraphModule(module, graph, class_name=type(module).__name__)
    copy.meta = dict(getattr(module, "meta", {}))
    for name, sub in module.named_children():     # nested graphs (export's no-grad regions) are rewritten too
        if isinstance(sub, torch.fx.GraphModule) and hasattr(copy, name):
            inner, n = eval_module(sub)
            if n:
                setattr(copy, name, inner)
                changed += n
    if changed:
        copy.recompile()
    return copy, changed


def _turn_off(node: torch.fx.Node) -> bool:
    """Turn the node's training flag off where eval mode would; True if it changed."""
    target = node.target
    if target in _DROPOUT or target in _RRELU:
        return _set_flag(node, _DROPOUT.get(target, _RRELU.get(target)))
    if target in _NORMS:
        flag, running = _NORMS[target]
        key = _RUNNING_KEYWORD.get(target)
        mean = node.args[running] if len(node.args) > running else node.kwargs.get(key) if key else None
        if mean is None:      # no running statistics: eval mode normalises with the batch's too
            return False
        return _set_flag(node, flag)
    return False


def _set_flag(node: torch.fx.Node, position: int) -> bool:
    key = _KEYWORD.get(node.target)
    if len(node.args) > position:
        if node.args[position] is False:
            return False
        node.args = node.args[:position] + (False,) + node.args[position + 1:]
        return True
    if key is not None:
        if node.kwargs.get(key, True) is False:
            return False
        node.kwargs = {**node.kwargs, key: False}
        return True
    return False        # an aten op's flag is positional and required: absent means not this op's form


def _counts_batches(node: torch.fx.Node) -> bool:
    """Export's ``num_batches_tracked += 1`` of a batch norm in training mode (eval mode leaves it)."""
    if node.target not in _INPLACE_ADD or not node.args:
        return False
    buffer = node.args[0]
    return isinstance(buffer, torch.fx.Node) and buffer.op == "get_attr" \
        and str(buffer.target).rsplit(".", 1)[-1].endswith("num_batches_tracked")
