"""The contract of an activation policy, and what its share of a prediction is given and gives.

A policy is made from a resolved :class:`memo.config.Method` (:func:`memo.policy.policy_of`) and
answers every question whose answer depends on how a run keeps its activations: how the model
builds its layers, what runs them through a step, what a trace of it runs, which layouts it can
run, and its terms of a prediction. Its parameters of the work (length, layout, the layers' tile)
come with the :class:`memo.config.Workload` each call is given.
"""

import abc
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from memo.config import ConfigError, Method, ParallelConfig, Workload
from memo.config.validate import CP_COMM_TYPES
from memo.hardware import Hardware
from memo.model import LayerBuild, attention_width
from memo.model.context_parallel import exchange_bytes
from memo.model.placement import LayerRuntime, NullRuntime
from memo.profile.template import IterationTemplate
from memo.profile.trace import Trace
from memo.swap.in_flight import in_flight_runtimes
from memo.swap.streams import Streams


@dataclass(frozen=True)
class LayerSeconds:
    """One layer's predicted seconds on one device per micro-batch (:func:`memo.fit.timing.layer_seconds`)."""

    gemm: float  # the weight GEMMs' forward
    attention: float  # core attention's forward
    attention_backward: float
    tp_pass: float  # tensor-parallel collectives of one pass, exposed
    cp_forward: float  # context-parallel exchange of the forward, exposed
    cp_backward: float
    token_wise: float  # the GEMMs up to FC2's input (QKV, projection, FC1), forward: MEMO's recomputation
    keys_values: float  # the QKV GEMM's keys and values, forward: what a walk in tiles makes again before its backward tiles

    @property
    def forward(self) -> float:
        return self.gemm + self.attention + self.tp_pass + self.cp_forward

    @property
    def backward(self) -> float:
        return 2 * self.gemm + self.attention_backward + self.tp_pass + self.cp_backward


@dataclass(frozen=True)
class Situation:
    """What a policy's share of a prediction is given: one device of a configuration."""

    workload: Workload  # at the layout and length predicted
    template: IterationTemplate  # the iteration's requests, traced as the policy's ``traced`` runs
    layers: int  # layers of one model chunk of the device's pipeline stage (the stage's, but interleaved)
    # runtimes of its chunks' micro-batches in flight (memo.execute.pipeline.in_flight, summed over
    # the chunks; 1 without pipelining): the device holds ``layers·in_flight`` layers' activations,
    # each runtime its own buffers and its share of the host budget
    in_flight: int
    seconds: LayerSeconds
    host_link: float  # bytes/s between the device and the host (math.inf: copies are free)
    host_budget: float  # bytes of host memory the device's activations may fill

    @property
    def tokens(self) -> int:
        """Tokens of a sequence on one context-parallel rank."""
        return self.workload.seq // self.workload.parallel.cp


@dataclass(frozen=True)
class Placed:
    """Where a policy keeps a configuration's activations, predicted (bytes per device)."""

    trace: Trace  # the iteration's requests the device's allocator serves
    host_bytes: int = 0  # activations on the host
    rounding_buffers: int = 0  # device bytes outside the trace: MEMO's rounding buffers
    device_freed: int = 0  # bytes of the trace on the host at its peak (Megatron's offloading)
    recompute_s: float = 0.0  # a layer's recomputation, per micro-batch
    swap_exposed_s: float = 0.0  # a layer's copies to and from the host not hidden behind compute
    alpha: Optional[float] = None  # the fraction of tokens swapped (tiles: their mean)
    alpha_binding: Optional[str] = None
    alpha_bandwidth: Optional[float] = None
    alpha_host: Optional[float] = None
    tiles: Optional[object] = None  # a walk in tiles that swaps: its memo.policy.tiles.TileHostPlan


class OutOfHostMemory(Exception):
    """A policy's activations do not fit the host memory: why (one line), and what they would take."""

    def __init__(self, reason: str, host_bytes: int, rounding_buffers: int = 0, alpha: Optional[float] = None):
        super().__init__(reason)
        self.reason, self.host_bytes, self.rounding_buffers, self.alpha = reason, host_bytes, rounding_buffers, alpha


