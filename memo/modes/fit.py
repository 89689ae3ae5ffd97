"""``mode=fit``: will this configuration fit, with which layout, how long a sequence, how fast?

    python run.py mode=fit model=7b seq=1024k method=memo hardware=a800 parallel.tp=4 parallel.cp=2
    python run.py mode=fit model=65b cluster.gpus=64 seq=max parallel=search hardware=a800

Nothing is trained and no GPU is needed: the prediction comes from fake-tensor traces of the real
model (:mod:`memo.fit`). The job logs every memory term per device and per node, α and its binding
constraint, the verdict and the predicted time, and writes the training row format
(``result.json``) with ``status`` and ``predicted_*`` columns; ``layouts.csv`` beside it has one
line per layout tried.
"""

import csv
import dataclasses
import io
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from memo import hardware
from memo.config import WHOLE_LAYERS, ConfigError, Run, SeqSearch, resolve
from memo.fit.predict import Prediction, Problem, predict, prediction_hardware
from memo.fit.search import Candidate, LayoutResult, candidate_label, layout_label, layouts, longest, seq_grid_step
from memo.hardware import GiB
from memo.model import dtype_label, torch_dtype
from memo.model.gpt import parameter_count
from memo.modes.frame import job_frame
from memo.modes.train import METRIC_FIELDS
from memo.policy import policy_of
from memo.results import create_file_atomic

log = logging.getLogger("memo")

LAYOUTS_FILE = "layouts.csv"


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GiB:,.2f} GiB"


def _hardware(run: Run) -> hardware.Hardware:
    hw = prediction_hardware(hardware.resolve(run.hardware))
    missing = [name for name in ("device_memory_bytes", "host_memory_bytes") if getattr(hw, name) is None]
    if missing:
        raise ConfigError(
            f"hardware={hw.name} has no {', '.join(missing)}; set hardware.device_memory_gib "
            "and hardware.host_memory_gib"
        )
    return hw


def problem_of(run: Run, hw: hardware.Hardware) -> Problem:
    """The fixed part of ``run``'s prediction (workload, hardware, assumptions)."""
    return Problem(
        workload=run.workload,
        hardware=hardware.with_measured_peak(hw, torch_dtype(run.workload)),
        fit=run.fit,
        micro_batches=run.train.micro_batches,
        distributed_optimizer=run.train.distributed_optimizer,
        plan=run.plan,
        optimizer_offload=_offload_share(run, run.train.optimizer_offload),
        plan_time_limit_s=run.planner.time_limit_s,
    )


def _offload_share(run: Run, placement: str) -> float:
    """The share of the parameters whose Adam states live on the host for ``placement``
    (``train.optimizer_offload``'s values)."""
    return run.train.optimizer_offload_fraction if placement == "host" else 0.0


def evaluate(problem: Problem, candidate: Candidate, seq: int, search: Optional[SeqSearch]) -> LayoutResult:
    """One candidate at ``seq`` tokens, or at the longest length ``search`` allows (if given)."""
    parallel = candidate.parallel
    problem = dataclasses.replace(
        problem, workload=problem.workload.in_layer_tiles(candidate.tile_tokens),
        optimizer_offload=candidate.optimizer_offload)
    if search is None:
        prediction = predict(problem, parallel, seq)
        found = (prediction, None) if prediction.fits else (None, prediction)
        return LayoutResult(candidate, *found)
    grid, limit = seq_grid_step(search.step, parallel, candidate.tile_tokens), search.limit
    if grid > limit:
        raise ConfigError(
            f"fit.seq_limit={limit} is below the first length this layout can split ({grid}); "
            "raise fit.seq_limit"
        )
    best, failed = longest(lambda s: predict(problem, parallel, s), grid, limit)
    return LayoutResult(candidate, best, failed)


