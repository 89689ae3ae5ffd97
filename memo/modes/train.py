"""``mode=train``: one job from configuration to result row: check, start, build, train, measure.

Runs inside :func:`memo.modes.frame.job_frame`, which claims the run directory, maps however
the job ends to the row's status and writes the row.
"""

import dataclasses
import gc
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER
from omegaconf import DictConfig

from memo import hardware
from memo.hardware import GiB
from memo.config import ConfigError, DoesNotFit, Run, resolve
from memo.execute import checkpoint, distributed
from memo.data.batches import TokenSource, micro_batches, token_source
from memo.execute.hooks import (ActivationAccounting, Checkpointing, MemoryReadings, Progress, StepLog,
                                 Throughput, Validation, validation_pass)
from memo.execute.optimizer import StepOptimizer, build_optimizer, checkpoint_format
from memo.fit import choice, rates
from memo.fit.calibration import rates_of_row
from memo.plan.runtime import ALLOCATOR_FIELDS, TENSOR_BYTES_FIELDS, PlanRuntime, measured_allocator_row
from memo.plan.server import ServingStats
from memo.execute.pipeline import PipelineSchedule, in_flight as pipeline_in_flight
from memo.execute.progress import step_progress
from memo.execute.schedule import schedule_settings
from memo.execute.timeline import StepTimeline, combined
from memo.execute.train import TrainingStep, rank_tokens, run_steps, untimed_steps
from memo.metrics import PeakMemory, mfu, model_flops_per_sample, tgs
from memo.model import (
    BuiltModel,
    attention_width,
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
    "checkpoint_last", "steps_timed", "iter_time_s", "iter_time_s_median", "tgs", "mfu", "mfu_ceiling", "mfu_documents",
    "loss_first", "loss_last",
    *report_columns(),
    "valid_loss", "valid_loss_by_position", *ALLOCATOR_FIELDS, *TENSOR_BYTES_FIELDS, "plan.serving", *choice.ROW_FIELDS,
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
    if run.plan and run.device_type == "cuda" and run.train.eval_interval is not None:
        # (on the CPU the plan is validated, not served: nothing is reserved beside it)
        raise ConfigError("train.eval_interval with plan=true on a GPU: a validation pass runs between the planned "
                          "steps, from CUDA's pool beside the arena that holds a step's bytes, which the fit does "
                          "not count; set plan=false or train.eval_interval=null")
    if w.model.init_from is not None:  # (at the layout chosen: the vocabulary must stay unpadded at its tp)
        hf_checkpoint.check_config(w.model, Path(w.model.init_from), w.parallel.tp)


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
    """Everything of a job that can fail, as named phases; fills the job's row as facts become known."""
    arena = _arena(run, info)
    hw = hardware.with_measured_peak(hardware.resolve(run.hardware), torch_dtype(run.workload))
    _record_machine(run, hw, job.row)
    run = _of_processes(run, info)
    _check_runtime_support(run, policy_of(run.workload))  # what no choice changes: refused in seconds
    if run.workload.model.init_from is not None:  # the weights' files, once, before anything is built
        hf_checkpoint.check(run.workload.model, run.workload.model.init_from, run.workload.parallel.tp)
    chosen = _choose(run, hw, arena, info, job)  # before the process group: the fit traces with its own
    if run.device_type == "cuda" and info.rank == 0 and arena is None and rates_of_row(job.row) is None:
        job.row.update(rates.row_of_this_device(run))  # what the kernels reach here: the row's MFU ceiling
    if chosen is None:
        distributed.check_world_size(run.workload.parallel, info.world_size)  # refused before joining
    distributed.join(run.device_type, info)
    if chosen is not None:
        run = _agreed(run, chosen, job)
    distributed.build_groups(run.workload.parallel, info)
    policy = policy_of(run.workload)
    started = _start(run, policy, hw, arena, info, job)
    runtime: LayerRuntime = NullRuntime()
    try:
        built = _build(run, policy, started, job.row, job.writer)
        runtime = _place(run, policy, started, built, job)
        trained = _run(run, policy, started, built, runtime, info, job)
    except BaseException:
        job.row.update(started.memory.read())  # this rank's peak: the others may be gone
        raise
    finally:
        runtime.release()
    _summarize(run, started, trained, info, job.row)


@dataclass
class Started:
    """What the start phase settled: the machine, the checkpoint to go on from, the records kept."""

    hw: hardware.Hardware
    dtype: torch.dtype
    device: torch.device  # this rank's
    host_budget: float  # bytes of host memory this rank's activations may fill, before Adam's share
    arena: Optional[object]  # the plan's CUDA arena (memo.plan.cuda_arena), where installed
    save_dir: Path
    resume_from: Optional[checkpoint.Checkpoint]
    saved: Optional[dict]  # the facts of the checkpoint to go on from
    facts: checkpoint.RunFacts  # this run's
    memory: PeakMemory
    source: TokenSource  # checked before the model is built


def _of_processes(run: Run, info: distributed.ProcessInfo) -> Run:
    """``run``, choosing its layout (``parallel=auto``), over the processes the launcher started:
    ``cluster.gpus`` is their number, or must be.

    Raises:
        ConfigError: if ``cluster.gpus`` is another number.
    """
    if not run.choices.layout:
        return run
    gpus = run.cluster.gpus
    if gpus is not None and gpus != info.world_size:
        raise ConfigError(f"parallel=auto chooses a layout of the {info.world_size} process(es) launched, and "
                          f"cluster.gpus={gpus}; launch {gpus} or drop cluster.gpus")
    return dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, gpus=info.world_size))