class ActivationPolicy(abc.ABC):
    """How a run keeps what its layers save for the backward pass (see the module docstring).
    Subclasses are frozen dataclasses holding their :class:`Method`: hashable, so that a trace of
    one is made once (:func:`memo.profile.template.iteration_template`)."""

    method: Method
    # its layers run under a runtime of its own (:meth:`prepare`), which keeps one micro-batch's
    # activations (one per micro-batch in flight on a pipeline stage)
    has_runtime: ClassVar[bool] = False

    # ------------------------------------------------------------------ the model

    @property
    @abc.abstractmethod
    def layers(self) -> LayerBuild:
        """How the model builds its decoder layers."""

    # ------------------------------------------------------------------ a trace of it

    @property
    def traced(self) -> "ActivationPolicy":
        """The policy whose iteration a prediction traces for this one (the same, unless its
        runtime moves tensors a trace does not follow)."""
        return self

    def check_trace(self) -> None:
        """Refuse, in one line, a trace of this policy's layers (``mode=profile``, ``mode=plan``)."""

    def trace_runtime(self, model, workload: Workload, device: torch.device) -> LayerRuntime:
        """What runs ``model``'s layers in a trace of one iteration: nothing beyond the layers."""
        return NullRuntime()

    def planned_trace(self, workload: Workload) -> Optional[Trace]:
        """The iteration ``mode=plan`` plans, where it is not the run's own trace (None)."""
        return None

    # ------------------------------------------------------------------ training

    def training_refusal(self, parallel: ParallelConfig) -> Optional[str]:
        """Why training cannot run under ``parallel`` (one line naming what to change), or None."""
        return None

    def check_training(self, parallel: ParallelConfig) -> None:
        """Refuse, in one line, training under ``parallel`` on this machine."""
        reason = self.training_refusal(parallel)
        if reason is not None:
            raise ConfigError(reason)

    def host_budget(self, hw: Hardware, device: torch.device, job_devices: int) -> float:
        """Bytes of host memory this process's activations may fill: none are put there."""
        return 0.0

    def prepare(self, model, workload: Workload, device: torch.device, host_budget: float,
                streams: Optional[Streams] = None, group=None) -> LayerRuntime:
        """What runs ``model``'s layers through training, ready: nothing beyond the layers.

        Args:
            host_budget: bytes of host memory the activations may fill (:meth:`host_budget`, less
                what Adam's states offloaded there take).
            streams: the copy streams of a runtime that swaps (default: the device's).
            group: the processes whose recomputations must agree (the tensor-parallel group).
        """
        return NullRuntime()

    def prepare_stage(self, chunks: list, workload: Workload, device: torch.device, host_budget: float,
                      in_flight: list[int], group=None) -> LayerRuntime:
        """What runs the layers of this rank's model ``chunks`` (unwrapped) through training, ready:
        :meth:`prepare`'s runtime of the one chunk without pipeline parallelism; under it, where the
        policy places anything, ``in_flight[c]`` runtimes for chunk ``c``, one per micro-batch in
        flight (:mod:`memo.swap.in_flight`), sharing ``host_budget`` equally."""
        if workload.parallel.pp == 1:
            return self.prepare(chunks[0], workload, device, host_budget, group=group)
        if not self.has_runtime:
            return NullRuntime()
        share = host_budget / sum(in_flight)
        stage = in_flight_runtimes(chunks, in_flight,
                                   lambda chunk: self.prepare(chunk, workload, device, share, group=group))
        for runtimes in stage.by_chunk:
            self.share_in_flight(runtimes)
        return stage

    def share_in_flight(self, runtimes: list[LayerRuntime]) -> None:
        """Let one model chunk's runtimes of its micro-batches in flight (:meth:`prepare`'s) share
        what lives within one pass only: nothing to share."""

    # ------------------------------------------------------------------ layouts a search tries

    @property
    def exchanges(self) -> tuple[str, ...]:
        """The context-parallel exchanges (``parallel.cp_comm_type``) it runs."""
        return CP_COMM_TYPES

    def layer_tiles_tried(self, tried: tuple[Optional[int], ...], own: Optional[int]) -> tuple[Optional[int], ...]:
        """The layers' tiles a layout search tries for it, of ``tried`` (``fit.tile_tokens``) and
        the run's ``own``: its own only, where its layers are not walked in tiles."""
        return (own,)

    def candidate_layout(self, workload: Workload, parallel: ParallelConfig,
                         seq: Optional[int]) -> Optional[ParallelConfig]:
        """``parallel`` as a layout search tries it for ``workload`` (its layers' tile) at ``seq``
        tokens (None: every length of a search), or None where it is not tried."""
        return parallel

    # ------------------------------------------------------------------ prediction (memo.fit)

    @property
    def alpha(self) -> Optional[float]:
        """The fraction of tokens swapped, where fixed."""
        return None

    def cp_exchange(self, parallel: ParallelConfig) -> str:
        """How its keys and values cross context-parallel ranks, for the time model: one of
        Megatron's ``cp_comm_type``, or "stores" (:meth:`memo.policy.tiles.SequenceTiles.cp_exchange`)."""
        return parallel.cp_comm_type

    def cp_buffers(self, workload: Workload) -> int:
        """Bytes its context-parallel exchange holds on a device at its peak
        (:func:`memo.model.context_parallel.exchange_bytes`)."""
        parallel = workload.parallel
        return exchange_bytes(parallel.cp_comm_type, parallel.cp, workload.micro_batch_size, workload.seq,
                              attention_width(workload.model) // parallel.tp, workload.dtype_bytes)

    def recompute_seconds(self, workload: Workload, seconds: LayerSeconds, alpha: float = 1.0,
                          checkpoint_every: int = 1) -> float:
        """A layer's recomputation per micro-batch: none."""
        return 0.0

    def place(self, situation: Situation) -> Placed:
        """Where its activations go on one device: all on it, as traced.

        Raises:
            OutOfHostMemory: where they do not fit the host.
        """
        w, s = situation.workload, situation
        trace = s.template.instance(s.tokens, s.layers * s.in_flight, loss_tile_tokens=w.loss_tile_tokens)
        return Placed(trace, recompute_s=self.recompute_seconds(w, s.seconds))

    def report_lines(self, prediction) -> list[str]:
        """Lines of a prediction's report (:func:`memo.modes.fit.report`) beyond the device's terms."""
        if not prediction.states.offload.host_bytes:
            return []
        return _host_lines(prediction)


def _host_lines(prediction) -> list[str]:
    """The per-node host memory of ``prediction`` (a :class:`memo.fit.predict.Prediction`)."""
    gib = 2**30
    return ["per node:",
            f"  host memory                {prediction.host_per_node / gib:,.2f} GiB of "
            f"{prediction.host_capacity_per_node / gib:,.2f} GiB (optimizer states and swapped activations)"]
