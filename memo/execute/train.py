"""The training loop: forward, backward and optimizer step, timed per step.

One step runs ``train.micro_batches`` forward/backward passes (gradients accumulate), then the
optimizer. Its wall-clock time covers all of it, device work included (the GPU is synchronized
before the clock stops); preparing the step's tokens happens before the clock starts. The
loss reported is the mean over micro-batches and data-parallel replicas, the quantity the
optimizer minimizes.
"""

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo.config import TrainConfig
from memo.execute.optimizer import StepOptimizer, single_chunk
from memo.execute.pipeline import PipelineSchedule, loss_result
from memo.execute.schedule import LearningRateSchedule
from memo.model.context_parallel import batch_for_rank
from memo.profile.recorder import PhaseMarker


def _whole(micro_batch: dict) -> dict:
    return micro_batch


def _nothing() -> None:
    pass


def rank_tokens(layout: str) -> Callable[[dict], dict]:
    """This rank's tokens of a micro-batch under context parallelism, in ``layout``
    (:data:`memo.model.context_parallel.SEQUENCE_LAYOUTS`); the whole micro-batch without it."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return _whole
    rank = parallel_state.get_context_parallel_rank()
    return lambda micro_batch: batch_for_rank(micro_batch, rank, cp, layout)


def token_losses(model: torch.nn.Module, micro_batch: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The model's loss of every token of ``micro_batch`` (``[b, s]``, nats), and which tokens
    count (``None``: all): documents kept apart (:func:`memo.data.batches.micro_batches`'
    ``documents``) do not count a token whose label begins the next document."""
    documents = micro_batch.get("documents")
    per_token = model(micro_batch["tokens"], micro_batch["position_ids"], None, labels=micro_batch["labels"],
                      **({} if documents is None else {"packed_seq_params": documents}))
    return per_token, micro_batch.get("loss_mask")


def mean_loss(per_token: torch.Tensor, counted: Optional[torch.Tensor], sequence_counted: Optional[torch.Tensor] = None,
              ranks: int = 1) -> torch.Tensor:
    """The mean loss in float32 over the tokens that count (:func:`token_losses`).

    Under context parallelism (``ranks`` ranks, this one holding a part of each sequence) it is
    this rank's share: the sum of its counted losses over ``sequence_counted``, the count of the
    whole sequence's (every rank holds the whole micro-batch before it takes its part), times the
    ranks, whose mean over them (what the gradients' average over the data-parallel and
    context-parallel ranks takes) is the sequence's mean, however unevenly the uncounted tokens
    fall on the ranks."""
    if counted is None:
        return per_token.float().mean()
    if ranks == 1:
        return (per_token.float() * counted).sum() / counted.sum()
    return (per_token.float() * counted).sum() * ranks / sequence_counted


def untimed_steps(train: TrainConfig, start_step: int) -> int:
    """Steps left out of the timing from ``start_step`` on: ``train.warmup_steps``, fewer where
    fewer are left, so that one is timed (a run resumed near its end)."""
    return min(train.warmup_steps, train.steps - start_step - 1)