def _arena(run: Run, info: distributed.ProcessInfo) -> Optional[object]:
    """The plan's CUDA arena (``plan=true`` on a GPU), installed before this process's first CUDA
    tensor and before anything (reading the GPU's name for hardware=auto, say) initialises CUDA."""
    if not (run.plan and run.device_type == "cuda"):
        return None
    from memo.plan import cuda_arena

    return cuda_arena.install(phase=lambda: "setup", device=distributed.device_index(info))


def _record_machine(run: Run, hw: hardware.Hardware, row: dict) -> None:
    """The facts every row carries, refused or not: the length, the loss, the dtype, the machine."""
    row["seq"] = run.workload.seq
    row["train.loss"] = run.workload.loss
    row["dtype"] = dtype_label(torch_dtype(run.workload))
    row.update({f"hardware.{k}": v for k, v in dataclasses.asdict(hw).items()})
    if run.device_type == "cuda":
        row["device_name"] = torch.cuda.get_device_name()


@dataclass(frozen=True)
class _Chosen:
    """What a rank brings to the choice: rank 0 its outcome (the choice, or the error that ends
    the run on every rank) and Adam's placement; every rank its device's free bytes."""

    made: Optional[choice.Choice]
    error: Optional[tuple[type, str]]
    optimizer_offload: str
    device_bytes: int


def _choose(run: Run, hw: hardware.Hardware, arena: Optional[object], info: distributed.ProcessInfo,
            job: Job) -> Optional[_Chosen]:
    """Where ``run`` leaves settings to choose (:class:`memo.config.Choices`, the same on every
    rank): this rank's device's free bytes now, and on rank 0 the fit's choice
    (:mod:`memo.fit.choice`), before anything of the run is allocated, with Adam kept where the
    checkpoint the run goes on from has it. Nothing here raises: every rank must reach the
    process group, where :func:`_agreed` ends them all together."""
    if not run.choices.any:
        return None
    held = 0
    if run.device_type == "cuda":
        torch.cuda.set_device(distributed.device_index(info))
        # the rates the choice's times are predicted with (hardware=auto), measured outside the plan's
        # arena, which serves the run's own requests only
        if info.rank == 0 and arena is None:
            run, hw, measured = rates.of_this_device(run, hw)
            job.row.update(measured)
        held = 0 if arena is not None else torch.cuda.memory_reserved()  # (the arena keeps no statistics)
    machine = hardware.available_now(hw, run.hardware, held)
    placement, made, error = run.train.optimizer_offload, None, None
    if info.rank == 0:
        try:
            saved = _saved_optimizer(run, job)
            if saved is not None and run.choices.optimizer_offload:
                placement = "host" if saved == "megatron_host_offload" else "none"
                run = dataclasses.replace(run, train=dataclasses.replace(run.train, optimizer_offload=placement),
                                          choices=dataclasses.replace(run.choices, optimizer_offload=False))
            if run.choices.any:
                made = choice.choose(run, machine)
        except Exception as failed:  # ends every rank, in _agreed
            error = (type(failed), str(failed)) if isinstance(failed, ConfigError) else (
                RuntimeError, f"choosing the run's settings failed: {type(failed).__name__}: {failed}")
    return _Chosen(made, error, placement, machine.device_memory_bytes)


