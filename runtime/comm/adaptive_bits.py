"""Layer-wise adaptive bit widths for quantized all-reduce (CGX).

Measure each layer's quantization error at a few candidate bit widths on real gradients
during warm-up, then pick one width per layer with an integer program: minimise predicted
bytes on the wire subject to the total error staying at most that of uniform ``N`` bits.

    >>> errors = {"a": {2: 10.0, 4: 1.0, 8: 0.01}, "b": {2: 0.5, 4: 0.4, 8: 0.001}}
    >>> bits, report = choose_bits(errors, {"a": 1024, "b": 16384}, uniform_bits=4)
    >>> bits
    {'a': 8, 'b': 2}
    >>> report["objective_bytes"] < report["uniform_bytes"]
    True
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import pulp
import torch

from harmony.base import ilp
from harmony.base.errors import ConfigError
from harmony.runtime.comm.compression import CompressionSpec, wire_bytes
from harmony.runtime.comm.failures import guarded

CANDIDATES = (2, 3, 4, 6, 8)


def quantization_error(t: torch.Tensor, bits: int, bucket_size: int = 512, rounding: str = "stochastic") -> float:
    """Squared L2 error of bucketed max-min quantization of ``t`` at ``bits``.

    Nearest rounding: the actual residual. Stochastic rounding: its exact expectation,
    ``scale**2 * f * (1 - f)`` per element with ``f`` the fractional level, so measurements
    carry no sampling noise.
    """
    x = t.detach().reshape(-1).float()
    n = x.numel()
    if n == 0:
        return 0.0
    top = (1 << bits) - 1
    buckets = -(-n // bucket_size)
    if buckets * bucket_size != n:
        x = torch.cat([x, x[-1:].expand(buckets * bucket_size - n)])   # repeated values add no error
    xb = x.view(buckets, bucket_size)
    lo, hi = torch.aminmax(xb, dim=1)
    scale = (hi - lo) / top
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (xb - lo[:, None]).mul_(inv[:, None])
    if rounding == "nearest":
        frac = y - y.round()
        per_bucket = (frac * frac).sum(1)
    elif rounding == "stochastic":
        frac = y - y.floor()
        per_bucket = (frac * (1 - frac)).sum(1)
    else:
        raise ConfigError(f"rounding={rounding!r} is not one of ('stochastic', 'nearest')")
    return float((per_bucket.double() * scale.double() ** 2).sum())


def measure_errors(grads: Mapping[str, torch.Tensor], candidates: Sequence[int] = CANDIDATES,
                   bucket_size: int = 512, rounding: str = "stochastic") -> dict[str, dict[int, float]]:
    """``{name: {bits: squared L2 quantization error}}`` for one step's gradients."""
    for b in candidates:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
            raise ConfigError(f"candidate bits={b!r} is out of range: use integers in 1..8")
    return {name: {b: quantization_error(g, b, bucket_size, rounding) for b in candidates}
            for name, g in grads.items()}


class ErrorMeter:
    """Averages ``measure_errors`` over warm-up steps: call ``update(grads)`` each step, then ``errors()``."""

    def __init__(self, candidates: Sequence[int] = CANDIDATES, bucket_size: int = 512, rounding: str = "stochastic"):
        self.candidates, self.bucket_size, self.rounding = tuple(candidates), bucket_size, rounding
        self.steps = 0
        self._sum: dict[str, dict[int, float]] = {}
        self.sizes: dict[str, int] = {}

    def update(self, grads: Mapping[str, torch.Tensor]) -> None:
        step = measure_errors(grads, self.candidates, self.bucket_size, self.rounding)
        for name, per_bits in step.items():
            acc = self._sum.setdefault(name, dict.fromkeys(self.candidates, 0.0))
            for b, e in per_bits.items():
                acc[b] += e
            self.sizes[name] = grads[name].numel()
        self.steps += 1

    def errors(self) -> dict[str, dict[int, float]]:
        if not self.steps:
            raise ConfigError("ErrorMeter.errors() before any update(): measure at least one warm-up step")
        return {n: {b: e / self.steps for b, e in d.items()} for n, d in self._sum.items()}


