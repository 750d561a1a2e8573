"""How the microbatches' losses make the step's: by rows, or as one mean over the whole batch's tokens.

A loss that is a mean over label tokens (Hugging Face's causal and masked LM losses, labels of -100 ignored)
computed per microbatch and weighted by rows is not the whole batch's mean where the microbatches hold different
numbers of counted tokens (padding): it is the mean of the microbatches' means. Under ``loss_weighting="tokens"``
the traced step takes one more input, the batch's token count N (a 0-dim int64 tensor, ``ITEMS``), and hands it
to the loss as ``num_items_in_batch=N``: each microbatch's loss is then its summed loss over N (what Hugging
Face's ``fixed_cross_entropy`` computes with a tensor ``num_items_in_batch``, and what its Trainer passes), the
gradient seed is that loss itself and the step's loss their sum, the whole batch's token mean.

Who takes the count (``choose``):

* a Hugging Face model whose forward takes ``**kwargs`` (it hands them to ``self.loss_function``), with a
  ``labels`` tensor in the batch; the trace checks the loss reads it (``BertForMaskedLM`` computes its own mean
  and does not: rows);
* a model whose forward has a ``num_items_in_batch`` parameter (the built-in GPT), with a ``labels``,
  ``targets`` or ``target`` tensor;
* a ``loss_fn`` with a ``num_items_in_batch`` parameter: ``loss_fn(output, target, num_items_in_batch=N)``.

N counts the label tensor's elements other than -100; a causal LM's (a loss that shifts its labels) those of
``labels[..., 1:]``, or of a ``shift_labels`` tensor where the batch has one, as Hugging Face's Trainer counts.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass

import torch

from harmony.base.errors import ConfigError
from harmony.compiler.config_checks import Group, choice

__all__ = ["IGNORE_INDEX", "ITEMS", "WEIGHTINGS", "LossConfig", "Weighting", "choose", "count", "counted", "read_by"]

WEIGHTINGS = ("auto", "tokens", "rows")
ITEMS = "num_items_in_batch"      # the step's extra input and the keyword the loss takes it by
IGNORE_INDEX = -100               # labels not counted (cross_entropy's ignore_index, Hugging Face's padding)
LABELS = ("labels", "targets", "target")


@dataclass(kw_only=True)
class LossConfig(Group):
    """How the microbatches' losses make the step's loss (harmony/compiler/loss_weighting.py)."""

    loss_weighting: str = "auto"
    """``"tokens"``: the step is the gradient of the whole batch's mean over every counted label token (labels of
    -100 not counted), as eager gradient accumulation computes it with ``num_items_in_batch`` (Hugging Face's
    Trainer): for Hugging Face LM losses, a model whose forward takes ``num_items_in_batch`` (the built-in GPT), a
    ``loss_fn`` that takes it. ``"rows"``: each microbatch's loss counts for its share of the rows (for losses that
    are per-row means). ``"auto"``: tokens where the model or loss takes the count and the mode allows it, else
    rows; the report says which and why."""

    def __post_init__(self):
        super().__post_init__()
        choice("loss_weighting", self.loss_weighting, WEIGHTINGS)


@dataclass(frozen=True)
class Weighting:
    """What ``choose`` decided: ``kind`` ("tokens" or "rows") and why; for tokens, the batch tensor counted, whether
    its first position is left out (a causal LM's shift), and ``scale``: what each microbatch's loss is multiplied by
    in its seed (the data-parallel ranks, whose gradients the all-reduce averages). ``fed``: the traced step takes
    the count (``ITEMS``) as its last input."""

    kind: str
    why: str
    labels: str | None = None
    shift: bool = False
    scale: float = 1.0
    fed: bool = False

    @property
    def tokens(self) -> bool:
        return self.kind == "tokens"


def choose(cfg, model: torch.nn.Module, names: list[str]) -> Weighting:
    """The weighting of ``cfg.loss_weighting`` for ``model`` (and ``cfg.loss_fn``) on a batch of tensors ``names``:
    a ``ConfigError`` where "tokens" cannot be had."""
    option = getattr(cfg, "loss_weighting", "auto")
    if option == "rows":
        return Weighting("rows", "loss_weighting='rows': each microbatch's mean loss counts for its rows")
    found, why_not = _taker(model, cfg.loss_fn, names)
    refused = _refused(cfg)
    if option == "tokens" and (found is None or refused):
        raise ConfigError(f"loss_weighting='tokens': {why_not or refused}; use loss_weighting='rows' (each "
                          f"microbatch's mean loss counts for its rows)")
    if found is None or refused:
        return Weighting("rows", f"loss_weighting='auto' weighs by rows: {why_not or refused}")
    labels, shift, who = found
    world = (cfg.world_size or 1) if cfg.data_parallel else 1
    if getattr(cfg, "pipeline_size", None) and cfg.data_parallel:     # a grid: its pipelines are the replicas
        world //= cfg.pipeline_size
    across = f"; summed over the {world} data-parallel ranks" if world > 1 else ""
    return Weighting("tokens", f"{who} takes num_items_in_batch: each microbatch's loss is its sum over the "
                               f"batch's count of {'labels[..., 1:]' if shift else labels} != {IGNORE_INDEX}{across}",
                     labels, shift, float(world), fed=True)


def read_by(weighting: Weighting, gm: torch.fx.GraphModule, option: str) -> Weighting:
    """``weighting`` as the traced step ``gm`` bears it out: where the loss never reads the count (a model that
    takes ``**kwargs`` and computes its own mean), rows, the step still taking the count; a ``ConfigError`` for
    ``option`` "tokens"."""
    if not weighting.tokens:
        return weighting
    placeholder = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == ITEMS), None)
    if placeholder is not None and placeholder.users:
        return weighting
    why = f"the traced loss does not read {ITEMS} (the model computes its own mean)"
    if option == "tokens":
        raise ConfigError(f"loss_weighting='tokens': {why}; use loss_weighting='rows'")
    return dataclasses.replace(weighting, kind="rows", why=f"loss_weighting='auto' weighs by rows: {why}", scale=1.0)


def count(weighting: Weighting, named: dict) -> torch.Tensor:
    """The batch's token count (a 0-dim int64 tensor on the CPU) from its tensors by name."""
    labels = named[weighting.labels]
    if weighting.shift:
        labels = labels[..., 1:]
    if labels.is_meta:       # a plan to simulate: no values, every label counted
        return torch.tensor(labels.numel())
    return (labels != IGNORE_INDEX).sum().cpu()


def counted(step: torch.nn.Module, batch, items: torch.Tensor | None):
    """The traced step taking ``items`` as one more input (``ITEMS``, last), handed to the loss as
    ``num_items_in_batch=``; ``step`` and ``batch`` as they are where ``items`` is None."""
    if items is None:
        return step, batch
    args = ", ".join(batch.names)
    source = f"def forward(self, {args}, {ITEMS}):\n    return self.compute_loss({args}, {ITEMS}={ITEMS})\n"
    namespace: dict = {}
    exec(compile(source, "<harmony train step>", "exec"), namespace)
    step.__class__ = type("TrainStep", (type(step),), {"forward": namespace["forward"]})
    return step, dataclasses.replace(batch, names=(*batch.names, ITEMS), tensors=(*batch.tensors, items))


def _refused(cfg) -> str:
    """Why the parallel mode cannot weigh by tokens ("" where it can)."""
    if cfg.parallel == "pipeline":
        return "parallel='pipeline' weighs by rows (its last stage's seeds are its microbatches' means)"
    if cfg.shard_state == "full":
        return "shard_state='full' weighs by rows for now"
    if cfg.balance is not None:
        return "balance= weighs each rank's gradients by its rows"
    return ""


def _taker(model, loss_fn, names) -> tuple[tuple | None, str]:
    """(labels name, shift, who) where the model or loss takes the count, else (None, why not)."""
    if ITEMS in names:
        return None, f"the batch already holds a {ITEMS} tensor"
    if loss_fn is not None:
        if not _has_parameter(loss_fn, ITEMS):
            return None, f"loss_fn takes no {ITEMS} keyword (a loss_fn(output, target, {ITEMS}=None) that sums " \
                         f"and divides by it opts in)"
        return (names[-1], False, "loss_fn"), ""
    labels = next((n for n in LABELS if n in names), None)
    hf = _hf_loss(model)
    if hf is not None and "labels" in names:
        if "shift_labels" in names:
            return ("shift_labels", False, type(model).__name__), ""
        return ("labels", hf, type(model).__name__), ""
    if _has_parameter(model.forward, ITEMS, var_keyword=False) and labels is not None:
        return (labels, False, type(model).__name__), ""
    what = "no labels tensor in the batch" if labels is None else f"{type(model).__name__}.forward takes no {ITEMS}"
    return None, what


def _hf_loss(model) -> bool | None:
    """For a Hugging Face model whose forward hands ``**kwargs`` to its loss: whether that loss shifts its labels
    (a causal LM's); None for any other model."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is False or accepts is None and not _has_parameter(model.forward, "kwargs", var_keyword=True):
        return None
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    # as the model's ``loss_function`` property picks it: an unknown loss_type (GPT-2's is None) is a causal LM's
    loss = getattr(model, "_loss_function", None) or LOSS_MAPPING.get(getattr(model, "loss_type", None),
                                                                       ForCausalLMLoss)
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return loss is ForCausalLMLoss and not encoder_decoder


def _has_parameter(fn, name: str, var_keyword: bool = False) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if var_keyword:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return any(p.name == name and p.kind is not inspect.Parameter.VAR_POSITIONAL for p in params)
