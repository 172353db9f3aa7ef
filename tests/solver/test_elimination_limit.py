"""minimise under a memory limit: the hull walk over the multiplier returns what the finest
bisection would, the cheapest plan that fits among those any multiplier makes optimal."""

import itertools

import numpy as np
import pytest

from autopar.solver.elimination import greedy_order, minimise


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(3, 7)), int(rng.integers(2, 4))
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)]
    ecosts = [rng.random((d, d)) * 3 for _ in edges]
    costs = [rng.random(d) for _ in range(n)]
    usages = [rng.random(d) for _ in range(n)]
    lo = sum(u.min() for u in usages)
    limit = lo + rng.random() * (sum(u.max() for u in usages) - lo)
    return n, d, edges, ecosts, costs, usages, limit


def _parts(seed: int):
    n, d, edges, ecosts, costs, usages, limit = _problem(seed)

    def cost(a):
        return sum(c[k] for c, k in zip(costs, a)) + sum(
            m[a[u], a[v]] for (u, v), m in zip(edges, ecosts))

    def usage(a):
        return sum(w[k] for w, k in zip(usages, a))

    return n, d, edges, ecosts, costs, usages, limit, cost, usage


@pytest.mark.parametrize("seed", range(40))
def test_limit_answer_is_the_cheapest_fitting_lagrangian_minimiser(seed):
    n, d, edges, ecosts, costs, usages, limit, cost, usage = _parts(seed)
    a, status = minimise([d] * n, edges, ecosts, costs, usages, limit,
                         greedy_order(edges, [d] * n, 1e7), lambda x: usage(x) <= limit, 10.0)
    assert a is not None and usage(a) <= limit
    everything = list(itertools.product(range(d), repeat=n))
    fitting = [x for x in everything if usage(x) <= limit]
    assert cost(a) >= min(cost(x) for x in fitting) - 1e-9  # never below the true optimum
    if status == "optimal":
        assert cost(a) <= min(cost(x) for x in fitting) + 1e-9
        return
    # the Lagrangian minimisers (brute force, a fine grid of multipliers) that fit: the
    # answer is the cheapest of them
    best = cost(a)
    for lam in np.geomspace(1e-4, 1e4, 400):
        x = min(everything, key=lambda y: cost(y) + lam * usage(y))
        if usage(x) <= limit:
            assert best <= cost(x) + 1e-9, (lam, cost(x), best)


@pytest.mark.parametrize("seed", range(40))
def test_a_start_that_fits_gives_the_same_answer_or_a_cheaper_one(seed):
    """The walk from a point that fits (an axis step's current point) ends on the hull point
    the walk from its own bracket ends on, or on the start where the start lies on the hull
    nearer the limit: never on a dearer plan than that walk's, and always on one that
    fits."""
    n, d, edges, ecosts, costs, usages, limit, cost, usage = _parts(seed)
    order = greedy_order(edges, [d] * n, 1e7)

    def fits(x):
        return usage(x) <= limit

    plain, _ = minimise([d] * n, edges, ecosts, costs, usages, limit, order, fits, 10.0)
    starts = [np.array(x) for x in itertools.product(range(d), repeat=n) if fits(x)]
    rng = np.random.default_rng(seed)
    for k in rng.choice(len(starts), size=min(8, len(starts)), replace=False):
        a, _ = minimise([d] * n, edges, ecosts, costs, usages, limit, order, fits, 10.0,
                        start=starts[k])
        assert a is not None and fits(a)
        # (a start off the hull can be cheaper than the hull point: the sweep keeps the
        # cheaper of the two)
        assert cost(a) <= cost(plain) + 1e-9


@pytest.mark.parametrize("seed", range(40))
def test_minimisers_kept_from_other_limits_give_the_same_answer(seed):
    """A memory fit solves one problem at several limits with one memo of minimisers: the
    ones kept bracket the walk at the next limit, and the answer is the one a fresh walk
    gives (the same hull point), with fewer eliminations in all."""
    n, d, edges, ecosts, costs, usages, limit, cost, usage = _parts(seed)
    order = greedy_order(edges, [d] * n, 1e7)
    lo = sum(u.min() for u in usages)
    memo: dict = {}
    for lim in (limit, lo + 0.6 * (limit - lo), lo + 0.3 * (limit - lo), limit):
        def fits(x, lim=lim):
            return usage(x) <= lim

        fresh, s1 = minimise([d] * n, edges, ecosts, costs, usages, lim, order, fits, 10.0)
        kept, s2 = minimise([d] * n, edges, ecosts, costs, usages, lim, order, fits, 10.0,
                            memo)
        assert s1 == s2
        assert (fresh is None) == (kept is None)
        if fresh is not None:
            assert fits(kept)
            assert cost(kept) == pytest.approx(cost(fresh), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_a_multiplier_tried_first_gives_the_same_answer(seed):
    """The multiplier another step's walk reached, tried first: where its minimiser does not
    fit the walk starts there (none at 0 fits either), where it fits it brackets the walk;
    either way the answer is the plain walk's, and ``walked`` reports where it got to."""
    n, d, edges, ecosts, costs, usages, limit, cost, usage = _parts(seed)
    order = greedy_order(edges, [d] * n, 1e7)

    def fits(x):
        return usage(x) <= limit

    plain, s1 = minimise([d] * n, edges, ecosts, costs, usages, limit, order, fits, 10.0)
    for guess in (1e-3, 0.1, 0.5, 1.0, 3.0, 30.0):
        walked: list = []
        a, s2 = minimise([d] * n, edges, ecosts, costs, usages, limit, order, fits, 10.0,
                         guess=guess, walked=walked)
        assert s1 == s2
        assert (a is None) == (plain is None)
        if a is not None:
            assert fits(a)
            assert cost(a) == pytest.approx(cost(plain), rel=1e-12, abs=1e-12)
        if s2 == "feasible":
            assert len(walked) == 1 and walked[0] >= 0.0