def _agreed(run: Run, mine: _Chosen, job: Job) -> Run:
    """``run`` as rank 0 chose it, on every rank, or the error that ends them all; refused where the
    least free memory of any rank's device is below what the choice needs. The choice into the
    row and the log."""
    shared = [(mine.made, mine.error, mine.optimizer_offload)]
    dist.broadcast_object_list(shared, src=0)
    made, error, placement = shared[0]
    least = torch.tensor([mine.device_bytes], dtype=torch.float64,
                         device="cpu" if run.device_type == "cpu" else torch.cuda.current_device())
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    if error is not None:
        kind, message = error
        raise kind(message)
    if placement != run.train.optimizer_offload:  # the checkpoint's
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, optimizer_offload=placement),
                                  choices=dataclasses.replace(run.choices, optimizer_offload=False))
    if made is None:
        return run
    p = made.prediction
    if least.item() < p.device_total + p.margin:
        raise DoesNotFit(f"rank 0 chose {made.described}, which needs {p.device_total / GiB:.2f} "
                         f"GiB and a margin of {p.margin / GiB:.2f} GiB, and a rank's device has "
                         f"{least.item() / GiB:.2f} GiB free; free that device or set method.tile_tokens")
    job.row.update(made.row())
    log.info("%s", made.summary())
    return made.apply(run)


def _saved_optimizer(run: Run, job: Job) -> Optional[str]:
    """The optimizer's format in the checkpoint the run goes on from (None: it starts afresh), as
    rank 0 finds it (in ``train.save_dir``, else its run directory's ``checkpoints/``)."""
    save_dir = Path(run.train.save_dir) if run.train.save_dir is not None else job.writer.output_dir / CHECKPOINTS_DIR
    resume_from = checkpoint.to_load(run.train, save_dir)
    return None if resume_from is None else checkpoint.saved_facts(resume_from.path)["optimizer"]


def _start(run: Run, policy: ActivationPolicy, hw: hardware.Hardware, arena: Optional[object],
           info: distributed.ProcessInfo, job: Job) -> Started:
    """The checks that need the process group, and the checkpoint this run goes on from: all before
    the model is built, so that a refusal comes in seconds."""
    workload, train, device_type = run.workload, run.train, run.device_type
    _check_runtime_support(run, policy)
    dtype = torch_dtype(workload)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    # Only a policy that swaps looks at what may be pinned; before Adam's states offloaded to the
    # host take their share of it (which the place phase takes out, though part of it is
    # allocated only at the first step)
    host_budget = policy.host_budget(hw, device, info.world_size)
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
    facts = checkpoint.RunFacts.of(workload.model, dtype_setting(dtype),
                                   checkpoint_format(train, device_type, workload.parallel),
                                   schedule_settings(train), workload.seq, train)
    saved = checkpoint.saved_facts(resume_from.path) if resume_from is not None else None
    if saved is not None:
        checkpoint.check_resumable(resume_from.path, saved, facts, auto=train.load == "auto")
    # the data, its tokenizer and its vocabulary checked before the model is built (seconds, not minutes)
    source = token_source(train, workload.model.vocab_size, workload.seq, validation=train.eval_interval is not None)
    memory = PeakMemory(device_type, arena)
    memory.reset()
    return Started(hw, dtype, device, host_budget, arena, save_dir, resume_from, saved, facts, memory, source)


