"""The DSA planner: greedy placement for an upper bound, then exact search between the bounds.

A plan always carries a proven lower bound: the max-load bound, raised by every capacity the
exact search proved infeasible. A time-out proves nothing and never lowers an answer's quality
below the greedy plan; the plan is optimal exactly when its peak meets the bound.
"""

import math
import time
from dataclasses import dataclass
from typing import Sequence

from memo.dsa.buffers import Buffer, max_load, validate
from memo.dsa.greedy import greedy_portfolio
from memo.dsa.mip import solve_mip
from memo.dsa.search import fits

# The search keeps a buffers × sections matrix (sections ≤ 2 × buffers); past this many cells
# the greedy plan is returned as is.
MAX_SEARCH_CELLS = 20_000_000
# The share of the time given to the max-load bound first, and the first budget of each try
# of the bisection above it (seconds).
LOW_SHARE = 0.4
FIRST_BUDGET_S = 0.5


@dataclass(frozen=True)
class DsaPlan:
    """Offsets for the buffers, in their order, and what is known about how good they are."""

    offsets: list[int]
    peak: int  # bytes
    lower_bound: int  # bytes: no plan has a lower peak
    solver: str  # "greedy:<order>", "search" or the MIP solver's name
    seconds: float
    search_nodes: int
    mip_message: str = ""  # what the MIP solver said, in one line ("" when it was not asked)

    @property
    def optimal(self) -> bool:
        return self.peak == self.lower_bound

    @property
    def gap(self) -> float:
        """Peak over the lower bound, minus one (0.0 when optimal)."""
        return self.peak / self.lower_bound - 1 if self.lower_bound else 0.0


def plan(buffers: Sequence[Buffer], time_limit_s: float = 60.0, mip: str = "gurobi") -> DsaPlan:
    """The lowest-peak plan found for ``buffers`` within about ``time_limit_s`` seconds.

    ``mip`` names the solver of the paper's big-M MIP ("gurobi", "highs" or "none"). When the
    greedy plan is not proven optimal, the MIP gets a third of the time, warm-started from it, in
    a process of its own; Gurobi is asked only where its license accepts the model's size
    (otherwise ``mip_message`` says why, and the open search does the work). A MIP plan and
    bound are taken when better.

    First the max-load bound and the greedy portfolio; if they differ, the exact search tries
    the bound itself with 40% of the time (real traces usually meet it), then bisects between the
    lowest capacity not yet ruled out and the best peak so far. How long a search takes swings
    widely from one capacity to the next, so the bisection gives each try a short budget and
    treats a time-out as a hint, not a proof; when the hints close the interval, it starts over
    from the proven bound with twice the budget. Only a search that ends proves a capacity
    impossible (and every capacity below it) and raises the lower bound. Instances too large for
    the search (see ``MAX_SEARCH_CELLS``) keep the greedy plan.
    """
    start = time.perf_counter()
    low = max_load(buffers)  # proven
    greedy = greedy_portfolio(buffers)
    offsets, peak, solver, nodes = greedy.offsets, greedy.peak, f"greedy:{greedy.order}", 0
    # Peaks worth trying are multiples of the sizes' common divisor: some optimal plan has
    # every offset a sum of sizes.
    unit = 0
    for b in buffers:
        unit = math.gcd(unit, b.size)
    unit = max(unit, 1)
    message = ""
    if mip != "none" and peak > low:
        answer = solve_mip(buffers, offsets, time_limit_s / 3, solver=mip)
        message = answer.message
        low = max(low, answer.lower_bound)
        if answer.offsets is not None and answer.peak < peak:
            offsets, peak, solver = answer.offsets, answer.peak, mip
    searchable = 2 * len(buffers) ** 2 <= MAX_SEARCH_CELLS

    def left() -> float:
        return time_limit_s - (time.perf_counter() - start)

    def attempt(capacity: int, seconds: float) -> bool:
        """Search at ``capacity``; whether the answer is final (a plan, or a proof)."""
        nonlocal offsets, peak, solver, nodes, low
        result = fits(buffers, capacity, seconds)
        nodes += result.nodes
        if result.offsets is not None:
            offsets, peak, solver = result.offsets, validate(buffers, result.offsets), "search"
        elif result.proven:
            low = max(low, -(-(capacity + 1) // unit) * unit)
        return result.proven

    if searchable and low < peak and left() > 0:
        attempt(low, LOW_SHARE * left())
    budget, leap = FIRST_BUDGET_S, None
    while searchable and low < peak and left() > 0:
        top = (peak - 1) // unit  # in units: the highest capacity that would improve the plan
        bottom = -(-low // unit)
        if top < bottom:
            break
        half = (top - bottom) // 2 + 1
        leap = half if leap is None else min(leap, half)
        capacity = (top - leap + 1) * unit
        if attempt(capacity, min(budget, left())):
            leap *= 2  # found (or proved): aim further down next
        elif leap > 1:
            leap //= 2
        else:
            budget, leap = 2 * budget, 4  # even the top timed out: more time, and look around
    return DsaPlan(offsets, peak, low, solver, time.perf_counter() - start, nodes, message)
