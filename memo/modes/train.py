"""``mode=train``: one job from configuration to result row: check, start, build, train, measure.

Runs inside :func:`memo.modes.frame.job_frame`, which claims the run directory, maps however
the job ends to the row's status and writes the row.
"""

import dataclasses
import gc
import logging
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from omegaconf import DictConfig

from memo import hardware
from memo.config import ConfigError, Run, resolve
from memo.execute import checkpoint, distributed
from memo.execute.data import micro_batches, token_source
from memo.execute.optimizer import build_optimizer, checkpoint_format
from memo.execute.plan_runtime import ALLOCATOR_FIELDS, PlanRuntime, measured_allocator_row
from memo.execute.evaluate import validation_loss
from memo.execute.plan_server import ServingStats
from memo.execute.progress import format_seconds, step_progress
from memo.execute.schedule import schedule_settings
from memo.execute.train import rank_tokens, run_steps, untimed_steps
from memo.metrics import PeakMemory, mfu, model_flops, model_flops_per_sample, tgs
from memo.model import (
    build_gpt,
    dtype_label,
    dtype_setting,
    hf_checkpoint,
    model_flops_parameters,
    torch_dtype,
    uses_transformer_engine,
)
from memo.model.placement import LayerRuntime, NullRuntime
from memo.modes.frame import Job, job_frame
from memo.policy import ActivationPolicy, policy_of
from memo.results import CHECKPOINTS_DIR, ResultWriter
from memo.swap import report_columns

log = logging.getLogger("memo")

# Fields every row carries, so that a table of ok and failed runs has the same columns.
METRIC_FIELDS = (
    "params", "global_batch_size", "tokens_per_iter", "flops_per_iter", "resumed_from_step",
    "checkpoint_last", "steps_timed", "iter_time_s", "iter_time_s_median", "tgs", "mfu", "mfu_documents", "loss_first",
    "loss_last",
    *report_columns(),
    "valid_loss", "valid_loss_by_position", *ALLOCATOR_FIELDS, "plan.serving",
    *(f"plan.{f.name}" for f in dataclasses.fields(ServingStats)),
)


def _check_runtime_support(run: Run, policy: ActivationPolicy) -> None:
    w = run.workload
    policy.check_training(w.parallel)
    te = uses_transformer_engine(run.device_type, run.train.attention_backend, policy.layers, w.method.name)
    if te and w.document_mask:
        raise ConfigError(f"train.document_mask keeps documents apart in memo's own attention, and method="
                          f"{w.method.name} here runs Transformer Engine's; set train.attention_backend to flash, "
                          "cudnn or efficient, or train.document_mask=false")
    if w.model.init_from is not None:
        hf_checkpoint.check_config(w.model, Path(w.model.init_from), w.parallel.tp)


def _swap_accounting(runtime: LayerRuntime, step: int, writer: ResultWriter) -> dict:
    """One step's activation bytes: per layer into ``layers.jsonl``, totals for the step record."""
    accounting = runtime.accounting()
    if accounting is None:
        return {}
    writer.append_layers([
        {"step": step, "layer": r["layer"], "device_bytes": r["device"], "host_bytes": r["host"],
         "recomputed_bytes": r["recomputed"]}
        for r in accounting.layers
    ])
    return accounting.totals()


def _max_over_ranks(values: dict, device_type: str) -> dict:
    """Each numeric memory figure as its maximum over all processes."""
    keys = [k for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)]
    if not keys or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device_type)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {**values, **{k: int(v) for k, v in zip(keys, t.tolist(), strict=True)}}


def _save_dir(train, output_dir: Path) -> Path:
    """``train.save_dir``, else ``checkpoints/`` in the run directory of rank 0 (the other ranks
    of a ``torchrun run.py`` job run in scratch directories of their own)."""
    if train.save_dir is not None:
        return Path(train.save_dir)
    shared = [str(output_dir / CHECKPOINTS_DIR)]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def run_job(
    cfg: DictConfig,
    output_dir: Path,
    overrides: Sequence[str] = (),
    info: Optional[distributed.ProcessInfo] = None,
    claimed: bool = False,
) -> dict[str, Any]:
    """Run the training job ``cfg`` describes and return its row (also written to ``output_dir``).

    Args:
        cfg: a composed :class:`memo.config.RunConfig`.
        output_dir: where rank 0 writes ``result.json`` and ``metrics.jsonl``.
        overrides: the command-line overrides, recorded in the row.
        info: the process layout; read from the launcher's environment when omitted.
        claimed: ``output_dir`` is claimed already (by ``run.py``).

    Raises:
        ConfigError: only if ``output_dir`` belongs to another run or cannot be written; every
            other failure is reported in the row's ``status`` and ``error``.
        KeyboardInterrupt, SystemExit: passed on after the ``interrupted`` row is written.
    """
    info = info or distributed.process_info()
    with job_frame(cfg, output_dir, overrides, rank=info.rank, claimed=claimed,
                   columns=METRIC_FIELDS) as job:
        job.row["world_size"] = info.world_size
        try:
            _train(resolve(cfg, gpu_visible=torch.cuda.is_available()), info, job)
        finally:
            distributed.shutdown()
            # The failed job's model and optimizer are garbage now; give their memory back
            # before the next job of a sweep starts in this process.
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return job.row


