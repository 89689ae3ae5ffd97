"""What a training run does after each step, one hook a concern: throughput, memory, the
activations' accounting, validation, the step log, checkpoints, progress.

A hook is called with the step's record (:func:`memo.execute.train.run_steps`: ``step``,
``loss``, ``lr``, ``grad_norm``, ``iter_time_s``, ``timed``) and adds its columns to it or acts
on it; the hooks run in the order the job lists them, so a later one sees what the earlier ones
added (the log line its throughput, the step log every column).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from memo.config import TrainConfig
from memo.execute import checkpoint
from memo.execute.evaluate import validation_loss
from memo.execute.progress import StepProgress, format_seconds
from memo.metrics import PeakMemory, mfu, mfu_ceiling, model_flops, tgs
from memo.model.placement import LayerRuntime
from memo.results import ResultWriter

log = logging.getLogger("memo")


class StepHook(Protocol):
    """What runs after each training step with its record."""

    def __call__(self, record: dict) -> None:
        ...


def on_schedule(step: int, interval: Optional[int], last: int) -> bool:
    """Whether 1-based ``step`` is due every ``interval`` steps (None: never) or is the ``last``."""
    return interval is not None and (step % interval == 0 or step == last)


@dataclass
class Throughput:
    """TGS and MFU of the step (:mod:`memo.metrics.flops`), and where documents are kept apart,
    MFU by the attention they compute (each document's square, ``document_squared_tokens``)."""

    global_batch: int  # sequences per step, all data-parallel ranks together
    seq: int  # tokens per sequence
    devices: int
    flops_per_step: float  # the model FLOPs of a step, causal attention over whole sequences
    flops_parameters: int  # P of the MFU formula
    layers: int
    attention_width: int  # heads · head size (memo.model.attention_width)
    peak_flops: float  # per device

    def ceiling(self, gemm_flops: float, attention_forward_flops: float, attention_backward_flops: float) -> float:
        """The MFU a step would reach running only its model FLOPs at these kernel rates (FLOP/s;
        :func:`memo.metrics.flops.mfu_ceiling`), by the paper's formula (whole sequences)."""
        sequences = self.global_batch
        return mfu_ceiling(sequences * self.seq, sequences * self.seq**2, self.flops_parameters, self.layers,
                           self.attention_width, gemm_flops, attention_forward_flops, attention_backward_flops,
                           self.peak_flops)

    def __call__(self, record: dict) -> None:
        seconds = record["iter_time_s"]
        record["tgs"] = tgs(self.global_batch * self.seq, seconds, self.devices)
        record["mfu"] = mfu(self.flops_per_step, seconds, self.devices, self.peak_flops)
        if "document_squared_tokens" in record:
            record["flops_documents"] = model_flops(self.global_batch * self.seq, record["document_squared_tokens"],
                                                    self.flops_parameters, self.layers, self.attention_width)
            record["mfu_documents"] = mfu(record["flops_documents"], seconds, self.devices, self.peak_flops)


@dataclass
class MemoryReadings:
    """The device's (or the process's) peak memory so far."""

    memory: PeakMemory

    def __call__(self, record: dict) -> None:
        record.update(self.memory.read())


@dataclass
class ActivationAccounting:
    """The step's skeletal activations by layer into ``layers.jsonl`` and in all into the record,
    where the layers' runtime keeps them off autograd's hands (MEMO's swapping)."""

    runtime: LayerRuntime
    writer: ResultWriter

    def __call__(self, record: dict) -> None:
        accounting = self.runtime.accounting()
        if accounting is None:
            return
        self.writer.append_layers([
            {"step": record["step"], "layer": r["layer"], "device_bytes": r["device"], "host_bytes": r["host"],
             "recomputed_bytes": r["recomputed"]}
            for r in accounting.layers
        ])
        record.update(accounting.totals())


@dataclass
class Validation:
    """Every ``interval`` steps and after the last, the loss on held-out samples, whole and by
    position (:func:`memo.execute.evaluate.validation_loss`), into the record and the run's row."""

    interval: Optional[int]
    last_step: int
    evaluate: Callable[[], dict]  # the validation pass: ``valid_loss``, ``valid_loss_by_position``
    row: dict
    speaks: bool = True  # this rank logs it

    def __call__(self, record: dict) -> None:
        step = record["step"]
        if not on_schedule(step, self.interval, self.last_step):
            return
        record.update(self.evaluate())
        self.row.update(valid_loss=record["valid_loss"], valid_loss_by_position=record["valid_loss_by_position"])
        if self.speaks:
            log.info("step %d validation loss %.4f, by position: %s", step, record["valid_loss"],
                     " ".join("-" if v is None else f"{v:.4f}" for v in record["valid_loss_by_position"]))


def validation_pass(chunks: list, source, seq: int, train: TrainConfig, device: torch.device, layers_view,
                    eod: Optional[int], pipeline=None) -> Callable[[], dict]:
    """The validation pass of a run: ``train.eval_iters`` global batches of ``source``'s held-out
    samples through this rank's model ``chunks`` (through the stages of ``pipeline``, a
    :class:`memo.execute.pipeline.PipelineSchedule`, where there is one)."""
    return lambda: validation_loss(chunks, source, seq, train.micro_batch_size, train.eval_iters * train.micro_batches,
                                   train.eval_buckets, device, layers_view, eod, pipeline)


@dataclass
class StepLog:
    """The record into ``metrics.jsonl`` and into the run's list of records."""

    writer: ResultWriter
    records: list = field(default_factory=list)

    def __call__(self, record: dict) -> None:
        self.records.append(record)
        self.writer.append_step(record)


@dataclass
class Checkpointing:
    """Every ``interval`` steps and after the last, the model and the optimizer saved into
    ``save_dir`` (:func:`memo.execute.checkpoint.save`), the samples consumed counted from
    ``consumed`` at ``start_step``."""

    interval: Optional[int]
    last_step: int
    save_dir: Path
    chunks: list[torch.nn.Module]  # this rank's model chunks
    optimizer: object
    facts: checkpoint.RunFacts
    consumed: int  # samples consumed before ``start_step``
    start_step: int
    global_batch: int
    row: dict

    def __call__(self, record: dict) -> None:
        step = record["step"]
        if not on_schedule(step, self.interval, self.last_step):
            return
        samples = self.consumed + (step - self.start_step) * self.global_batch
        saved = checkpoint.save(self.save_dir, step, samples, self.chunks, self.optimizer, self.facts)
        self.row["checkpoint_last"] = str(saved.path)
        log.info("saved %s", saved.path)


@dataclass
class Progress:
    """Ends the run if a stop signal came (its interrupt may have been swallowed), advances the
    progress bar, and logs the step's line with the time left."""

    progress: StepProgress
    stop_if_signalled: Callable[[], None]
    last_step: int
    speaks: bool = True  # this rank logs it

    def __call__(self, record: dict) -> None:
        self.stop_if_signalled()
        left_s = self.progress.step(record["iter_time_s"], record["loss"])
        if self.speaks:
            log.info("step %d/%d  loss %.4f  %.3f s/it  TGS %.1f  MFU %.2f%%  %s left%s", record["step"],
                     self.last_step, record["loss"], record["iter_time_s"], record["tgs"], 100 * record["mfu"],
                     format_seconds(left_s), "" if record["timed"] else "  (warm-up)")
