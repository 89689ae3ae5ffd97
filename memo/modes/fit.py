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
from memo.config import WHOLE_LAYERS, ConfigError, Run, resolve
from memo.fit import rates
from memo.fit.choice import candidates, evaluate, problem_of
from memo.fit.predict import Prediction, Problem, prediction_hardware
from memo.fit.search import Candidate, LayoutResult, candidate_label, layout_label
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


def fit_job(cfg: DictConfig, output_dir: Path, overrides=(), claimed: bool = False) -> dict[str, Any]:
    """Run ``mode=fit`` for ``cfg``; write ``result.json`` and ``layouts.csv`` into ``output_dir``.

    Like a training job (:func:`memo.modes.frame.job_frame`), a failure is the row's ``status``
    and ``error``; measured figures are None, in the same columns.
    """
    with job_frame(cfg, output_dir, overrides, claimed=claimed, columns=METRIC_FIELDS) as job:
        _fit(resolve(cfg, gpu_visible=torch.cuda.is_available()), output_dir, job.row)
    return job.row


def _fit(run: Run, output_dir: Path, row: dict[str, Any]) -> None:
    run, hw, measured = rates.of_this_device(run, _hardware(run))  # hardware=auto on a GPU
    row.update(measured)
    problem = problem_of(run, hw)
    tried = candidates(run, problem)
    skipped = []
    if run.workload.parallel.search and run.fit.layouts == "runnable":
        skipped = [c for c in tried if c.unrunnable]
        tried = [c for c in tried if not c.unrunnable]
        if not tried:
            raise ConfigError(
                f"training runs no layout of cluster.gpus={run.cluster.gpus} for "
                f"method={run.workload.method.name} ({skipped[0].unrunnable}); set fit.layouts=all "
                "to predict them anyway"
            )
    for c in skipped:
        log.info("%s: not tried, training cannot run it: %s", candidate_label(c), c.unrunnable)
    start = time.perf_counter()
    results = []
    for k, candidate in enumerate(tried, 1):
        result = evaluate(problem, candidate, run.workload.seq, run.seq_search)
        results.append(result)
        shown = result.shown
        log.info(
            "[%d/%d] %s: %s at %d tokens, %s per device, MFU %.1f%%%s",
            k,
            len(tried),
            candidate_label(candidate),
            "fits" if result.best else shown.status,
            shown.seq,
            _gib(shown.device_total),
            100 * shown.time.mfu,
            "  (training cannot run it)" if candidate.unrunnable else "",
        )
        if k == 1 and result.best is not None and _nothing_faster(run):
            break
    results.sort(key=LayoutResult.rank)
    row["fit.seconds"] = time.perf_counter() - start
    row["fit.layouts_tried"] = len(results)
    row["fit.runners_up"] = "; ".join(
        f"{candidate_label(r.candidate)}: {r.best.seq if r.best else r.failed.status}"
        for r in results[1 : 1 + run.fit.runners_up]
    )
    # the best with pipeline stages and the best without, beside each other
    for key, pipelined in (("fit.best_without_pp", False), ("fit.best_with_pp", True)):
        best = next((r for r in results if (r.candidate.parallel.pp > 1) == pipelined), None)
        row[key] = None if best is None else _summary(best)
        if best is not None and len(results) > 1:
            log.info("best %s pipeline stages: %s", "with" if pipelined else "without", row[key])
    chosen = results[0].shown
    row.update(_row(chosen, problem))
    # how to train the chosen candidate
    row["method.tile_tokens"] = results[0].candidate.tile_tokens or WHOLE_LAYERS
    row["train.optimizer_offload"] = "host" if results[0].candidate.optimizer_offload else "none"
    row["train.loss_tile_tokens"] = results[0].candidate.loss_tile_tokens or run.workload.loss_tile_tokens
    row["fit.unrunnable"] = results[0].unrunnable  # None: training runs this layout
    _write_layouts(output_dir / LAYOUTS_FILE, results, skipped)
    log.info("%s", report(chosen, problem))


def _summary(result) -> str:
    """A layout result in a few words: its layout, and the length it fits at and its MFU, or why not."""
    shown = result.shown
    reach = f"{shown.seq} tokens, MFU {100 * shown.time.mfu:.1f}%" if result.best else shown.status
    return f"{candidate_label(result.candidate)}: {reach}"


def _nothing_faster(run: Run) -> bool:
    """Whether the first candidate, where it fits, is the answer: at one layout and length, the
    run's choices come first as whole layers with Adam on the device (:func:`memo.fit.choice.candidates`)."""
    return run.seq_search is None and not run.workload.parallel.search


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
        f"  CUDA context, libraries    {_gib(p.reserved - p.nccl.bytes)}",
        f"  NCCL buffers               {_gib(p.nccl.bytes)}" + (f"  ({p.nccl.assumption})" if p.nccl.bytes else ""),
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
