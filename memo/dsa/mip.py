"""DSA as the MEMO paper's pairwise big-M MIP, solved by Gurobi or HiGHS in a process of its own.

The model, over integer offsets ``x_i`` and the peak ``p`` (sizes and ``M`` divided by their GCD):

* for every pair ``i < j`` of buffers with bytes and overlapping lifetimes, a binary ``z_ij``
  (1: ``i`` lies below ``j``) and two rows
  ``x_i + s_i <= x_j + M (1 - z_ij)`` and ``x_j + s_j <= x_i + M z_ij``;
* for every buffer, ``p >= x_i + s_i``; bounds ``0 <= x_i <= M - s_i``, ``p <= M``;
* minimize ``p``.

``M`` is the peak of a known plan (the greedy one by default), which also warm-starts the solver.
Scaling by the GCD loses nothing: some optimal plan is compact, with every offset a sum of sizes.
The model has ``n + 1 + P`` variables and ``n + 2 P`` rows for ``P`` overlapping pairs, so it
grows quadratically: Gurobi's pip license (2000 variables, 2000 rows) refuses all but small
instances, which is detected up front, without building the model.

Why a process per solve: solvers can crash or hang inside native code, HiGHS and OR-Tools cannot
share a process, and a stuck solver must not take the planner with it. Each solve runs
``python -m memo.dsa.mip TASK RESULT`` in a new session, gets the time limit, and is killed a
few seconds past it, counted from when it has imported its solver (a loaded machine's imports
are not the solver's time); a crash or kill becomes a message. This process never imports a solver.
"""

import importlib
import importlib.util
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from memo.dsa.buffers import Buffer, PlanError, check_buffers, max_load, validate
from memo.dsa.greedy import greedy_portfolio, lowest_fit

GRACE_S = 5.0  # seconds a solver process may run past its time limit before it is killed
START_S = 120.0  # seconds a solver process may take to import its solver before it is killed
GUROBI_PIP_LIMIT = 2000  # variables, and separately rows, that the pip (size-limited) license allows
_GUROBI_SIZE_LIMIT_ERROR = 10010
_FULL_LICENSE_HINT = "planning with the open solvers (set GRB_LICENSE_FILE for a full license)"
_TARGETS = {"gurobi": "memo.dsa.mip:_solve_gurobi", "highs": "memo.dsa.mip:_solve_highs"}
_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class MipResult:
    """A solve's outcome; ``offsets`` is ``None`` when the solver gave no plan (see ``message``)."""

    offsets: Optional[list[int]]  # bytes, in the buffers' order; validated
    peak: Optional[int]  # bytes
    lower_bound: int  # bytes: the solver's proven bound rounded up, at least the max load
    optimal: bool  # the peak meets the lower bound
    solver: str  # "gurobi" or "highs"
    seconds: float  # wall-clock, process start-up included
    message: str  # one line


@dataclass(frozen=True)
class GurobiLicense:
    usable: bool  # gurobipy imports and an environment starts
    size_limit: Optional[int]  # variables (and rows) a model may have; None: unlimited
    message: str  # one line; why not usable, if so


# ---------------------------------------------------------------------------- the model


def _overlap_ranges(lower: np.ndarray, upper: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, ...]:
    """Buffers with bytes, by lower end, and for the k-th of them the end of the run ``(k, end)``
    of later ones alive with it: a later one starts no earlier, so it overlaps iff it starts
    before the k-th ends. Empty buffers occupy no byte and pair with nothing."""
    order = np.flatnonzero(size > 0)
    order = order[np.argsort(lower[order], kind="stable")]
    ends = np.searchsorted(lower[order], upper[order], side="left")
    return order, ends