def _candidates(run: Run, problem: Problem) -> list[Candidate]:
    """The candidates to predict, each with why training cannot run it: the run's own, or under
    ``parallel=search`` every layout with every tile (for a method that walks tiles) and every
    placement of Adam's states of ``fit.tile_tokens`` and ``fit.optimizer_offload``, the run's
    own ``method.tile_tokens`` and ``train.optimizer_offload`` among them, each layout as the
    candidate's activation policy tries it (:meth:`memo.policy.ActivationPolicy.candidate_layout`)."""
    workload, parallel = run.workload, run.workload.parallel
    policy = policy_of(workload)
    if not parallel.search:
        return [Candidate(parallel, policy.training_refusal(parallel)
                          or _unrunnable(run, problem.optimizer_offload),
                          workload.layer_tile_tokens, problem.optimizer_offload)]
    tiles = policy.layer_tiles_tried(run.fit_layer_tiles, workload.layer_tile_tokens)
    shares = list(dict.fromkeys([*(_offload_share(run, placement) for placement in run.fit.optimizer_offload),
                                 problem.optimizer_offload]))
    fixed_seq = None if run.seq_search is not None else workload.seq
    found = []
    for p in layouts(workload.model, run.cluster.gpus, problem.hardware.devices_per_node or 1,
                     parallel.sequence_parallel, policy.exchanges):
        for tile in tiles:
            tiled = workload.in_layer_tiles(tile)
            candidate = policy_of(tiled)
            layout = candidate.candidate_layout(tiled, p, fixed_seq)
            if layout is None:
                continue
            found += [Candidate(layout, candidate.training_refusal(layout) or _unrunnable(run, share), tile, share)
                      for share in shares]
    if not found:
        raise ConfigError(
            f"no valid layout of cluster.gpus={run.cluster.gpus} for model={workload.model.name}"
        )
    return found


def _unrunnable(run: Run, offload_share: float) -> Optional[str]:
    """Why training cannot run with ``offload_share`` of Adam's states on the host (None: it can)."""
    if offload_share and run.workload.dtype not in ("bf16", "fp16"):
        return f"train.optimizer_offload=host needs 16-bit weights, not train.dtype={run.workload.dtype}"
    return None


def fit_job(cfg: DictConfig, output_dir: Path, overrides=(), claimed: bool = False) -> dict[str, Any]:
    """Run ``mode=fit`` for ``cfg``; write ``result.json`` and ``layouts.csv`` into ``output_dir``.

    Like a training job (:func:`memo.modes.frame.job_frame`), a failure is the row's ``status``
    and ``error``; measured figures are None, in the same columns.
    """
    with job_frame(cfg, output_dir, overrides, claimed=claimed, columns=METRIC_FIELDS) as job:
        _fit(resolve(cfg, gpu_visible=torch.cuda.is_available()), output_dir, job.row)
    return job.row


def _fit(run: Run, output_dir: Path, row: dict[str, Any]) -> None:
    problem = problem_of(run, _hardware(run))
    candidates = _candidates(run, problem)
    skipped = []
    if run.workload.parallel.search and run.fit.layouts == "runnable":
        skipped = [c for c in candidates if c.unrunnable]
        candidates = [c for c in candidates if not c.unrunnable]
        if not candidates:
            raise ConfigError(
                f"training runs no layout of cluster.gpus={run.cluster.gpus} for "
                f"method={run.workload.method.name} ({skipped[0].unrunnable}); set fit.layouts=all "
                "to predict them anyway"
            )
    for c in skipped:
        log.info("%s: not tried, training cannot run it: %s", candidate_label(c), c.unrunnable)
    start = time.perf_counter()
    results = []
    for k, candidate in enumerate(candidates, 1):
        result = evaluate(problem, candidate, run.workload.seq, run.seq_search)
        results.append(result)
        shown = result.shown
        log.info(
            "[%d/%d] %s: %s at %d tokens, %s per device, MFU %.1f%%%s",
            k,
            len(candidates),
            candidate_label(candidate),
            "fits" if result.best else shown.status,
            shown.seq,
            _gib(shown.device_total),
            100 * shown.time.mfu,
            "  (training cannot run it)" if candidate.unrunnable else "",
        )
    results.sort(key=LayoutResult.rank)
    row["fit.seconds"] = time.perf_counter() - start
    row["fit.layouts_tried"] = len(results)
    row["fit.runners_up"] = "; ".join(
        f"{candidate_label(r.candidate)}: {r.best.seq if r.best else r.failed.status}"
        for r in results[1 : 1 + run.fit.runners_up]
    )
    chosen = results[0].shown
    row.update(_row(chosen, problem))
    # how to train the chosen candidate
    row["method.tile_tokens"] = results[0].candidate.tile_tokens or WHOLE_LAYERS
    row["train.optimizer_offload"] = "host" if results[0].candidate.optimizer_offload else "none"
    row["fit.unrunnable"] = results[0].unrunnable  # None: training runs this layout
    _write_layouts(output_dir / LAYOUTS_FILE, results, skipped)
    log.info("%s", report(chosen, problem))