@dataclass
class Built:
    """The model and its optimizer, at the step they go on from."""

    model: BuiltModel
    optimizer: StepOptimizer
    start_step: int
    consumed: int  # samples of the data consumed before ``start_step``


def _build(run: Run, policy: ActivationPolicy, started: Started, row: dict, writer: ResultWriter) -> Built:
    """The model (from Hugging Face weights where asked) and its optimizer, loaded from the
    checkpoint the run goes on from."""
    workload, train, device_type = run.workload, run.train, run.device_type
    torch.manual_seed(train.seed)  # build_gpt seeds Megatron's CUDA generators from it
    built = build_gpt(workload, device_type, train.attention_backend, layers=policy.layers)
    if workload.model.init_from is not None:
        read = hf_checkpoint.load(built.chunks, workload.model, workload.model.init_from)
        log.info("weights: %d tensors of %s", read, workload.model.init_from)
    optimizer = build_optimizer(built.chunks, train, device_type, workload.parallel)
    resumed = None
    if started.saved is not None:
        resumed = checkpoint.load(started.resume_from, started.saved, built.chunks, optimizer)
    row["resumed_from_step"] = resumed.step if resumed else None
    if run.train.resume:  # the step logs of the run continued: through the step it goes on from
        writer.keep_steps_through(resumed.step if resumed else 0)
    if optimizer.offload.host_bytes:
        row.update({f"optimizer_offload.{k}": v for k, v in optimizer.offload.row().items()})
    if device_type == "cuda":  # which Adam Megatron runs, for a prediction of this row (memo.fit.calibration)
        row["optimizer_pytorch_adam"] = USING_PYTORCH_OPTIMIZER
    return Built(built, optimizer, *((resumed.step, resumed.consumed_samples) if resumed else (0, 0)))


def _place(run: Run, policy: ActivationPolicy, started: Started, built: Built, job: Job) -> LayerRuntime:
    """What runs the layers through training, ready (:meth:`memo.policy.ActivationPolicy.prepare`),
    its decisions into the row, ``layers.jsonl`` and the log."""
    budget = max(started.host_budget - built.optimizer.offload.host_bytes, 0)
    group = parallel_state.get_tensor_model_parallel_group() if dist.is_initialized() else None
    parallel = run.workload.parallel
    in_flight = pipeline_in_flight(parallel.pp, parallel_state.get_pipeline_model_parallel_rank(),
                                   run.train.micro_batches, parallel.vpp)
    runtime = policy.prepare_stage(built.model.chunks, run.workload, started.device, budget, in_flight, group=group)
    report = runtime.report()
    job.row.update(report.row)
    job.writer.append_layers(list(report.layer_records))
    if report.summary is not None:
        log.info("%s", report.summary)
    return runtime


