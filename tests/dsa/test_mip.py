"""The pairwise big-M MIP: its size, optimal plans from Gurobi and HiGHS against brute force, the
up-front refusal of models too large for Gurobi's license, and the solver process's isolation."""

import functools
import itertools
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memo.dsa import mip
from memo.dsa.buffers import Buffer, max_load, read_buffers, validate
from memo.dsa.greedy import greedy_portfolio

A = Path("/work/shared/benchmarks/dsa/minimalloc-challenging/A.1048576.csv")
TESTS = str(Path(__file__).parent)


def _buffers(*rows):
    return [Buffer(str(i), lo, up, size) for i, (lo, up, size) in enumerate(rows)]


def _lowest_fit(buffers, order):
    """Pure-Python lowest fit, written apart from memo.dsa.greedy's."""
    offsets = {}
    for k in order:
        b, at = buffers[k], 0
        below = sorted((offsets[q], offsets[q] + buffers[q].size) for q in offsets if buffers[q].overlaps(b))
        for lo, hi in below:
            if lo >= at + b.size:
                break
            at = max(at, hi)
        offsets[k] = at
    return [offsets[k] for k in range(len(buffers))]


@functools.cache
def _instance(seed):
    """Random buffers, the optimal plan's peak (lowest fit reaches it for some order), and the
    worst lowest-fit plan: a warm start the solver has to improve on."""
    buffers = _random(seed)
    plans = [_lowest_fit(buffers, order) for order in itertools.permutations(range(len(buffers)))]
    peaks = [validate(buffers, p) for p in plans]
    return buffers, min(peaks), plans[peaks.index(max(peaks))]


def _random(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(5, 7)):
        lo = rng.randint(0, 8)
        rows.append((lo, lo + rng.randint(1, 6), rng.choice([256, 512, 768, 1280, 2048])))  # GCD 256
    return _buffers(*rows)


def _solves(solver):
    """Whether ``solver`` runs here; if not, ``solve_mip`` must say why instead of solving."""
    return solver == "highs" or mip.gurobi_license().usable


def test_model_size_counted_by_hand():
    # Pairs alive together: (0, 1) and (1, 2); 0 ends when 2 starts; an empty buffer pairs with none.
    assert mip.mip_size(_buffers((0, 10, 4), (5, 15, 2), (10, 20, 3))) == (3 + 1 + 2, 2 * 2 + 3)
    assert mip.mip_size(_buffers((0, 10, 4), (5, 15, 2), (10, 20, 3), (0, 20, 0))) == (4 + 1 + 2, 2 * 2 + 4)
    assert mip.mip_size(read_buffers(A)) == (154 + 1 + 4642, 2 * 4642 + 154)  # pairs as in the README


@pytest.mark.parametrize("solver", ["gurobi", "highs"])
def test_the_built_model_has_the_counted_size(solver):
    buffers, _, worst = _instance(0)
    lower, upper, size = ([getattr(b, k) for b in buffers] for k in ("lower", "upper", "size"))
    big_m = validate(buffers, worst)
    task = dict(lower=lower, upper=upper, size=size, big_m=big_m, start=worst, time_limit_s=5)
    out, why = mip._isolated(mip._TARGETS[solver], [task], wall_s=30)
    if _solves(solver):
        assert why == "" and (out["variables"], out["constraints"]) == mip.mip_size(buffers)
    else:
        assert out is None and why


@pytest.mark.parametrize("solver", ["gurobi", "highs"])
@pytest.mark.parametrize("seed", [0, 2, 5, 9])  # 5 to 7 buffers; seeds whose worst plan is not optimal
def test_small_instances_reach_the_brute_force_optimum(solver, seed):
    buffers, optimum, worst = _instance(seed)
    assert validate(buffers, worst) > optimum  # so the solver has work to do
    result = mip.solve_mip(buffers, worst, time_limit_s=20, solver=solver)
    assert "\n" not in result.message and result.message.startswith(f"{solver}:")
    if _solves(solver):
        assert result.message == f"{solver}: optimal"
        assert result.optimal and result.peak == result.lower_bound == optimum
        assert validate(buffers, result.offsets) == optimum  # within its time: "optimal", not killed
    else:
        assert result.offsets is None and result.peak is None and not result.optimal


