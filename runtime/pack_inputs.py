"""A pack's inputs in its autograd graph, and the gradients its backward finds for them, as eager's would be.

Eager PyTorch hands a value's producer the gradient its readers' backward computed, in whatever strides that
came out in (a permuted view's gradient, permuted back, is a channels-last one). A pack's inputs cannot be plain
leaves that collect ``.grad``: AccumulateGrad copies a gradient whose strides differ from its tensor's into the
tensor's strides (its layout contract for parameters), and the producing pack's backward then runs other kernels
on it than eager's (a convolution's weight gradient, a broadcast multiply's reduction: another summation order,
other bits). So each input enters the graph through ``enter``, a node whose backward keeps the summed gradient
as autograd computed it and passes nothing further (the value's own graph is another pack's).

    >>> x = torch.ones(2, 3).t()         # strides (1, 3)
    >>> y = enter(x, True)
    >>> (y * 2).sum().backward()
    >>> grad_of(y).stride()              # as computed; a leaf's .grad would have x's (1, 3)
    (2, 1)
"""
from __future__ import annotations

import torch


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.input_grad = grad      # the sum autograd made of every use in the pack, as it made it
        return None


def enter(x, grad: bool):
    """``x`` detached from whatever graph made it; a floating tensor with ``grad`` as a node whose gradient
    ``grad_of`` gives after the backward. A list or tuple of tensors (a ``chunk``'s) with each detached, and no
    gradient: a pack's backward sends gradients back for tensor values only. Anything else as it is."""
    if type(x) in (list, tuple):       # not as it is: its tensors may still be on the graph that made them, which
        return type(x)(enter(v, False) for v in x)   # a backward here would run (freed: "a second time")
    if not isinstance(x, torch.Tensor):
        return x
    if not (grad and x.is_floating_point()):
        return x.detach()
    return _Enter.apply(x.detach().requires_grad_())


def grad_of(x) -> torch.Tensor | None:
    """The gradient the backward computed for ``x`` (an ``enter``'s result), or None where none reached it."""
    return getattr(getattr(x, "grad_fn", None), "input_grad", None)


def entered_base(x) -> torch.Tensor | None:
    """The detached tensor an ``enter``'s result views (it holds the same storage), or None for anything else."""
    return x._base if isinstance(getattr(x, "grad_fn", None), _Enter._backward_cls) else None
