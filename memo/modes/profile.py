"""``mode=profile`` and ``mode=plan``: trace one iteration, classify its layers, plan its memory.

``mode=profile`` writes the trace (``trace.csv``, ``trace.json``) and a row with each layer's
skeletal and transient bytes. ``mode=plan`` also writes the bi-level plan (``plan.json``) and
adds to the row the level-1 and level-2 peaks, their lower bounds, gaps and solve times, and what
PyTorch's caching allocator would reserve for the same requests (simulated), so the plan can be
read against the baseline it replaces. Both run on any machine: the default back-end traces with
fake tensors, for every model, length and parallel layout.

A walk in tiles is planned from three layers of three tiles (:mod:`memo.profile.template`), every
request sized at the run's length and tile: one level-1 block serves every tile of a layer and
one every block of its attention, however many the run has (:mod:`memo.plan.bilevel`), and that
iteration has, part by part, the peak of the run's (``tests/fit/test_fit_tiles.py``). So ``mode=plan``
plans 65B at 4M tokens in seconds; ``mode=profile`` traces the run's own step.
"""

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from memo.config import ConfigError, PlannerConfig, Run, resolve
from memo.dsa.caching_allocator import simulate
from memo.model import dtype_label, torch_dtype
from memo.plan.bilevel import plan_iteration, write_plan
from memo.policy import policy_of
from memo.profile.iteration import trace_iteration
from memo.profile.layers import LayerMismatchError, check_identical_layers, layer_bytes, transient_events
from memo.profile.trace import Trace, layer_phase, write_trace
from memo.modes.frame import job_frame

log = logging.getLogger("memo")

TRACE_FILE = "trace.csv"
PLAN_FILE = "plan.json"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.3f} GiB"


def _simulated(trace: Trace, phase: Optional[str], prefix: str) -> dict[str, Any]:
    """Caching-allocator figures for the transient requests of ``phase`` (the requests the
    level-1 plan places), or for the whole trace when ``phase`` is None."""
    stats = simulate(trace.events if phase is None else transient_events(trace, phase))
    return {**{f"{prefix}.{k}": v for k, v in dataclasses.asdict(stats).items()},
            f"{prefix}.reserved_over_allocated": stats.reserved_over_allocated}


def profile_and_plan(
    cfg: DictConfig, output_dir: Path, overrides=(), claimed: bool = False
) -> dict[str, Any]:
    """Run ``cfg.mode`` (profile or plan), write its files and row into ``output_dir``.

    Like a training job (:func:`memo.modes.frame.job_frame`), a failure is the row's ``status``
    and ``error``, not an exception.
    """
    with job_frame(cfg, output_dir, overrides, claimed=claimed) as job:
        _profile(resolve(cfg, gpu_visible=torch.cuda.is_available()), output_dir, job.row)
    return job.row


def _profile(run: Run, output_dir: Path, row: dict[str, Any]) -> None:
    workload, backend = run.workload, run.profile_backend
    row["seq"] = workload.seq
    row["dtype"] = dtype_label(torch_dtype(workload))
    row["train.loss"] = workload.loss
    start = time.perf_counter()
    policy = policy_of(workload)
    trace = policy.planned_trace(workload) if run.mode == "plan" else None
    template = trace is not None
    if not template:
        trace = trace_iteration(workload, policy, backend, run.train.seed)
    row["profile.template"] = template
    row["profile.seconds"] = time.perf_counter() - start
    row["profile.events"] = len(trace.events)
    write_trace(output_dir / TRACE_FILE, trace)
    requests = trace.requests()
    row["profile.layers_identical"] = None  # three layers of a template: no two inner ones to compare
    if not template:
        try:
            row["profile.layers_identical"] = ",".join(map(str, check_identical_layers(trace, requests)))
        except LayerMismatchError as error:
            if run.mode == "plan":
                raise ConfigError(f"cannot plan one layer for all: {error}") from None
            log.warning("%s", error)
    layer = 1 if workload.model.num_layers > 2 else 0
    bytes_ = layer_bytes(trace, layer, requests)
    row.update({f"layer.{k}_bytes" if k not in ("layer", "skeletal_requests") else f"layer.{k}": v
                for k, v in dataclasses.asdict(bytes_).items()})
    log.info("traced %d events in %.1f s (%s tensors): layer %d keeps %s skeletal (%d tensors), "
             "transient %s forward / %s backward, at most %s / %s at once",
             len(trace.events), row["profile.seconds"], backend, layer, _gib(bytes_.skeletal),
             bytes_.skeletal_requests, _gib(bytes_.transient_forward), _gib(bytes_.transient_backward),
             _gib(bytes_.transient_forward_peak), _gib(bytes_.transient_backward_peak))
    if run.mode == "plan":
        row.update(_plan(run.planner, trace, layer, output_dir, identical_layers=not template))


