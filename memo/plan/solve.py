"""The DSA planner: greedy placement for an upper bound, then exact search between the bounds.

A plan always carries a proven lower bound: the max-load bound, raised by every capacity the
exact search proved infeasible. A time-out proves nothing and never lowers an answer's quality
below the greedy plan; the plan is optimal exactly when its peak meets the bound.
"""

import time
from dataclasses import dataclass
from typing import Sequence

from memo.plan.dsa import Buffer, max_load, validate
from memo.plan.greedy import greedy_portfolio
from memo.plan.mip import solve_mip
from memo.plan.search import fits

# The search keeps a buffers × sections matrix (sections ≤ 2 × buffers); past this many cells
# the greedy plan is returned as is.
MAX_SEARCH_CELLS = 20_000_000


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
    the bound itself (real traces usually meet it), then bisects between what it has not tried
    and the best peak so far; each try gets half the time left. Only a search that ends proves
    a capacity impossible (and every capacity below it) and raises the lower bound. Instances
    too large for the search (see ``MAX_SEARCH_CELLS``) keep the greedy plan.
    """
    start = time.perf_counter()
    low = max_load(buffers)  # proven
    greedy = greedy_portfolio(buffers)
    offsets, peak, solver, nodes = greedy.offsets, greedy.peak, f"greedy:{greedy.order}", 0
    message = ""
    if mip != "none" and peak > low:
        result = solve_mip(buffers, offsets, time_limit_s / 3, solver=mip)
        message = result.message
        low = max(low, result.lower_bound)
        if result.offsets is not None and result.peak < peak:
            offsets, peak, solver = result.offsets, result.peak, mip
    searchable = 2 * len(buffers) ** 2 <= MAX_SEARCH_CELLS
    probe = low  # capacities below this are not tried again (proven impossible, or timed out)
    first = True
    while searchable and probe < peak:
        left = time_limit_s - (time.perf_counter() - start)
        if left <= 0:
            break
        capacity = probe if first else (probe + peak - 1) // 2
        first = False
        result = fits(buffers, capacity, left / 2)
        nodes += result.nodes
        if result.offsets is not None:
            offsets, peak, solver = result.offsets, validate(buffers, result.offsets), "search"
        else:
            probe = capacity + 1  # look higher next, where plans are easier to find
            if result.proven and capacity + 1 > low:
                low = capacity + 1
    return DsaPlan(offsets, peak, low, solver, time.perf_counter() - start, nodes, message)
