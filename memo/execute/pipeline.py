"""Pipeline parallelism: Megatron-core's own schedules over this rank's model chunks.

With ``parallel.pp > 1`` each rank holds one pipeline stage: its share of the layers, the word
embedding on the first stage and the final norm and loss on the last (:func:`memo.model.build_gpt`).
A step's micro-batches run through Megatron-core's ``get_forward_backward_func``: 1F1B (each stage
starts the backward pass of its oldest micro-batch as soon as the last stage has its loss), or,
with ``parallel.vpp > 1``, the interleaved schedule over the rank's ``vpp`` chunks. Stages pass
activations and their gradients point to point (``[s / cp (/ tp under sequence parallelism), b,
h]`` in the model's dtype). Every stage reads the same micro-batches, in order; the first uses the
tokens, the last the labels and loss mask.

What is in flight: under 1F1B stage ``r`` of ``pp`` holds the saved activations of at most
``min(pp − r, micro-batches)`` micro-batches at once (its warm-up forwards, then one forward per
backward); :func:`in_flight` counts them for any schedule, per chunk, as MEMO's runtime keeps one
set of buffers per micro-batch in flight (:mod:`memo.swap.in_flight`).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func, get_schedule_table
from megatron.core.utils import get_model_config

from memo.model.host import HostFactories
from memo.model.placement import LayerRuntime, NullRuntime

# what a forward step gives the schedule: the chunk's output and, on the last stage, the function
# that turns it into the micro-batch's loss (Megatron's ``forward_step_func`` contract)
ForwardStep = Callable[[torch.nn.Module, int, dict], tuple[torch.Tensor, Callable]]

_ONE = torch.ones((), dtype=torch.int)


def loss_result(loss: torch.Tensor, reported: dict) -> tuple:
    """What a last stage's loss function returns to Megatron's schedule: ``loss`` (a micro-batch's
    mean already), counted as one "token", so that the schedule only divides it by the
    micro-batches, and ``reported``, which the schedule hands back micro-batch by micro-batch."""
    return loss, _ONE, reported


@dataclass
class PipelineSchedule:
    """Megatron-core's schedule of one step's micro-batches over ``chunks``.

    Args:
        chunks: this rank's model chunks (DDP wrappers of them on a GPU), in layer order.
        device_type: "cuda" or "cpu" (whose job makes Megatron's "cuda" tensors on the host).
        seq: tokens of a sequence (every rank's micro-batches hold whole sequences).
        micro_batch_size: sequences per micro-batch.
        runtime: what runs the chunks' layers (:meth:`memo.policy.ActivationPolicy.prepare_stage`),
            told which micro-batch's pass runs next on a chunk.
    """

    chunks: list[torch.nn.Module]
    device_type: str
    seq: int
    micro_batch_size: int
    runtime: LayerRuntime = field(default_factory=NullRuntime)

    def run(self, batch: list[dict], forward_step: ForwardStep, forward_only: bool = False) -> list:
        """Forward (and, unless ``forward_only``, backward) ``batch``'s micro-batches through the
        stages; ``forward_step(chunk, index, micro_batch)`` runs one micro-batch (its 0-based
        ``index``) through one chunk. Returns what the last stage's loss functions reported, micro-batch
        by micro-batch (an empty list on the other stages)."""
        iterators = [iter([(c, i, micro_batch) for i, micro_batch in enumerate(batch)]) for c in range(len(self.chunks))]
        runtime = self.runtime

        def step(data_iterator, chunk):
            c, index, micro_batch = next(data_iterator)
            runtime.use(c, index)
            output, loss = forward_step(chunk, index, micro_batch)
            if output.requires_grad:  # (the chunk's backward pass begins where its output's gradient arrives)
                output.register_hook(lambda _grad: runtime.use(c, index))
            return output, loss

        with HostFactories() if self.device_type == "cpu" else contextlib.nullcontext():
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iterators, model=self.chunks, num_microbatches=len(batch),
                seq_length=self.seq, micro_batch_size=self.micro_batch_size, forward_only=forward_only)

    def use_loss_scale(self, scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Let the schedule scale the last stage's loss before its backward pass as the optimizer
        does (fp16's loss scale)."""
        get_model_config(self.chunks[0]).grad_scale_func = scale_loss


def in_flight(pp: int, rank: int, micro_batches: int, vpp: int = 1) -> list[int]:
    """The most micro-batches whose forward pass has run and whose backward pass has not, at any
    moment of a step of Megatron-core's schedule, on each of the ``vpp`` chunks of pipeline rank
    ``rank`` of ``pp`` (1F1B where ``vpp == 1``, else interleaved in groups of ``pp``).

    Replays the schedule's order: the warm-up forwards, then one forward and one backward at a
    time, then the backward passes left; a chunk's micro-batches start and end in order."""
    if pp == 1:
        return [1] * vpp
    if vpp == 1:
        return [min(pp - rank, micro_batches)]
    total = micro_batches * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    table = get_schedule_table(micro_batches, vpp, pp)
    forward_chunks = [chunk for _, chunk in table]
    backward_chunks = [vpp - 1 - chunk for _, chunk in table]
    live, most = [0] * vpp, [0] * vpp
    for k in range(total):
        live[forward_chunks[k]] += 1
        most = [max(m, n) for m, n in zip(most, live)]
        if k >= warmup:
            live[backward_chunks[k - warmup]] -= 1
    return most