def _plan(planner: PlannerConfig, trace: Trace, layer: int, output_dir: Path,
          identical_layers: bool = True) -> dict[str, Any]:
    memory_plan = plan_iteration(trace, planner.time_limit_s, planner.mip, identical_layers=identical_layers)
    levels = [*memory_plan.blocks.values(), memory_plan.iteration]
    for message in dict.fromkeys(level.mip_message for level in levels if level.mip_message):
        log.info("MIP: %s", message)
    write_plan(output_dir / PLAN_FILE, memory_plan)
    row: dict[str, Any] = {"plan.arena_bytes": memory_plan.arena_bytes,
                           "plan.flat_lower_bound_bytes": memory_plan.flat_lower_bound}
    levels_of_row = [("forward", memory_plan.blocks["layer.fwd"]), ("backward", memory_plan.blocks["layer.bwd"])]
    # a walk in tiles: the largest level-1 block of a tile, and of a block of its attention
    for name, kind in (("tile_forward", "layer.fwd.t"), ("tile_backward", "layer.bwd.t"),
                       ("attention_block_forward", "layer.fwd.t.b"), ("attention_block_backward", "layer.bwd.t.db")):
        variants = [level for block, level in memory_plan.blocks.items() if block.split("#")[0] == kind]
        if variants:
            levels_of_row.append((name, max(variants, key=lambda level: level.peak)))
    for name, level in (*levels_of_row, ("iteration", memory_plan.iteration)):
        row.update({f"plan.{name}_peak_bytes": level.peak,
                    f"plan.{name}_lower_bound_bytes": level.lower_bound, f"plan.{name}_gap": level.gap,
                    f"plan.{name}_solver": level.solver, f"plan.{name}_seconds": level.seconds})
    row["plan.seconds"] = sum(level.seconds for level in levels)
    row.update(_simulated(trace, layer_phase(layer, "fwd"), "simulated.forward"))
    row.update(_simulated(trace, layer_phase(layer, "bwd"), "simulated.backward"))
    row.update(_simulated(trace, None, "simulated.iteration"))
    for name in ("forward", "backward", "iteration"):
        log.info("%-9s planned %s (bound %s, gap %.3f%%, %s, %.1f s); caching allocator reserves %s "
                 "for a peak of %s allocated (+%.1f%%; fragmentation at its reserved peak %.1f%%, "
                 "%d retries)", name, _gib(row[f"plan.{name}_peak_bytes"]),
                 _gib(row[f"plan.{name}_lower_bound_bytes"]), 100 * row[f"plan.{name}_gap"],
                 row[f"plan.{name}_solver"], row[f"plan.{name}_seconds"],
                 _gib(row[f"simulated.{name}.peak_reserved"]), _gib(row[f"simulated.{name}.peak_allocated"]),
                 100 * row[f"simulated.{name}.reserved_over_allocated"],
                 100 * row[f"simulated.{name}.fragmentation"], row[f"simulated.{name}.num_alloc_retries"])
    log.info("plan written to %s", output_dir / PLAN_FILE)
    return row
