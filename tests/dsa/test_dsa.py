"""DSA plans: the validator, the max-load bound, file round trips, and greedy placement
against brute force."""

import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest

from memo.dsa.buffers import Buffer, PlanError, max_load, read_buffers, read_plan, validate, write_plan
from memo.dsa.greedy import greedy_portfolio, lowest_fit
from memo.dsa.search import fits
from memo.dsa.solve import plan

REPO = Path(__file__).resolve().parents[2]
SMALL = Path(__file__).parents[1] / "data" / "minimalloc-small"


def _buffers(*rows):
    return [Buffer(str(i), lo, up, size) for i, (lo, up, size) in enumerate(rows)]


def test_validator_accepts_disjoint_space_or_time_and_returns_the_peak():
    b = _buffers((0, 10, 4), (0, 10, 6), (10, 20, 8), (5, 15, 0))
    assert validate(b, [0, 4, 0, 3]) == 10  # the third starts when the first two end


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([0, 3, 0, 0], "buffers 0 and 1 are alive together and share bytes [3, 4)"),
        ([0, -1, 0, 0], "negative offset"),
        ([0, 4, 0], "3 offsets for 4 buffers"),
    ],
)
def test_validator_names_what_is_wrong(offsets, message):
    b = _buffers((0, 10, 4), (0, 10, 6), (10, 20, 8), (5, 15, 0))
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace(")", r"\)")):
        validate(b, offsets)
    with pytest.raises(PlanError, match="exceeds the capacity 9"):
        validate(b, [0, 4, 0, 0], capacity=9)


def test_max_load_treats_lifetimes_as_half_open():
    assert max_load(_buffers((0, 10, 4), (10, 20, 8))) == 8
    assert max_load(_buffers((0, 11, 4), (10, 20, 8), (15, 16, 1))) == 12


def _brute_force(buffers):
    """The optimal peak: lowest-fit placement reaches it for some order (see memo.dsa.greedy)."""
    return min(
        max(o + b.size for o, b in zip(lowest_fit(buffers, order), buffers, strict=True))
        for order in itertools.permutations(range(len(buffers)))
    )


@pytest.mark.parametrize("seed", range(8))
def test_bounds_bracket_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(4, 7)):
        lo = rng.randint(0, 8)
        rows.append((lo, lo + rng.randint(1, 6), rng.randint(1, 9)))
    buffers = _buffers(*rows)
    optimum = _brute_force(buffers)
    greedy = greedy_portfolio(buffers)
    assert validate(buffers, greedy.offsets) == greedy.peak
    assert max_load(buffers) <= optimum <= greedy.peak


def test_the_small_public_instances_are_all_here():
    assert len(list(SMALL.glob("*.csv"))) == 7


@pytest.mark.parametrize("path", sorted(SMALL.glob("*.csv")), ids=lambda p: p.name)
def test_small_public_instances_fit_their_capacity(path):
    buffers = read_buffers(path)
    capacity = int(path.name.split(".")[1])
    assert max_load(buffers) == _brute_force(buffers) == capacity
    greedy = greedy_portfolio(buffers)
    assert validate(buffers, greedy.offsets, capacity=capacity) == capacity


def test_plans_round_trip_and_are_never_overwritten(tmp_path):
    buffers = _buffers((0, 10, 4), (0, 10, 6), (10, 20, 8))
    path = tmp_path / "plan.csv"
    write_plan(path, buffers, [0, 4, 0])
    assert read_plan(path) == (buffers, [0, 4, 0])
    with pytest.raises(FileExistsError, match="exists and is kept"):
        write_plan(path, buffers, [6, 0, 0])
    assert read_plan(path)[1] == [0, 4, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.csv"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("id,lower,size\n0,1,2\n", "the header lacks upper"),
        ("id,lower,upper,size\n0,0,4,2\n1,3,x,5\n", ":3: not a buffer"),
        ("id,lower,upper,size\n0,4,4,2\n", "needs lower < upper"),
        ("id,lower,upper,size\n0,0,4,2\n0,1,5,2\n", "trace.csv: buffer id 0 appears twice"),
    ],
)
def test_corrupt_traces_are_refused_with_their_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_buffers(path)