def choose_bits(errors: Mapping[str, Mapping[int, float]], sizes: Mapping[str, int], uniform_bits: int = 4,
                bucket_size: int = 512, meta_dtype: torch.dtype = torch.float32,
                time_limit: float = 60.0) -> tuple[dict[str, int], dict]:
    """Bits per layer minimising predicted wire bytes with total error <= uniform ``uniform_bits``.

    An integer program (PuLP, HiGHS): binary ``x[l, b]``, one width per layer,
    ``sum e[l][b] x[l, b] <= sum e[l][uniform_bits]``, minimise ``sum bytes(l, b) x[l, b]``.
    The report holds ``bits``, ``objective_bytes``, ``uniform_bytes``, ``lower_bound_bytes``
    (the LP relaxation), ``error``, ``error_budget``, ``status``, ``solve_seconds`` and
    ``rows`` (name, elements, bits, bytes, error) for printing.
    """
    names = list(errors)
    _check_layers(errors, sizes, uniform_bits)
    cost = {(n, b): wire_bytes(int(sizes[n]), b, bucket_size, meta_dtype) for n in names for b in errors[n]}
    budget = sum(errors[n][uniform_bits] for n in names)
    uniform_bytes = sum(cost[n, uniform_bits] for n in names)
    program = _BitsProgram(names, errors, cost, budget, time_limit)
    start = time.perf_counter()
    bits, status, lower = program.best({n: uniform_bits for n in names}, uniform_bytes)
    seconds = time.perf_counter() - start
    objective = sum(cost[n, bits[n]] for n in names)
    report = dict(bits=bits, objective_bytes=objective, uniform_bytes=uniform_bytes,
                  lower_bound_bytes=lower, error=program.total_error(bits), error_budget=budget,
                  uniform_bits=uniform_bits, status=status, solve_seconds=seconds,
                  rows=[(n, int(sizes[n]), bits[n], cost[n, bits[n]], errors[n][bits[n]]) for n in names])
    return bits, report


def _check_layers(errors: Mapping[str, Mapping[int, float]], sizes: Mapping[str, int], uniform_bits: int) -> None:
    """Every layer needs its error at ``uniform_bits`` (the budget) and its size."""
    for n in errors:
        if uniform_bits not in errors[n]:
            raise ConfigError(f"choose_bits: layer {n!r} has no error measured at uniform_bits={uniform_bits}; "
                              f"measured {sorted(errors[n])} -- include it in the candidates")
        if n not in sizes:
            raise ConfigError(f"choose_bits: no size given for layer {n!r}")