def _pairs(lower: np.ndarray, upper: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(i, j)`` of every pair of buffers with bytes whose lifetimes overlap."""
    order, ends = _overlap_ranges(lower, upper, size)
    first = np.arange(1, len(order) + 1)
    count = ends - first
    at = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    return np.repeat(order, count), order[at]


def _arrays(buffers: Sequence[Buffer]) -> tuple[np.ndarray, ...]:
    """Lower ends, upper ends and sizes."""
    columns = ([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])
    return tuple(np.array(c, dtype=np.int64) for c in columns)


def mip_size(buffers: Sequence[Buffer]) -> tuple[int, int]:
    """``(variables, constraints)`` of the model as built; bounds are not constraints.

    Counts the pairs without listing them, so it is cheap for any instance.
    """
    order, ends = _overlap_ranges(*_arrays(buffers))
    pairs = int((ends - np.arange(1, len(order) + 1)).sum())
    return len(buffers) + 1 + pairs, len(buffers) + 2 * pairs


# ---------------------------------------------------------------------------- in the solver process


def _warm_values(offsets: np.ndarray, size: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Values of all variables, in the order x, p, z, for the plan ``offsets``."""
    return np.concatenate((offsets, [(offsets + size).max()], offsets[i] < offsets[j])).astype(float)


def _solve_gurobi(task: dict) -> dict:
    import gurobipy as gp

    start = time.perf_counter()
    lower, upper, size = (np.array(task[k], dtype=np.int64) for k in ("lower", "upper", "size"))
    big_m, n, s = task["big_m"], len(size), task["size"]
    i, j = _pairs(lower, upper, size)
    with gp.Env(empty=True) as env:
        env.setParam("OutputFlag", 0)
        env.start()
        with gp.Model(env=env) as m:
            # Row by row: gurobipy's matrix API would need scipy for these sparse rows.
            x = list(m.addVars(n, lb=0, ub=(big_m - size).tolist(), vtype=gp.GRB.INTEGER).values())
            peak = m.addVar(lb=0, ub=big_m, vtype=gp.GRB.INTEGER)
            z = list(m.addVars(len(i), vtype=gp.GRB.BINARY).values())
            for a, b, zk in zip(i.tolist(), j.tolist(), z):
                m.addLConstr(gp.LinExpr([1, -1, big_m], [x[a], x[b], zk]), "<", big_m - s[a])
                m.addLConstr(gp.LinExpr([1, -1, -big_m], [x[b], x[a], zk]), "<", -s[b])
            for a in range(n):
                m.addLConstr(gp.LinExpr([1, -1], [x[a], peak]), "<", -s[a])
            m.setObjective(peak, gp.GRB.MINIMIZE)
            offsets = np.array(task["start"], dtype=np.int64)
            for var, value in zip(x + [peak] + z, _warm_values(offsets, size, i, j)):
                var.Start = value
            m.Params.TimeLimit = max(task["time_limit_s"] - (time.perf_counter() - start), 0.0)
            m.Params.MIPGap = 0.0
            m.Params.MIPGapAbs = 0.999  # peaks are integers: a gap below one is closed
            m.optimize()
            return {
                "offsets": [round(v.X) for v in x] if m.SolCount else None,
                "bound": m.ObjBound if m.SolCount else None,
                "status": {gp.GRB.OPTIMAL: "optimal", gp.GRB.TIME_LIMIT: "time limit"}.get(
                    m.Status, f"status {m.Status}"
                ),
                "variables": m.NumVars,
                "constraints": m.NumConstrs,
            }


def _solve_highs(task: dict) -> dict:
    import highspy

    start = time.perf_counter()
    lower, upper, size = (np.array(task[k], dtype=np.int64) for k in ("lower", "upper", "size"))
    big_m, n = task["big_m"], len(size)
    i, j = _pairs(lower, upper, size)
    p = len(i)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    cols = n + 1 + p  # x, then the peak, then z
    col_lb = np.zeros(cols)
    col_ub = np.concatenate((big_m - size, [big_m], np.ones(p))).astype(float)
    cost = np.zeros(cols)
    cost[n] = 1.0
    h.addCols(cols, cost, col_lb, col_ub, 0, np.array([], np.int32), np.array([], np.int32), np.array([]))
    h.changeColsIntegrality(cols, np.arange(cols, dtype=np.int32), np.full(cols, 1, dtype=np.uint8))
    # Per pair  x_i - x_j + M z <= M - s_i  and  x_j - x_i - M z <= -s_j;  per buffer  x_i - p <= -s_i.
    zc = n + 1 + np.arange(p)
    pair_index = np.concatenate((np.stack((i, j, zc), 1), np.stack((j, i, zc), 1)))
    pair_value = np.concatenate((np.tile([1.0, -1.0, big_m], (p, 1)), np.tile([1.0, -1.0, -big_m], (p, 1))))
    peak_index = np.stack((np.arange(n), np.full(n, n)), 1)
    rows = 2 * p + n
    row_ub = np.concatenate((big_m - size[i], -size[j], -size)).astype(float)
    starts = np.concatenate((np.arange(0, 6 * p, 3), 6 * p + np.arange(0, 2 * n, 2))).astype(np.int32)
    index = np.concatenate((pair_index.ravel(), peak_index.ravel())).astype(np.int32)
    value = np.concatenate((pair_value.ravel(), np.tile([1.0, -1.0], n)))
    h.addRows(rows, np.full(rows, -highspy.kHighsInf), row_ub, len(index), starts, index, value)
    offsets = np.array(task["start"], dtype=np.int64)
    h.setSolution(cols, np.arange(cols, dtype=np.int32), _warm_values(offsets, size, i, j))
    h.setOptionValue("time_limit", max(task["time_limit_s"] - (time.perf_counter() - start), 0.01))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.999)  # peaks are integers: a gap below one is closed
    h.run()
    info, status = h.getInfo(), h.getModelStatus()
    named = {highspy.HighsModelStatus.kOptimal: "optimal", highspy.HighsModelStatus.kTimeLimit: "time limit"}
    solved = info.primal_solution_status == 2  # kSolutionStatusFeasible
    bound = info.mip_dual_bound
    return {
        "offsets": np.rint(h.getSolution().col_value[:n]).astype(int).tolist() if solved else None,
        "bound": bound if math.isfinite(bound) else None,
        "status": named.get(status, h.modelStatusToString(status)),
        "variables": h.getNumCol(),
        "constraints": h.getNumRow(),
    }