def _row(p: Prediction, problem: Problem) -> dict[str, Any]:
    """Training-row columns for prediction ``p``: its layout and length, sizes, ``predicted_*``."""
    devices = p.parallel.tp * p.parallel.cp * p.parallel.pp * p.parallel.dp
    workload = problem.workload
    global_batch = workload.micro_batch_size * problem.micro_batches * p.parallel.dp
    return {
        **{f"parallel.{k}": v for k, v in dataclasses.asdict(p.parallel).items() if k != "search"},
        "seq": p.seq,
        "world_size": devices,
        "dtype": dtype_label(torch_dtype(workload)),
        **{f"hardware.{k}": v for k, v in dataclasses.asdict(problem.hardware).items()},
        "params": parameter_count(workload.model),
        "train.loss": workload.loss,
        "global_batch_size": global_batch,
        "tokens_per_iter": global_batch * p.seq,
        "flops_per_iter": p.time.flops_per_iteration,
        **p.row(),
    }


def _write_layouts(path: Path, results: list[LayoutResult], skipped: list[Candidate]) -> None:
    """One line per layout: the predicted ones in rank order, then those not tried because
    training cannot run them (``status`` "unrunnable")."""
    columns = [
        "layout",
        "tp",
        "cp",
        "pp",
        "dp",
        "sequence_parallel",
        "tile_tokens",
        "optimizer_offload",
        "status",
        "seq",
        "device_bytes",
        "host_bytes_per_node",
        "alpha",
        "iter_time_s",
        "mfu",
        "reason",
        "unrunnable",
    ]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for r in results:
        p, shown = r.parallel, r.shown
        writer.writerow(
            [
                layout_label(p),
                p.tp,
                p.cp,
                p.pp,
                p.dp,
                p.sequence_parallel,
                r.candidate.tile_tokens or "",
                r.candidate.optimizer_offload,
                shown.status,
                shown.seq,
                shown.device_total,
                shown.host_per_node,
                shown.alpha,
                shown.time.iteration_s,
                shown.time.mfu,
                shown.reason,
                r.unrunnable or "",
            ]
        )
    for c in skipped:
        p = c.parallel
        writer.writerow([layout_label(p), p.tp, p.cp, p.pp, p.dp, p.sequence_parallel, c.tile_tokens or "",
                         c.optimizer_offload, "unrunnable", *[""] * 7, c.unrunnable])
    create_file_atomic(path, out.getvalue())


def report(p: Prediction, problem: Problem) -> str:
    """The prediction as the lines a user reads: terms per device and per node, α, verdict, time."""
    a, s, t = p.acts, p.states, p.time
    model, method = problem.workload.model, problem.workload.method
    policy = policy_of(problem.workload.in_layer_tiles(p.tile_tokens))
    lines = [
        f"{model.name}, {method.name}{' + plan' if problem.plan else ''}, "
        f"{p.seq} tokens, {layout_label(p.parallel)}"
        + (f", tiles of {p.tile_tokens} tokens" if p.tile_tokens else "")
        + f" on {problem.hardware.name}: {p.status.upper()}"
        + (f" ({p.reason})" if p.reason else ""),
        "per device:",
        f"  weights                    {_gib(s.weights)}  ({s.params:,} parameters)",
        f"  gradients                  {_gib(s.gradients)}",
        f"  optimizer states           {_gib(s.optimizer)}"
        + (f"  (on the host: {_gib(s.offload.host_bytes)}, {_gib(s.offload.pinned_bytes)} page-locked)"
           if s.offload.host_bytes else ""),
        f"  skeletal activations       {_gib((a.skeletal if a else 0) + p.rounding_buffers)}"
        + (f"  (rounding buffers {_gib(p.rounding_buffers)})" if p.rounding_buffers else ""),
        f"  transient activations      {_gib(a.transient if a else None)}",
        f"  embedding/logits/loss      {_gib(a.head if a else None)}",
        f"  persistent buffers         {_gib(a.persistent if a else None)}"
        "  (RoPE tables, any all-gather buffer, the tiles' stores and buffers)",
        f"  other activations          {_gib(a.other if a else None)}",
        f"  context-parallel buffers   {_gib(p.cp_buffers)}",
        f"  allocator overhead         {_gib(a.overhead if a else None)}"
        + (
            " (memory plan)"
            if problem.plan
            else f" (caching allocator, {a.alloc_retries if a else 0} retries)"
        ),
        f"  reserved (CUDA, NCCL)      {_gib(p.reserved)}",
        f"  total                      {_gib(p.device_total)} of {_gib(p.device_capacity)}"
        + (f"  (activations peak in {a.peak_phase})" if a else ""),
    ]
    lines += policy.report_lines(p)
    lines.append(
        f"time per iteration {t.iteration_s:.3f} s (layer forward {t.layer_forward_s * 1e3:.1f} ms, "
        f"backward {t.layer_backward_s * 1e3:.1f} ms, recompute {t.layer_recompute_s * 1e3:.1f} ms), "
        f"MFU {100 * t.mfu:.1f}%, TGS {t.tgs:,.0f}"
    )
    return "\n".join(lines)
