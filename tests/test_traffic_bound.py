"""The least-traffic partition and its bound (passes/partition/search.py: ``least_traffic``;
passes/partition/cost.py: ``residency_lp``), on
synthetic layers: the DP finds the least bound over every partition, and the bound never exceeds what the linear
program of each partition leaves (the derivation in ``least_traffic``'s docstring, checked numerically)."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from harmony.passes.partition import Unit
from harmony.passes.partition.cost import _SpanSum, residency_lp
from harmony.passes.partition.search import least_traffic

MIB = 2**20


def _layers(params, kept, cross):
    units = [Unit([], frozenset({f"w{i}"}), frozenset(), 0.0, 0.0, k, 0.0, 0.0, c)
             for i, (k, c) in enumerate(zip(kept, cross))]
    return units, {f"w{i}": p for i, p in enumerate(params)}


def _packs(n):
    """Every partition of n layers into contiguous packs, as (start, end) lists."""
    for mask in range(2 ** (n - 1)):
        bounds = [0] + [i for i in range(1, n) if mask >> (i - 1) & 1] + [n]
        yield list(zip(bounds, bounds[1:]))


def _bound_of(own, work, cross, budget):
    """The bound of one partition, written out plainly: 3 P - U + the largest pack term."""
    worst, before = -float("inf"), 0.0
    for j in range(len(own)):
        crossing = before + cross[j] + (cross[j + 1] if j + 1 < len(own) else 0.0)
        worst = max(worst, work[j] - own[j] - sum(own[j + 1:]) + 2 * crossing
                    - min(crossing, max(0.0, budget - work[j])))
        before += cross[j]
    return 3 * sum(own) - budget + worst


def _figures(units, sizes, m, cuts):
    own = [sum(sizes[n] for u in units[s:e] for n in u.params) for s, e in cuts]
    work = [2 * o + sum(u.kept for u in units[s:e]) for o, (s, e) in zip(own, cuts)]
    cross = [0.0] + [units[s].cross_in * m for s, _ in cuts[1:]]
    return own, work, cross


layers = st.integers(2, 7).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 64).map(lambda k: k * MIB / 16), min_size=n, max_size=n),      # parameters
    st.lists(st.integers(0, 16).map(lambda k: k * MIB / 64), min_size=n, max_size=n),      # saved activations
    st.lists(st.integers(1, 16).map(lambda k: k * MIB / 256), min_size=n, max_size=n)))    # crossing, a microbatch


@settings(max_examples=60, deadline=None)
@given(layers, st.sampled_from([1, 4, 16]), st.floats(0.3, 1.2))
def test_least_traffic_is_the_least_bound_over_every_partition(figures, m, share):
    params, kept, cross = figures
    units, sizes = _layers(params, kept, cross)
    budget = share * 2 * sum(params)

    def work(s, e):
        return 2 * sum(params[s:e]) + sum(kept[s:e])
    fits = [c for c in _packs(len(units)) if all(work(s, e) <= budget for s, e in c)]
    found = least_traffic(units, sizes, m, work, budget, budget)
    if not fits:
        assert found is None
        return
    best = min(_bound_of(*_figures(units, sizes, m, c), budget) for c in fits)
    bound, cuts = found
    assert bound <= max(0.0, best) + 1e-9 * sum(params)
    assert bound >= max(0.0, best) - 2e-3 * sum(params)          # the bisection's tolerance
    assert all(work(s, e) <= budget for s, e in cuts)
    assert _bound_of(*_figures(units, sizes, m, cuts), budget) <= best + 2e-3 * sum(params)


@settings(max_examples=60, deadline=None)
@given(layers, st.sampled_from([1, 4, 16]), st.floats(0.3, 1.2), st.data())
def test_the_bound_never_exceeds_what_the_linear_program_leaves(figures, m, share, data):
    """Any schedule of the kind the bound is over is a point of the linear program (Adam's 2 bytes of state per
    byte), so its traffic is at least the program's optimum, which is at least the bound."""
    params, kept, cross = figures
    units, sizes = _layers(params, kept, cross)
    budget = share * 2 * sum(params)
    cuts = data.draw(st.sampled_from(list(_packs(len(units)))))
    own, work, cross_in = _figures(units, sizes, m, cuts)
    if any(w > budget for w in work):
        return
    moved = sum(3 * o for o in own[:-1]) + 2 * own[-1] + 4 * sum(cross_in)
    saved, stepped = residency_lp(own, work, cross_in, budget, 2.0)
    assert all(0 <= f <= o + 1 for f, o in zip(stepped, own))
    assert _bound_of(own, work, cross_in, budget) <= moved - saved + 1e-6 * sum(params)


def test_a_large_first_pack_and_small_last_packs_leave_the_least():
    """Six equal layers, half the state: the backward of the first pack comes last, when the weights held for the
    packs after it are gone, so the least-traffic partition puts its big pack first, not in the middle."""
    units, sizes = _layers([MIB] * 6, [MIB / 8] * 6, [MIB / 64] * 6)
    bound, cuts = least_traffic(units, sizes, 4, lambda s, e: 2 * (e - s) * MIB + (e - s) * MIB / 8,
                                12 * MIB, 12 * MIB)
    sizes_of = [e - s for s, e in cuts]
    assert sizes_of[0] == max(sizes_of) and sizes_of[-1] <= sizes_of[0], cuts
    assert bound >= 3 * 6 * MIB - 12 * MIB
    everything = [list(c) for c in itertools.islice(_packs(6), None)]
    assert all(_bound_of(*_figures(units, sizes, 4, c), 12 * MIB) >= bound - 1e-3 * 6 * MIB for c in everything
               if all(2 * (e - s) * MIB + (e - s) * MIB / 8 <= 12 * MIB for s, e in c))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sets(st.integers(0, 9), max_size=4), min_size=1, max_size=9),
       st.lists(st.integers(0, 2**40), min_size=10, max_size=10), st.data())
def test_span_sums_count_each_shared_name_once(owned, values, data):
    """``_SpanSum`` (the partition's per-span bytes: prefix sums less names several units share) equals summing the
    union of the span's names, tied names anywhere in the span included."""
    units = [Unit([], frozenset(f"p{i}" for i in own), frozenset(), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0) for own in owned]
    value = {f"p{i}": v for i, v in enumerate(values)}
    s = data.draw(st.integers(0, len(units) - 1))
    e = data.draw(st.integers(s, len(units)))
    union = frozenset().union(*(u.params for u in units[s:e]))
    assert _SpanSum(units, "params", value)(s, e) == sum(value[n] for n in union)