def _probe_gurobi(limit: int) -> dict:
    """Try a model one variable over ``limit``: the size-limited license refuses it (10010)."""
    import gurobipy as gp

    try:
        with gp.Env(empty=True) as env:
            env.setParam("OutputFlag", 0)
            env.start()
            with gp.Model(env=env) as m:
                m.addVars(limit + 1)
                try:
                    m.optimize()
                except gp.GurobiError as error:
                    if error.errno == _GUROBI_SIZE_LIMIT_ERROR:
                        return {"size_limit": limit}
                    raise
    except gp.GurobiError as error:
        return {"error": f"error {error.errno}: {error}"}
    return {"size_limit": None}


def _started() -> None:
    """Tell the parent (one line on stdout) that the solver is imported and its time begins; what
    the solver prints after that goes nowhere."""
    os.write(1, b"started\n")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def _child(task_path: str, result_path: str) -> None:
    """Run the task's ``module:function`` on its arguments; write its value or error as JSON."""
    task = json.loads(Path(task_path).read_text())
    function, out = None, {}
    try:
        module, name = task["target"].split(":")
        function = getattr(importlib.import_module(module), name)
    except Exception as error:  # the parent turns it into a message
        out = {"error": f"{type(error).__name__}: {error}"}
    _started()
    if function is not None:
        try:
            out = {"value": function(*task["args"])}
        except Exception as error:
            out = {"error": f"{type(error).__name__}: {error}"}
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(result_path)  # the parent never reads half a result


