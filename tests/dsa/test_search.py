"""The exact DSA search against brute force: plans at the optimum, proofs one step below it,
time-outs that prove nothing, and a public instance packed without a gap."""

import random
from pathlib import Path

import pytest

from memo.dsa.buffers import Buffer, max_load, read_buffers, validate
from memo.dsa.search import fits
from memo.dsa.solve import plan

CHALLENGING = Path(__file__).parents[1] / "data" / "minimalloc-challenging"


def _optimum(buffers):
    """The least peak, by placing buffers at their lowest free offset in every order (some
    order gives an optimal plan), sharing prefixes; written apart from the solver's code."""
    live = [b for b in buffers if b.size > 0]
    best = [sum(b.size for b in live)]

    def extend(placed, rest, peak):
        if peak >= best[0]:
            return
        if not rest:
            best[0] = peak
            return
        for i, b in enumerate(rest):
            spans = sorted((o, o + p.size) for p, o in placed if p.lower < b.upper and b.lower < p.upper)
            offset = 0
            for start, end in spans:
                if start - offset >= b.size:
                    break
                offset = max(offset, end)
            extend(placed + [(b, offset)], rest[:i] + rest[i + 1:], max(peak, offset + b.size))

    extend([], live, 0)
    return best[0] if live else 0


def _instance(seed: int):
    """Up to 8 buffers; some seeds give twins, a common factor of the sizes, an empty buffer,
    or lifetimes that leave a gap in time."""
    rng = random.Random(seed)
    unit = rng.choice([1, 1, 4])
    sizes = [rng.randint(1, 9) for _ in range(3)] if seed % 3 == 0 else None
    rows = []
    for _ in range(rng.randint(3, 8)):
        lo = rng.randint(0, 10)
        size = rng.choice(sizes) if sizes else rng.randint(1, 9)
        rows.append((lo, lo + rng.randint(1, 6), unit * size))
    if seed % 5 == 0:
        rows.append(rows[0])  # an exact twin
    if seed % 7 == 0:
        rows.append((rows[-1][0], rows[-1][0] + 1, 0))
    return [Buffer(str(i), *row) for i, row in enumerate(rows)]


@pytest.mark.parametrize("seed", range(60))
def test_the_search_fits_the_optimum_and_proves_one_byte_less_impossible(seed):
    buffers = _instance(seed)
    optimum = _optimum(buffers)
    found = fits(buffers, optimum)
    assert found.proven and validate(buffers, found.offsets, capacity=optimum) <= optimum
    refused = fits(buffers, optimum - 1)
    assert refused.proven and refused.offsets is None


def test_identical_buffers_that_cannot_all_fit_are_refused():
    buffers = [Buffer(str(i), 0, 4, 3) for i in range(6)] + [Buffer("x", 2, 6, 2)]
    assert fits(buffers, 19).proven and fits(buffers, 19).offsets is None
    assert validate(buffers, fits(buffers, 20).offsets, capacity=20) == 20


def test_independent_stretches_of_time_are_packed_each_to_the_capacity():
    # Two stretches joined by nothing: each needs its own arrangement, found under one capacity.
    left = [Buffer("a", 0, 4, 3), Buffer("b", 0, 2, 2), Buffer("c", 2, 4, 2), Buffer("d", 1, 3, 1)]
    right = [Buffer(b.id + "'", b.lower + 10, b.upper + 10, b.size) for b in left]
    buffers = left + right
    assert _optimum(left) == 6
    result = fits(buffers, 6)
    assert result.proven and validate(buffers, result.offsets, capacity=6) == 6
    assert fits(buffers, 5).offsets is None and fits(buffers, 5).proven


def test_a_time_out_returns_no_plan_and_proves_nothing():
    rng = random.Random(1)
    buffers = []
    for i in range(80):
        lo = rng.randint(0, 40)
        buffers.append(Buffer(str(i), lo, lo + rng.randint(1, 15), rng.randint(1, 30)))
    result = fits(buffers, max_load(buffers), time_limit_s=0.0)
    assert result.offsets is None and result.proven is False


def test_a_buffer_larger_than_the_capacity_is_refused_at_once():
    result = fits([Buffer("a", 0, 1, 5)], 4)
    assert result.offsets is None and result.proven


@pytest.mark.parametrize("name, capacity", [("C", 1039360), ("K", 1048576)])
def test_challenging_instances_fit_without_a_gap(name, capacity):
    buffers = read_buffers(next(CHALLENGING.glob(f"{name}.*.csv")))
    assert max_load(buffers) == capacity
    result = fits(buffers, capacity, time_limit_s=60)
    assert result.offsets is not None and validate(buffers, result.offsets, capacity=capacity) == capacity


@pytest.mark.parametrize("seed", [s for s in range(40) if s % 4 == 1])
def test_the_planner_proves_its_plans_optimal(seed):
    buffers = _instance(seed)
    result = plan(buffers, time_limit_s=20)
    assert result.optimal and result.lower_bound == _optimum(buffers)
    assert validate(buffers, result.offsets) == result.peak