def _run(run: Run, policy: ActivationPolicy, started: Started, built: Built, runtime: LayerRuntime,
         info: distributed.ProcessInfo, job: Job) -> list[dict]:
    """Train from the step the run goes on from to its last, each step's after-work done by the
    hooks of :mod:`memo.execute.hooks`; returns the steps' records."""
    workload, train, device_type, row = run.workload, run.train, run.device_type, job.row
    model, seq = workload.model, workload.seq
    dp_size = parallel_state.get_data_parallel_world_size()
    global_batch = workload.micro_batch_size * train.micro_batches * dp_size
    source = started.source
    eod = source.eod if train.document_mask else None  # (Megatron data: validated)
    batches = micro_batches(source, seq, workload.micro_batch_size, train.micro_batches,
                            parallel_state.get_data_parallel_rank(), dp_size, torch.device(device_type),
                            built.consumed, eod)
    flops_parameters, width = model_flops_parameters(model), attention_width(model)
    throughput = Throughput(global_batch, seq, info.world_size,
                            global_batch * model_flops_per_sample(seq, flops_parameters, model.num_layers, width),
                            flops_parameters, model.num_layers, width, started.hw.peak_flops)
    row.update(params=built.model.params, global_batch_size=global_batch, tokens_per_iter=global_batch * seq,
               flops_per_iter=throughput.flops_per_step, layer_spec=built.model.layer_spec,
               attention_backend=built.model.attention_backend,
               attention_block_kernel=built.model.attention_block_kernel, optimizer=built.optimizer.name)
    kernel_rates = rates_of_row(row) or rates_of_row(row, rates.KERNEL_RATES)
    if kernel_rates is not None and started.hw.peak_flops:
        row["mfu_ceiling"] = throughput.ceiling(kernel_rates.gemm_flops, kernel_rates.attention_forward_flops,
                                                kernel_rates.attention_backward_flops)
    log.info("%s: %s params, seq %d, %s on %s (%s, %s attention, %s blocks), %d process(es)", model.name,
             f"{built.model.params:,}", seq, workload.method.name, started.hw.name, row["dtype"],
             built.model.attention_backend, built.model.attention_block_kernel, info.world_size)

    this_ranks_tokens = rank_tokens(policy.layers.sequence_layout)
    speaks, log_records = info.rank == 0, StepLog(job.writer)
    plan = PlanRuntime(built.model.module if workload.parallel.pp == 1 else None, run.plan, run.planner, untimed_steps(train, built.start_step),
                       device_type, started.arena, layers=runtime)
    if started.arena is not None:
        started.arena.phase = plan.phase
    def layers_view(micro_batch: dict) -> dict:  # (a walk in tiles under sequence parallelism reorders tokens)
        return runtime.token_order(this_ranks_tokens(micro_batch))

    pipeline = None if workload.parallel.pp == 1 else PipelineSchedule(
        built.optimizer.chunks, device_type, seq, workload.micro_batch_size, runtime)
    step = TrainingStep(built.optimizer, device_type, layers_view, built.model.step_end, pipeline)
    with step_progress(train.steps - built.start_step, show_bar=speaks) as progress:
        hooks = [
            throughput,
            MemoryReadings(started.memory),
            ActivationAccounting(runtime, job.writer),
            Validation(train.eval_interval, train.steps, validation_pass(
                built.optimizer.chunks, source, seq, train, torch.device(device_type), layers_view, eod, pipeline),
                row, speaks),
            log_records,
            Checkpointing(train.save_interval, train.steps, started.save_dir, built.model.chunks, built.optimizer,
                          started.facts, built.consumed, built.start_step, global_batch, row),
            Progress(progress, job.stop_if_signalled, train.steps, speaks),
        ]
        timeline = StepTimeline(train.timeline_step, built.start_step, job.writer.output_dir, device_type,
                                job.writer.enabled and info.rank == 0)
        run_steps(step, batches, train, hooks, combined(plan.step, timeline.around), built.start_step)
    row.update(plan.finish())
    return log_records.records


def _summarize(run: Run, started: Started, records: list[dict], info: distributed.ProcessInfo, row: dict) -> None:
    """The row's figures of the whole run: memory (the largest over the ranks), the allocator's,
    and the timed steps' mean time, TGS and MFU."""
    row.update(_max_over_ranks(started.memory.read(), run.device_type))
    if run.device_type == "cuda":
        row.update(measured_allocator_row(row, started.arena is not None))
    times = [r["iter_time_s"] for r in records if r["timed"]]
    iter_time = statistics.fmean(times)
    peak, world = started.hw.peak_flops, info.world_size
    row.update(
        steps_timed=len(times),
        iter_time_s=iter_time,
        iter_time_s_median=statistics.median(times),
        tgs=tgs(row["tokens_per_iter"], iter_time, world),
        mfu=mfu(row["flops_per_iter"], iter_time, world, peak),
        mfu_documents=(mfu(statistics.fmean(r["flops_documents"] for r in records if r["timed"]), iter_time,
                           world, peak) if run.train.document_mask else None),
        loss_first=records[0]["loss"],
        loss_last=records[-1]["loss"],
    )