@dataclass
class _BitsProgram:
    """``choose_bits``'s integer program: one width per layer, total error within ``budget``, least bytes."""
    names: list
    errors: Mapping[str, Mapping[int, float]]
    cost: dict             # (layer, bits) -> bytes on the wire
    budget: float          # the total error of uniform bits
    time_limit: float

    def solve(self, relax: bool, rhs: float):
        """(found, problem, variables): the program, or its LP relaxation, with the error bound ``rhs`` x budget."""
        cost, errors = self.cost, self.errors
        norm = self.budget if self.budget > 0 else 1.0      # keep the constraint's coefficients near 1 for the solver
        prob = pulp.LpProblem("adaptive_bits", pulp.LpMinimize)
        cat = pulp.LpContinuous if relax else pulp.LpBinary
        x = {k: prob.add_variable(f"x{i}", 0, 1, cat) for i, k in enumerate(cost)}
        prob += pulp.lpSum(cost[k] * v for k, v in x.items())
        for n in self.names:
            prob += pulp.lpSum(x[n, b] for b in errors[n]) == 1
        prob += pulp.lpSum(errors[k[0]][k[1]] / norm * v for k, v in x.items()) <= self.budget / norm * rhs
        return ilp.solve(prob, self.time_limit), prob, x

    def total_error(self, bits: Mapping[str, int]) -> float:
        return sum(self.errors[n][bits[n]] for n in self.names)

    def best(self, uniform: dict[str, int], uniform_bytes: int) -> tuple[dict[str, int], str, float]:
        """(bits, the solver's status, the LP relaxation's bytes): the program's bits where they keep the budget in
        exact arithmetic and cost no more than ``uniform`` (always feasible: the fallback)."""
        bits, status, lower, names = uniform, "empty", 0.0, self.names
        if not names:
            return bits, status, lower
        found, lp, _ = self.solve(relax=True, rhs=1.0)
        lower = pulp.value(lp.objective) if found else float(uniform_bytes)
        # the solver accepts solutions within its feasibility tolerance (~1e-7 of the budget); if the
        # answer breaks the budget in exact arithmetic, solve again with that much margin.
        for rhs in (1.0, 1.0 - 1e-6):
            found, prob, x = self.solve(relax=False, rhs=rhs)
            status = ilp.status(prob)
            if not found:
                continue
            chosen = {n: max(self.errors[n], key=lambda b: x[n, b].value() or 0.0) for n in names}
            if self.total_error(chosen) <= self.budget * (1 + 1e-12):
                if sum(self.cost[n, chosen[n]] for n in names) <= sum(self.cost[n, bits[n]] for n in names):
                    bits = chosen
                break
        else:
            status = f"{status}; no solution within the budget in exact arithmetic, kept uniform bits"
        return bits, status, lower


def choose_bits_across_ranks(errors: Mapping[str, Mapping[int, float]], sizes: Mapping[str, int],
                            uniform_bits: int = 4, group=None, **kwargs) -> tuple[dict[str, int], dict]:
    """``choose_bits`` on the errors averaged over ranks; every rank ends with rank 0's bits.

    Every rank must quantize a tensor with the same bits: each rank solves the same program on
    the same averaged errors, then rank 0's answer is broadcast (a tensor, no pickling).
    """
    import torch.distributed as dist

    names = list(errors)
    cands = sorted({b for n in names for b in errors[n]})
    table = torch.tensor([[errors[n].get(b, float("nan")) for b in cands] for n in names], dtype=torch.float64)
    guarded("adaptive bits: the all-reduce of the ranks' measured errors", dist.all_reduce, table, group=group)
    table /= dist.get_world_size(group)
    mean = {n: {b: float(table[i, j]) for j, b in enumerate(cands) if b in errors[n]} for i, n in enumerate(names)}
    bits, report = choose_bits(mean, sizes, uniform_bits, **kwargs)
    agreed = torch.tensor([bits[n] for n in names], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    guarded("adaptive bits: the broadcast of rank 0's bits", dist.broadcast, agreed, src=src, group=group, peer=src)
    if agreed.tolist() != [bits[n] for n in names]:
        bits = dict(zip(names, agreed.tolist()))
        report["status"] += "; replaced by rank 0's bits"
        bucket, meta = kwargs.get("bucket_size", 512), kwargs.get("meta_dtype", torch.float32)
        cost = {n: wire_bytes(int(sizes[n]), bits[n], bucket, meta) for n in names}
        report.update(bits=bits, objective_bytes=sum(cost.values()), error=sum(mean[n][bits[n]] for n in names),
                      rows=[(n, int(sizes[n]), bits[n], cost[n], mean[n][bits[n]]) for n in names])
    return bits, report


def specs_for_bits(names: Iterable[str], bits: Mapping[str, int], base: CompressionSpec) -> list[CompressionSpec]:
    """One ``CompressionSpec`` per name for ``allreduce``: ``base`` with the chosen bits (``base`` where none)."""
    out = []
    for n in names:
        b = bits.get(n)
        out.append(base if b is None or base.kind != "quantized" else
                   CompressionSpec(base.kind, b, base.bucket_size, base.rounding, base.error_feedback, base.meta))
    return out
