"""The committed GPU rows (results/gpu/) predicted again with today's fit: the allocated peak within
3%, the reserved peak within 5%, the time per step within 10%; a row that ran out of memory is
predicted not to fit. A row the fit is not held to yet is exempt by name, for one bound, with the
reason (rows made by older code are re-measured on the next GPU at hand)."""

import fnmatch
import json

import pytest
from conftest import REPO

from memo.fit.calibration import problem_of_row
from memo.fit.predict import predict

BOUNDS = {"allocated": 0.03, "reserved": 0.05, "time": 0.10}
_LAUNCH_BOUND = "tiny models for a few steps: launch-bound, and the time model counts no launches"
_UNMEASURED_RATES = "the time model is {} low on these GPUs: fit.*'s efficiencies are not measured yet"
# (bound, job pattern): why the fit is not held to it there.
EXEMPT = {
    **{("time", pattern): _LAUNCH_BOUND for pattern in ("smoke-*", "numerics-*", "checkpoints-*")},
    ("time", "throughput-*"): _UNMEASURED_RATES.format("8-55%"),
    ("time", "models-*"): _UNMEASURED_RATES.format("18-30%"),
    ("time", "tiles-*"): _UNMEASURED_RATES.format("10-14%"),
    ("allocated", "*memo*"): "memo's swapping holds 0.2-2.3 GiB more on a GPU than its trace (growing with the "
                             "length; not found without a GPU)",
    ("reserved", "*memo*"): "memo's swapping holds more on a GPU than its trace (see allocated)",
    ("reserved", "smoke-*"): "below 1 GiB, the caching allocator's 2 MiB and 20 MiB blocks are a large share",
    ("reserved", "numerics-*"): "the 125m model's few GiB: the caching allocator's large blocks are a large share",
    ("reserved", "throughput-*-8k"): "the caching allocator held 1.6-2.0 GiB more than the simulator at 8K",
    ("reserved", "throughput-full_recompute-32k"): "the caching allocator held 16% more than the simulator: "
                                                   "fragmentation it does not reproduce",
    ("reserved", "throughput-megatron_full_recompute-128k"): "the caching allocator held 15% more than the "
                                                             "simulator: fragmentation it does not reproduce",
    ("reserved", "checkpoints-*"): "memo at alpha 0.5 on tiny_llama: the simulator reserves 5-11% more than the "
                                   "GPU held (the safe side)",
}

# Jobs the fit does not model at all, and why.
UNMODELLED = {"smoke-plan-true-memo-in-tiles": "tiles of 64 tokens, below the 512 a tile template is traced at"}


def _rows() -> list[tuple[str, dict]]:
    """Each committed training row once per device and job (re-runs of the same job by other code
    are the same configuration), newest first."""
    found = {}
    rows = [(path, json.loads(path.read_text())) for path in (REPO / "results" / "gpu").glob("*/runs/*/*/result.json")]
    for path, row in sorted(rows, key=lambda item: str(item[1].get("start_time")), reverse=True):
        if (row.get("status") not in ("ok", "oom") or row.get("peak_allocated_bytes") is None
                or path.parent.name in UNMODELLED):
            continue
        found.setdefault((row["device_name"], path.parent.name), (path.parent.name, row))
    return list(found.values())


def _exempt(bound: str, job: str) -> bool:
    return any(b == bound and fnmatch.fnmatch(job, pattern) for (b, pattern) in EXEMPT)


def _errors(row: dict) -> tuple[bool, dict]:
    problem, parallel, seq = problem_of_row(row)
    p = predict(problem, parallel, seq)
    allocated = p.device_total - p.reserved - p.acts.overhead  # the allocator's bytes, not the driver's
    return p.fits, {
        "allocated": allocated / row["peak_allocated_bytes"] - 1,
        "reserved": (p.device_total - p.reserved) / row["peak_reserved_bytes"] - 1,
        "time": p.time.iteration_s / row["iter_time_s"] - 1 if row["status"] == "ok" else None,
    }


@pytest.fixture(scope="module")
def predicted() -> list[tuple[str, dict, bool, dict]]:
    """Each row, whether it is predicted to fit, and the errors of its prediction."""
    return [(job, row, *_errors(row)) for job, row in _rows()]


def test_every_committed_gpu_row_is_predicted_within_the_bounds_or_exempt_by_name(predicted):
    assert len(predicted) >= 40  # the rows of results/gpu/, each device's job once
    beyond = []
    for job, row, fits, errors in predicted:
        if row["status"] == "oom":
            assert not fits, f"{job} ran out of memory on the {row['device_name']} and is predicted to fit"
            continue
        assert fits, f"{job} trained on the {row['device_name']} and is predicted not to fit"
        beyond += [f"{job} on the {row['device_name']}: {bound} {error:+.1%}" for bound, error in errors.items()
                   if abs(error) > BOUNDS[bound] and not _exempt(bound, job)]
    assert not beyond, "\n".join(beyond)


def test_each_exemption_still_names_a_row_beyond_its_bound(predicted):
    """An exemption that no longer excuses anything is removed, so the list says where the fit
    stands."""
    for (bound, pattern), reason in EXEMPT.items():
        named = [errors for job, row, _, errors in predicted if row["status"] == "ok" and fnmatch.fnmatch(job, pattern)]
        assert named, f"no committed row matches the exemption {bound} {pattern} ({reason})"
        assert any(abs(errors[bound]) > BOUNDS[bound] for errors in named), (
            f"every row of {bound} {pattern} is within {BOUNDS[bound]:.0%} now: remove its exemption")