@dataclass
class TrainingStep:
    """What one training step runs: forward and backward passes of its micro-batches (gradients
    accumulate), then the optimizer.

    Args:
        optimizer: the model's optimizer (its ``model`` is what trains).
        device_type: "cuda" (the step waits for the GPU before its clock stops) or "cpu".
        micro_batch_view: a micro-batch as this rank's layers take it: under context parallelism
            its tokens of the sequence (:func:`rank_tokens`), in the order of the layers' runtime
            (:meth:`memo.model.placement.LayerRuntime.token_order`).
        step_end: called after the last micro-batch's backward pass, before the optimizer
            (:attr:`memo.model.BuiltModel.step_end`).
        pipeline: the schedule of the micro-batches over the pipeline stages
            (:mod:`memo.execute.pipeline`); None: one stage, micro-batch after micro-batch.
    """

    optimizer: StepOptimizer
    device_type: str
    micro_batch_view: Callable[[dict], dict] = _whole
    step_end: Callable[[], None] = _nothing
    pipeline: Optional[PipelineSchedule] = None

    def __post_init__(self):
        if self.pipeline is not None:
            self.pipeline.use_loss_scale(self.optimizer.scale_loss)

    def __call__(self, batch: list[dict], lr: float, marker: Optional[PhaseMarker] = None) -> tuple[torch.Tensor, float]:
        """One step on ``batch`` (this data-parallel rank's micro-batches) at learning rate ``lr``:
        the summed loss (float32, on the device) and the gradient norm. ``marker``, where the step
        is recorded, is told when the backward pass and the optimizer step begin (one stage only)."""
        optimizer = self.optimizer
        optimizer.zero_grad()
        if self.pipeline is None:
            loss_sum = self._micro_batches(batch, marker)
        else:
            loss_sum = self._pipelined(batch)
        self.step_end()
        if marker is not None:
            marker.optimizer()
        return loss_sum, optimizer.step(lr)

    def _pipelined(self, batch: list[dict]) -> torch.Tensor:
        """The micro-batches through the pipeline's schedule; the summed loss on every stage."""
        cp = parallel_state.get_context_parallel_world_size()

        def forward(chunk, _index, micro_batch):
            counted = micro_batch.get("loss_mask")  # (the whole sequence's)
            output, mask = token_losses(chunk, self.micro_batch_view(micro_batch))

            def loss(per_token):
                value = mean_loss(per_token, mask, None if counted is None else counted.sum(), cp)
                return loss_result(value, {"loss": value.detach() / len(batch)})
            return output, loss

        reported = self.pipeline.run(batch, forward)
        loss_sum = torch.zeros((), device=self.device_type, dtype=torch.float32)
        for entry in reported:
            loss_sum += entry["loss"]
        # the last stage's, on every stage
        dist.all_reduce(loss_sum, group=parallel_state.get_pipeline_model_parallel_group())
        return loss_sum

    def _micro_batches(self, batch: list[dict], marker: Optional[PhaseMarker]) -> torch.Tensor:
        """The micro-batches one after the other, each's backward after its forward; their summed loss."""
        model, optimizer = single_chunk(self.optimizer), self.optimizer
        cp = parallel_state.get_context_parallel_world_size()
        loss_sum = torch.zeros((), device=self.device_type, dtype=torch.float32)
        for micro_batch in batch:
            mb = self.micro_batch_view(micro_batch)
            counted = micro_batch.get("loss_mask")  # (the whole sequence's)
            loss = mean_loss(*token_losses(model, mb), None if counted is None else counted.sum(), cp) / len(batch)
            if marker is not None:
                marker.backward()
            optimizer.scale_loss(loss).backward()
            loss_sum += loss.detach()
            del loss  # freed within the step, as a recorded iteration has them
        return loss_sum


def run_steps(
    step: TrainingStep,
    batches: Iterator[list[dict]],
    train: TrainConfig,
    hooks: Sequence[Callable[[dict], None]] = (),
    scope: Optional[Callable[[int], ContextManager[Optional[PhaseMarker]]]] = None,
    start_step: int = 0,
) -> None:
    """Train from step ``start_step`` (a checkpoint's, else 0) up to ``train.steps``, calling each
    of ``hooks`` (:mod:`memo.execute.hooks`) with each step's record.

    A record holds ``step`` (1-based), ``loss`` (the mean over micro-batches and data-parallel
    replicas), ``lr``, ``grad_norm``, ``iter_time_s`` (the step's wall-clock time, device work
    included; preparing its tokens comes before its clock starts), ``document_squared_tokens``
    where documents are kept apart (``Σ n²`` over the global batch's documents, for
    :func:`memo.metrics.flops.model_flops`) and ``timed`` (False for the first
    ``train.warmup_steps`` steps this process runs, fewer if it runs no more, so that one is
    timed). Each step runs inside ``scope(k)`` (k counts this process's steps from 0), whose phase
    marker, if it yields one, the step tells of its backward pass and optimizer step; what the
    scope does on leaving is not timed.
    """
    for chunk in step.optimizer.chunks:
        chunk.train()
    sync = torch.cuda.synchronize if step.device_type == "cuda" else _nothing
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    schedule = LearningRateSchedule(train)
    untimed = untimed_steps(train, start_step)
    for number in range(start_step, train.steps):
        batch = next(batches)
        lr = schedule(number)
        with scope(number - start_step) if scope else contextlib.nullcontext() as marker:
            sync()
            start = time.perf_counter()
            loss_sum, grad_norm = step(batch, lr, marker)
            sync()
            elapsed = time.perf_counter() - start
        dist.all_reduce(loss_sum, group=dp_group)
        record = {"step": number + 1, "loss": loss_sum.item() / dist.get_world_size(dp_group), "lr": lr,
                  "grad_norm": grad_norm, "iter_time_s": elapsed, "timed": number - start_step >= untimed}
        del loss_sum  # not alive into the next step, which a recorded step did not see
        # Σ n² over the documents of this replica's micro-batches, where kept apart
        squared = sum(mb["documents"].documents.squared_lengths() for mb in batch if "documents" in mb)
        if squared:  # over the replicas (a replica's context-parallel ranks share its documents)
            total = torch.tensor(squared, dtype=torch.float64, device=step.device_type)
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            record["document_squared_tokens"] = int(total.item())
        for hook in hooks:
            hook(record)