def _train(run: Run, info: distributed.ProcessInfo, job: Job) -> None:
    """Everything of a job that can fail; fills the job's row as facts become known."""
    row, writer = job.row, job.writer
    workload, train, device_type = run.workload, run.train, run.device_type
    model, seq = workload.model, workload.seq
    row["seq"] = seq
    row["train.loss"] = workload.loss
    policy = policy_of(workload)
    arena = None
    if run.plan and device_type == "cuda":
        from memo.execute import cuda_arena

        # before this process's first CUDA tensor, and before anything (reading the GPU's name
        # for hardware=auto, say) initialises CUDA
        arena = cuda_arena.install(phase=lambda: "setup", device=distributed.device_index(info))
    hw = hardware.resolve(run.hardware)
    _check_runtime_support(run, policy)
    dtype = torch_dtype(workload)
    hw = hardware.with_measured_peak(hw, dtype)
    row["dtype"] = dtype_label(dtype)
    row.update({f"hardware.{k}": v for k, v in dataclasses.asdict(hw).items()})
    if device_type == "cuda":
        row["device_name"] = torch.cuda.get_device_name()

    distributed.initialize(workload.parallel, device_type, info)
    save_dir = _save_dir(train, job.writer.output_dir)
    resume_from = checkpoint.to_load(train, save_dir)
    if resume_from is not None and resume_from.step >= train.steps:
        if train.load == "auto" and resume_from.step == train.steps:  # a requeue after the last save
            raise ConfigError(f"{resume_from.path} has all train.steps={train.steps} steps: this run trained to "
                              "its end and stopped before writing its row; its weights are there to load or export")
        raise ConfigError(f"{resume_from.path} has {resume_from.step} steps done, train.steps={train.steps}; raise "
                          "train.steps to train further")
    if train.save_interval is not None:
        checkpoint.check_save_dir(save_dir, resume_from)
    facts = checkpoint.RunFacts.of(model, dtype_setting(dtype),
                                   checkpoint_format(train, device_type, workload.parallel),
                                   schedule_settings(train), seq, train)
    saved = checkpoint.saved_facts(resume_from.path) if resume_from is not None else None
    if saved is not None:  # before the model is built: a refusal comes in seconds
        checkpoint.check_resumable(resume_from.path, saved, facts, auto=train.load == "auto")
    torch.manual_seed(train.seed)  # build_gpt seeds Megatron's CUDA generators from it
    memory = PeakMemory(device_type, arena)
    memory.reset()
    placement: LayerRuntime = NullRuntime()
    try:
        built = build_gpt(workload, device_type, train.attention_backend, layers=policy.layers)
        if model.init_from is not None:
            read = hf_checkpoint.load(built.module, model, model.init_from)
            log.info("weights: %d tensors of %s", read, model.init_from)
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device("cpu")
        # (only swapping fills the host: what may be pinned is not even looked at otherwise;
        # measured before Adam's states offloaded to the host take their share of it, all of it
        # taken out below, though part of it is allocated only at the first step)
        budget = policy.host_budget(hw, device, info.world_size)
        optimizer = build_optimizer(built.module, train, device_type, workload.parallel)
        resumed = checkpoint.load(resume_from, saved, built.module, optimizer) if saved is not None else None
        start_step, consumed = (resumed.step, resumed.consumed_samples) if resumed else (0, 0)
        row["resumed_from_step"] = start_step if resumed else None
        if optimizer.offload.host_bytes:
            row.update({f"optimizer_offload.{k}": v for k, v in optimizer.offload.row().items()})
        budget = max(budget - optimizer.offload.host_bytes, 0)
        tp_group = parallel_state.get_tensor_model_parallel_group() if dist.is_initialized() else None
        placement = policy.prepare(built.module, workload, device, budget, group=tp_group)
        report = placement.report()
        row.update(report.row)
        writer.append_layers(list(report.layer_records))
        if report.summary is not None:
            log.info("%s", report.summary)
        dp_size = parallel_state.get_data_parallel_world_size()
        global_batch = workload.micro_batch_size * train.micro_batches * dp_size
        source = token_source(train, model.vocab_size, seq, validation=train.eval_interval is not None)
        eod = source.eod if train.document_mask else None  # (Megatron data: validated)
        batches = micro_batches(
            source, seq, workload.micro_batch_size, train.micro_batches,
            parallel_state.get_data_parallel_rank(), dp_size, torch.device(device_type), consumed, eod,
        )
        flops_parameters = model_flops_parameters(model)
        flops_per_iter = global_batch * model_flops_per_sample(seq, flops_parameters, model.num_layers,
                                                               model.hidden_size)
        row.update(
            params=built.params,
            global_batch_size=global_batch,
            tokens_per_iter=global_batch * seq,
            flops_per_iter=flops_per_iter,
            layer_spec=built.layer_spec,
            attention_backend=built.attention_backend,
            attention_block_kernel=built.attention_block_kernel,
            optimizer=optimizer.name,
        )
        log.info(
            "%s: %s params, seq %d, %s on %s (%s, %s attention, %s blocks), %d process(es)",
            model.name, f"{built.params:,}", seq, workload.method.name, hw.name,
            row["dtype"], built.attention_backend, built.attention_block_kernel, info.world_size,
        )

        records = []
        this_ranks_tokens = rank_tokens(policy.layers.sequence_layout)

        def on_step(record: dict) -> None:  # runs inside the `with` below, where progress is set
            record["tgs"] = tgs(global_batch * seq, record["iter_time_s"], info.world_size)
            record["mfu"] = mfu(flops_per_iter, record["iter_time_s"], info.world_size, hw.peak_flops)
            if "document_squared_tokens" in record:  # the attention computed: each document's square
                record["flops_documents"] = model_flops(global_batch * seq, record["document_squared_tokens"],
                                                        flops_parameters, model.num_layers, model.hidden_size)
                record["mfu_documents"] = mfu(record["flops_documents"], record["iter_time_s"], info.world_size,
                                              hw.peak_flops)
            record.update(memory.read())
            record.update(_swap_accounting(placement, record["step"], writer))
            step = record["step"]
            if train.eval_interval is not None and (step % train.eval_interval == 0 or step == train.steps):
                record.update(validation_loss(
                    optimizer.model, source, seq, workload.micro_batch_size, train.eval_iters * train.micro_batches,
                    train.eval_buckets, torch.device(device_type), this_ranks_tokens, eod))
                row.update(valid_loss=record["valid_loss"], valid_loss_by_position=record["valid_loss_by_position"])
                if info.rank == 0:
                    log.info("step %d validation loss %.4f, by position: %s", step, record["valid_loss"],
                             " ".join("-" if v is None else f"{v:.4f}" for v in record["valid_loss_by_position"]))
            records.append(record)
            writer.append_step(record)
            if train.save_interval is not None and (step % train.save_interval == 0 or step == train.steps):
                saved = checkpoint.save(save_dir, step, consumed + (step - start_step) * global_batch,
                                        built.module, optimizer, facts)
                row["checkpoint_last"] = str(saved.path)
                log.info("saved %s", saved.path)
            job.stop_if_signalled()  # a stop signal whose interrupt a finalizer swallowed
            left_s = progress.step(record["iter_time_s"], record["loss"])
            if info.rank == 0:
                log.info(
                    "step %d/%d  loss %.4f  %.3f s/it  TGS %.1f  MFU %.2f%%  %s left%s",
                    record["step"], train.steps, record["loss"], record["iter_time_s"],
                    record["tgs"], 100 * record["mfu"], format_seconds(left_s),
                    "" if record["timed"] else "  (warm-up)",
                )

        runtime = PlanRuntime(built.module, run.plan, run.planner, untimed_steps(train, start_step), device_type, arena,
                              layers=placement)
        if arena is not None:
            arena.phase = runtime.phase
        with step_progress(train.steps - start_step, show_bar=info.rank == 0) as progress:
            run_steps(optimizer, batches, train, device_type, on_step, runtime.step,
                      this_ranks_tokens=this_ranks_tokens,
                      token_order=placement.token_order,
                      step_end=built.step_end, start_step=start_step)
        row.update(runtime.finish())
    except BaseException:
        row.update(memory.read())  # this rank's peak: the others may be gone
        raise
    finally:
        placement.release()
    row.update(_max_over_ranks(memory.read(), device_type))
    if device_type == "cuda":
        row.update(measured_allocator_row(row, arena is not None))

    times = [r["iter_time_s"] for r in records if r["timed"]]
    iter_time = statistics.fmean(times)
    row.update(
        steps_timed=len(times),
        iter_time_s=iter_time,
        iter_time_s_median=statistics.median(times),
        tgs=tgs(global_batch * seq, iter_time, info.world_size),
        mfu=mfu(flops_per_iter, iter_time, info.world_size, hw.peak_flops),
        mfu_documents=(mfu(statistics.fmean(r["flops_documents"] for r in records if r["timed"]), iter_time,
                           info.world_size, hw.peak_flops) if train.document_mask else None),
        loss_first=records[0]["loss"],
        loss_last=records[-1]["loss"],
    )