# ---------------------------------------------------------------------------- in this process


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _isolated(target: str, args: list, wall_s: float) -> tuple[Any, str]:
    """``(value, "")`` of ``target(*args)`` run in a new process (JSON in and out), or
    ``(None, why)`` if it raised, crashed, or was killed: past ``START_S`` seconds before it had
    imported ``target``, or ``wall_s`` seconds after."""
    with tempfile.TemporaryDirectory(prefix="memo-mip-") as tmp:
        task, result, log = Path(tmp, "task.json"), Path(tmp, "result.json"), Path(tmp, "stderr")
        task.write_text(json.dumps({"target": target, "args": args}))
        path = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
        with open(log, "wb") as err:
            # A session of its own: a kill takes the solver's helper processes, if any, along.
            proc = subprocess.Popen(
                [sys.executable, "-m", "memo.dsa.mip", str(task), str(result)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                env=dict(os.environ, PYTHONPATH=path), start_new_session=True,
            )
            code, late = None, f"the solver process did not start within {START_S:g} s and was killed"
            try:
                # the time counts from the solver's start: a loaded machine's slow imports are not its time
                if select.select([proc.stdout], [], [], START_S)[0]:
                    proc.stdout.readline()  # "started", or nothing from a process that died first
                    late = f"the solver process ran past {wall_s:g} s and was killed"
                    code = proc.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if proc.poll() is None:  # past its time, or this process is interrupted: no orphan
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                proc.stdout.close()
        if code is None:
            return None, late
        if result.exists():  # even if the process died after writing it
            out = json.loads(result.read_text())
            return (out["value"], "") if "error" not in out else (None, _one_line(out["error"]))
        names = {s.value: s.name for s in signal.Signals}
        why = f"signal {names.get(-code, -code)}" if code < 0 else f"exit code {code}"
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return None, _one_line(f"the solver process crashed ({why})" + (f": {tail[0]}" if tail else ""))


_licenses: dict[Optional[str], GurobiLicense] = {}


def gurobi_license() -> GurobiLicense:
    """Whether Gurobi can run here and how large a model its license allows.

    Probed once per process (and per ``GRB_LICENSE_FILE``) in a process of its own, in well under
    a second: an environment is started and a model one variable over the pip license's limit is
    optimized; error 10010 means the license is size-limited.
    """
    key = os.environ.get("GRB_LICENSE_FILE")
    if key not in _licenses:
        if importlib.util.find_spec("gurobipy") is None:  # finds without importing
            found = GurobiLicense(False, None, f"gurobi: gurobipy is not installed; {_FULL_LICENSE_HINT}")
        else:
            out, why = _isolated("memo.dsa.mip:_probe_gurobi", [GUROBI_PIP_LIMIT], wall_s=30.0)
            why = why or (out or {}).get("error", "")
            message = _one_line(f"gurobi: cannot run here ({why}); {_FULL_LICENSE_HINT}")
            found = GurobiLicense(False, None, message) if why else GurobiLicense(True, out["size_limit"], "")
        _licenses[key] = found
    return _licenses[key]


def _refusal(buffers: Sequence[Buffer]) -> str:
    """Why Gurobi will not solve this model, in one line, or "" if it will."""
    found = gurobi_license()
    if not found.usable:
        return found.message
    if found.size_limit is None:
        return ""
    variables, constraints = mip_size(buffers)
    over = [f"{k} {what}" for k, what in ((variables, "variables"), (constraints, "constraints"))
            if k > found.size_limit]
    if not over:
        return ""
    return (f"gurobi: the model has {' and '.join(over)} and the installed license allows "
            f"{found.size_limit}; {_FULL_LICENSE_HINT}")


def solve_mip(
    buffers: Sequence[Buffer],
    warm_start_offsets: Optional[Sequence[int]] = None,
    time_limit_s: float = 60.0,
    solver: str = "gurobi",
) -> MipResult:
    """Solve the pairwise big-M MIP for ``buffers`` with ``solver`` ("gurobi" or "highs").

    ``warm_start_offsets`` (bytes; the greedy plan if ``None``) must be a valid plan: its peak is
    ``M``. The solver gets ``time_limit_s`` seconds and its process is killed ``GRACE_S`` later (both
    counted from its import of the solver).
    Refusals, crashes, kills and invalid plans come back as a result with a one-line message.

    Raises:
        ValueError: for an unknown solver, malformed buffers, or an invalid warm start.
    """
    start = time.perf_counter()
    if solver not in _TARGETS:
        raise ValueError(f"unknown MIP solver {solver!r}; choose one of {', '.join(_TARGETS)}")
    check_buffers(buffers)
    low = max_load(buffers)

    def result(offsets=None, peak=None, bound=low, message=""):
        return MipResult(offsets, peak, bound, peak is not None and peak == bound, solver,
                         time.perf_counter() - start, message)

    if solver == "gurobi" and (why := _refusal(buffers)):
        return result(message=why)
    if warm_start_offsets is None:
        warm_start_offsets = greedy_portfolio(buffers).offsets
    validate(buffers, warm_start_offsets)
    # Lowest-fit in the plan's order of offsets keeps its peak or lowers it, and puts every offset
    # on a sum of sizes, so on a multiple of the GCD.
    order = sorted(range(len(buffers)), key=lambda k: warm_start_offsets[k])
    warm = lowest_fit(buffers, order)
    big_m = validate(buffers, warm)
    if big_m == low:  # also covers no buffers and no bytes: nothing to solve
        return result(warm, big_m, big_m, f"{solver}: the warm start meets the max-load bound; not solved")
    lower, upper, size = _arrays(buffers)
    unit = math.gcd(*size.tolist(), big_m)
    task = {"lower": lower.tolist(), "upper": upper.tolist(), "size": (size // unit).tolist(),
            "big_m": big_m // unit, "start": [o // unit for o in warm], "time_limit_s": float(time_limit_s)}
    out, why = _isolated(_TARGETS[solver], [task], wall_s=time_limit_s + GRACE_S)
    if why:
        return result(message=f"{solver}: {why}")
    bound = low
    # less a tolerance, lest 7.0000001 claim to prove 8; a solver stopped before its first
    # relaxation reports an infinite (or no) bound, which proves nothing beyond max-load
    if out.get("bound") is not None and math.isfinite(out["bound"]):
        bound = max(low, math.ceil(out["bound"] - 1e-6 - 1e-9 * abs(out["bound"])) * unit)
    if out.get("offsets") is None:
        return result(bound=bound, message=f"{solver}: {out['status']}, no plan found")
    offsets = [o * unit for o in out["offsets"]]
    try:
        peak = validate(buffers, offsets)
    except PlanError as error:
        why = _one_line(f"{solver}: its plan was invalid and is discarded: {error}")
        return result(bound=bound, message=why)
    # Optimal means a gap below one unit, so none; a bound above a valid peak is a tolerance artefact.
    bound = peak if out["status"] == "optimal" else min(bound, peak)
    if peak > bound:
        gap = f"; peak {peak} bytes, {peak / bound - 1:.2%} above the bound"
    else:  # the big-M relaxation is weak: often only the max load proves a plan optimal
        gap = "" if out["status"] == "optimal" else "; the peak meets the max-load bound"
    return result(offsets, peak, bound, f"{solver}: {out['status']}{gap}")


if __name__ == "__main__":
    _child(*sys.argv[1:3])
