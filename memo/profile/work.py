"""One training step's work counted on the CPU (:class:`memo.metrics.work.WorkCounter`): the
real Megatron-core GPT, its layers run by the activation policy as training runs them, on fake
tensors at any size or on real ones."""

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from memo.config import Workload
from memo.metrics.work import StepWork, WorkCounter, linear_weights
from memo.model import LayerBuild
from memo.model.placement import LayerRuntime, RuntimeReport
from memo.profile.iteration import built_gpt, step_tokens, unchecked_rng_forks
from memo.swap.streams import CountedStreams, Streams, streams_for


class Counted(Protocol):
    """How the counted step's layers are built and run: an activation policy
    (:class:`memo.policy.ActivationPolicy`) is one."""

    @property
    def layers(self) -> LayerBuild:
        ...

    def prepare(self, model, workload: Workload, device: torch.device, host_budget: float,
                streams: Optional[Streams] = None, group=None) -> LayerRuntime:
        ...


@dataclass
class CountedStep:
    """One training step's counted work and copies, and what the layers' runtime decided."""

    work: StepWork
    copied: dict  # bytes copied by the swap runtime: {"d2h": …, "h2d": …, "compute": …}
    report: RuntimeReport  # what the runtime decided: a walk in tiles its α and tokens kept per tile, k, R


def count_step(workload: Workload, policy: Counted, fake: bool = True, seed: int = 0) -> CountedStep:
    """Count the work of one step of ``workload`` (forward, loss, backward; one micro-batch) on
    rank 0, as training runs it on the CPU: its layers' runtime made by ``policy`` (the workload's
    activation policy, :func:`memo.policy.policy_of`) beforehand, their discovery and timing not
    counted; the copies of a swap runtime counted where it issues them. ``fake``: on fake tensors
    (any size, in seconds; tensor parallelism played by a fake process group), else on real ones
    (one process)."""
    device = torch.device("cpu")
    streams = CountedStreams(streams_for(device))
    with built_gpt(workload, policy.layers, "fake" if fake else "cpu", seed) as (gpt, _), unchecked_rng_forks():
        runtime = policy.prepare(gpt, workload, device, host_budget=2**60, streams=streams)
        tokens, positions = step_tokens(workload, "cpu")
        streams.copied = dict.fromkeys(streams.copied, 0)  # (the runtime's own measurements left out)
        try:
            with WorkCounter(linear_weights(gpt)) as counter:
                gpt(tokens, positions, None, labels=tokens).float().mean().backward()
        finally:
            runtime.release()
    copied = {str(stream): n for stream, n in streams.copied.items()}
    return CountedStep(counter.work, copied, runtime.report())