def test_a_file_that_is_not_text_is_refused_naming_it(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(b"id,lower,upper,size\n\xff\xfe\x00\x81\n")
    with pytest.raises(ValueError, match=r"trace.csv:\d+: not CSV text"):
        read_buffers(path)


def test_the_benchmark_names_each_bad_file_and_plans_the_rest(tmp_path):
    (tmp_path / "a_good.csv").write_text((SMALL / "a.6.csv").read_text())
    (tmp_path / "b_bad_line.csv").write_text("id,lower,upper,size\n0,0,4,2\n1,3,x,5\n")
    (tmp_path / "c_binary.csv").write_bytes(b"\xff\xfe\x00\x81")
    command = [sys.executable, str(REPO / "benchmarks" / "dsa.py"), str(tmp_path), "--time-limit", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith(f"error: {tmp_path / 'b_bad_line.csv'}:3: not a buffer")
    assert errors[1].startswith(f"error: {tmp_path / 'c_binary.csv'}:")
    planned = done.stdout.strip().splitlines()[1:]
    assert len(planned) == 1 and planned[0].split()[0].endswith("/a_good")


def _random_instance(seed: int, buffers: int = 7):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(3, buffers)):
        lo = rng.randint(0, 8)
        rows.append((lo, lo + rng.randint(1, 6), rng.randint(1, 9)))
    return _buffers(*rows)


def test_the_planner_beats_greedy_and_proves_it():
    seeds = [s for s in range(200) if greedy_portfolio(_random_instance(s, 8)).peak
             > max_load(_random_instance(s, 8))]
    worse = [(s, b) for s in seeds if greedy_portfolio(b := _random_instance(s, 8)).peak > _brute_force(b)]
    assert worse, "no instance where greedy misses the optimum"
    for _, buffers in worse[:3]:
        result = plan(buffers, time_limit_s=30, mip="none")
        assert result.optimal and result.solver == "search" and result.mip_message == ""
        assert validate(buffers, result.offsets) == result.peak == _brute_force(buffers)
    # The same instances through the paper's MIP, where Gurobi runs here (its pip license takes
    # models this small); otherwise the planner says why in one line and searches instead.
    from memo.dsa.mip import gurobi_license

    usable = gurobi_license().usable
    for _, buffers in worse[:2]:
        result = plan(buffers, time_limit_s=30, mip="gurobi")
        assert result.optimal and result.peak == _brute_force(buffers)
        assert result.solver == ("gurobi" if usable else "search"), result.mip_message
        assert result.mip_message.startswith("gurobi:") and "\n" not in result.mip_message


def test_a_model_too_large_for_gurobis_license_is_refused_up_front_and_searched():
    from memo.dsa.mip import gurobi_license

    from memo.dsa.mip import mip_size

    # Seventy buffers, most alive together: thousands of pairs, where greedy misses the bound.
    def instance(seed):
        rng = random.Random(seed)
        return _buffers(*((lo, lo + rng.randint(4, 8), rng.randint(1, 9))
                          for lo in (rng.randint(0, 8) for _ in range(70))))

    buffers = next(b for s in range(100) if greedy_portfolio(b := instance(s)).peak > max_load(b))
    assert min(mip_size(buffers)) > 2000
    result = plan(buffers, time_limit_s=5, mip="gurobi")
    limit = gurobi_license().size_limit
    if gurobi_license().usable and limit is None:  # a full license solves it
        assert result.mip_message.startswith("gurobi:")
    else:
        assert "planning with the open solvers" in result.mip_message and "\n" not in result.mip_message
    assert validate(buffers, result.offsets) == result.peak <= greedy_portfolio(buffers).peak


def test_a_time_out_keeps_the_greedy_plan_and_proves_nothing():
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        lo = rng.randint(0, 30)
        rows.append((lo, lo + rng.randint(1, 12), rng.randint(1, 20)))
    buffers = _buffers(*rows)
    greedy = greedy_portfolio(buffers)
    assert fits(buffers, max_load(buffers), time_limit_s=0.0).proven is False
    result = plan(buffers, time_limit_s=0.0)
    assert greedy.peak > max_load(buffers)  # so the planner had something to search for
    assert (result.peak, result.lower_bound) == (greedy.peak, max_load(buffers))
    assert result.solver == f"greedy:{greedy.order}" and not result.optimal
    assert validate(buffers, result.offsets) == result.peak