def test_a_warm_start_at_the_max_load_needs_no_solver(monkeypatch):
    monkeypatch.setattr(mip, "_isolated", lambda *a, **k: pytest.fail("a solver process was started"))
    buffers = _buffers((0, 10, 4), (5, 15, 2), (10, 20, 3))
    result = mip.solve_mip(buffers, None, 5, "highs")
    assert result.optimal and result.peak == max_load(buffers) == 6
    assert mip.solve_mip([], None, 5, "highs").peak == 0


def test_a_solver_stopped_before_its_first_bound_proves_only_the_max_load(monkeypatch):
    """A solver out of time before its first relaxation reports an infinite bound (HiGHS does):
    the result keeps the max-load bound rather than failing on it."""
    buffers = _buffers((0, 10, 4), (5, 15, 2), (10, 20, 3))
    monkeypatch.setattr(mip, "max_load", lambda _: 5)  # below the warm start's 6, so the solver runs
    stopped = {"bound": float("inf"), "offsets": None, "status": "time limit"}
    monkeypatch.setattr(mip, "_isolated", lambda *a, **k: (stopped, ""))
    result = mip.solve_mip(buffers, None, 0.0, "highs")
    assert (result.offsets, result.lower_bound, result.optimal) == (None, 5, False)
    assert result.message == "highs: time limit, no plan found"


def test_a_large_model_is_refused_up_front(monkeypatch):
    buffers = read_buffers(A)
    started, isolated = [], mip._isolated

    def recording(target, *args, **kwargs):
        started.append(target)
        return isolated(target, *args, **kwargs)

    monkeypatch.setattr(mip, "_isolated", recording)
    result = mip.solve_mip(buffers, None, time_limit_s=5, solver="gurobi")
    found = mip.gurobi_license()
    if found.usable and found.size_limit is None:  # a full license: it solves, within the time
        assert "killed" not in result.message and validate(buffers, result.offsets) == result.peak
        return
    assert result.offsets is None and result.lower_bound == max_load(buffers)
    assert "\n" not in result.message and result.message.startswith("gurobi: ")
    assert set(started) <= {"memo.dsa.mip:_probe_gurobi"}  # the model was never built
    if found.usable:
        assert result.message == (
            "gurobi: the model has 4797 variables and 9438 constraints and the installed license allows "
            "2000; planning with the open solvers (set GRB_LICENSE_FILE for a full license)"
        )


def test_a_size_limited_license_names_what_is_over(monkeypatch):
    monkeypatch.setattr(mip, "gurobi_license", lambda: mip.GurobiLicense(True, 10, ""))
    buffers = _buffers((0, 10, 4), (5, 15, 2), (10, 20, 3), (0, 20, 1))  # 10 variables, 14 constraints
    assert mip.solve_mip(buffers, None, 5).message.startswith("gurobi: the model has 14 constraints and the")


def test_no_gurobi_license_is_one_line(monkeypatch):
    monkeypatch.setattr(mip, "_licenses", dict(mip._licenses))
    monkeypatch.setenv("GRB_LICENSE_FILE", "/nonexistent/gurobi.lic")
    found = mip.gurobi_license()
    assert not found.usable and "\n" not in found.message
    assert found.message.startswith("gurobi: cannot run here (") and "GRB_LICENSE_FILE" in found.message
    result = mip.solve_mip(_random(0), None, 5, "gurobi")
    assert result.offsets is None and result.message == found.message


def test_gurobi_not_installed_is_one_line(monkeypatch):
    monkeypatch.setattr(mip, "_licenses", {})
    monkeypatch.setattr(mip.importlib.util, "find_spec", lambda name: None)
    message = mip.solve_mip(_random(0), None, 5, "gurobi").message
    assert message.startswith("gurobi: gurobipy is not installed;") and "\n" not in message


def test_this_process_never_imports_a_solver():
    buffers, _, worst = _instance(0)
    code = (
        "import sys; from memo.dsa import mip; from memo.dsa.buffers import Buffer\n"
        f"buffers, worst = {buffers!r}, {worst!r}\n"
        "for solver in ('gurobi', 'highs'): print(mip.solve_mip(buffers, worst, 5, solver).message)\n"
        "assert not {'gurobipy', 'highspy'} & set(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True)
    assert out.stdout.splitlines()[1] == "highs: optimal"  # a solver did run, elsewhere


def test_the_license_probe_runs_once_per_process():
    first = mip.gurobi_license()
    t = time.perf_counter()
    assert mip.gurobi_license() is first and time.perf_counter() - t < 0.01


@pytest.mark.parametrize("solver", ["gurobi", "highs"])
def test_the_time_limit_is_kept_and_the_incumbent_returned(solver):
    buffers = read_buffers(A)[:72]  # 1037 variables, 2000 constraints: within the pip license
    assert max(mip.mip_size(buffers)) <= mip.GUROBI_PIP_LIMIT
    greedy = greedy_portfolio(buffers)
    result = mip.solve_mip(buffers, greedy.offsets, time_limit_s=1, solver=solver)
    assert "killed" not in result.message and "\n" not in result.message  # it kept to its time
    if _solves(solver):
        assert result.message.startswith((f"{solver}: time limit", f"{solver}: optimal"))
        assert validate(buffers, result.offsets) == result.peak <= greedy.peak
        assert max_load(buffers) <= result.lower_bound <= result.peak
    else:
        assert result.offsets is None


def test_highs_keeps_to_its_time_limit_on_a_large_instance():
    buffers = read_buffers(A)
    greedy = greedy_portfolio(buffers)
    result = mip.solve_mip(buffers, greedy.offsets, time_limit_s=2, solver="highs")
    assert "killed" not in result.message, result.message
    assert not result.optimal and "time limit" in result.message
    assert validate(buffers, result.offsets) == result.peak <= greedy.peak
    assert max_load(buffers) <= result.lower_bound < result.peak


# Failing solver processes: targets the child imports from this file (see _inject).


def _crash(task):
    os.abort()


def _hang(task):
    time.sleep(600)


def _raise(task):
    raise RuntimeError("solver blew up")


def _overlapping(task):
    return {"offsets": [0] * len(task["size"]), "bound": 0.0, "status": "optimal"}


def _inject(monkeypatch, target):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    monkeypatch.setitem(mip._TARGETS, "highs", f"test_mip:{target}")


@pytest.mark.parametrize(
    "target, message",
    [
        ("_crash", "highs: the solver process crashed (signal SIGABRT)"),
        ("_raise", "highs: RuntimeError: solver blew up"),
        ("_overlapping", "highs: its plan was invalid and is discarded: buffers 0 and"),
    ],
)
def test_a_failing_solver_process_is_reported_not_raised(monkeypatch, target, message):
    _inject(monkeypatch, target)
    buffers, _, worst = _instance(0)
    result = mip.solve_mip(buffers, worst, time_limit_s=5, solver="highs")
    assert result.offsets is None and result.peak is None and not result.optimal
    assert result.message.startswith(message) and "\n" not in result.message


def test_a_hanging_solver_process_is_killed(monkeypatch):
    _inject(monkeypatch, "_hang")
    monkeypatch.setattr(mip, "GRACE_S", 1.0)
    buffers, _, worst = _instance(0)
    result = mip.solve_mip(buffers, worst, time_limit_s=1, solver="highs")
    assert result.message == "highs: the solver process ran past 2 s and was killed"
    assert result.offsets is None
    assert result.seconds < 2 + mip.START_S  # not the hang's 600 s


def test_a_solver_process_that_does_not_start_in_time_is_killed(monkeypatch):
    _inject(monkeypatch, "_overlapping")
    monkeypatch.setattr(mip, "START_S", 0.001)  # less than an interpreter's start
    buffers, _, worst = _instance(0)
    result = mip.solve_mip(buffers, worst, time_limit_s=1, solver="highs")
    assert result.message == "highs: the solver process did not start within 0.001 s and was killed"


def test_a_solvers_imports_are_not_its_time(monkeypatch, tmp_path):
    (tmp_path / "slow_solver.py").write_text("import time\ntime.sleep(3)\nfrom test_mip import _overlapping\n")
    _inject(monkeypatch, "_overlapping")  # this file on the child's path, for the module above to import
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    monkeypatch.setitem(mip._TARGETS, "highs", "slow_solver:_overlapping")
    monkeypatch.setattr(mip, "GRACE_S", 1.0)
    buffers, _, worst = _instance(0)
    result = mip.solve_mip(buffers, worst, time_limit_s=1, solver="highs")
    # three seconds of imports, more than its time and grace, and its answer still comes back
    assert result.message.startswith("highs: its plan was invalid") and result.seconds > 3
