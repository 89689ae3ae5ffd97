"""One configuration's prediction: memory per device and per node, α, verdict and time.

The model states, the host's capacity and the allocator's verdict are the same for every method;
where the activations go (the device, rounding buffers, the host) and what that costs in time is
the run's activation policy's share (:meth:`memo.policy.ActivationPolicy.place`).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

from memo.config import FitConfig, ParallelConfig, Workload, shards_optimizer
from memo.execute.pipeline import in_flight as pipeline_in_flight
from memo.fit import memory
from memo.fit.timing import TimePrediction, layer_seconds, predict_time
from memo.hardware import GiB, Hardware
from memo.policy import OutOfHostMemory, Placed, Situation, policy_of
from memo.policy.tiles import TileHostPlan
from memo.profile.template import iteration_template
from memo.results import finite
from memo.swap import host_share


@dataclass(frozen=True)
class Problem:
    """What stays fixed while layouts and lengths vary."""

    workload: Workload  # each prediction takes its own layout and length instead of this one's
    hardware: Hardware
    fit: FitConfig
    micro_batches: int = 1
    distributed_optimizer: Optional[bool] = None  # None: where dp·cp > 1 (memo.config.shards_optimizer)
    plan: bool = False  # transient tensors from the memory plan instead of the caching allocator
    optimizer_offload: float = 0.0  # share of the parameters whose Adam states live on the host
    plan_time_limit_s: float = 10.0
    # Megatron's Adam on a GPU is PyTorch's multi-tensor AdamW (no Transformer Engine or Apex where
    # the run trains): its step's transient is counted (memo.fit.memory.optimizer_step_bytes)
    pytorch_adam: bool = USING_PYTORCH_OPTIMIZER


@dataclass(frozen=True)
class Prediction:
    """Bytes per device unless named per node; ``status`` is ok, oom or oohm, ``reason`` why."""

    seq: int
    parallel: ParallelConfig
    tile_tokens: Optional[int]  # the layers' tiles, None: whole layers
    status: str
    reason: str
    states: memory.ModelStates
    acts: Optional[memory.Activations]
    rounding_buffers: int
    cp_buffers: int
    reserved: int  # on a GPU, memory held outside PyTorch's allocator: fit.device_reserved_gib and NCCL's
    nccl: memory.NcclBuffers  # NCCL's part of ``reserved``
    device_total: int  # what the verdict compares with the capacity (0 when oohm)
    device_capacity: int
    margin: int  # bytes of the capacity kept free for the fit's error (fit.memory_margin)
    host_per_device: int
    host_per_node: int
    host_capacity_per_node: int
    alpha: Optional[float]
    alpha_binding: Optional[str]
    alpha_bandwidth: Optional[float]
    alpha_host: Optional[float]
    time: TimePrediction
    tiles: Optional[TileHostPlan] = None  # layers walked in tiles that swap

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    def row(self) -> dict:
        """The result-row columns of this prediction (``predicted_*``; bytes, seconds)."""
        a = self.acts
        row = {
            "status": self.status,
            "predicted_reason": self.reason,
            "predicted_params_per_device": self.states.params,
            "predicted_weights_bytes": self.states.weights,
            "predicted_gradients_bytes": self.states.gradients,
            "predicted_optimizer_bytes": self.states.optimizer,
            "predicted_optimizer_host_bytes": self.states.offload.host_bytes,
            "predicted_optimizer_pinned_bytes": self.states.offload.pinned_bytes,
            "predicted_skeletal_device_bytes": (a.skeletal if a else 0) + self.rounding_buffers,
            "predicted_rounding_buffer_bytes": self.rounding_buffers,
            "predicted_transient_bytes": a.transient if a else None,
            "predicted_head_bytes": a.head if a else None,
            "predicted_persistent_activation_bytes": a.persistent if a else None,
            "predicted_other_activation_bytes": a.other if a else None,
            "predicted_cp_buffer_bytes": self.cp_buffers,
            "predicted_activation_peak_bytes": a.allocated_peak if a else None,
            "predicted_activation_held_bytes": a.held if a else None,
            "predicted_allocator_overhead_bytes": a.overhead if a else None,
            "predicted_peak_phase": a.peak_phase if a else None,
            "predicted_alloc_retries": a.alloc_retries if a else None,
            "predicted_reserved_bytes": self.reserved,
            "predicted_nccl_bytes": self.nccl.bytes,
            "predicted_nccl_assumption": self.nccl.assumption,
            "predicted_device_bytes": self.device_total,
            "predicted_device_capacity_bytes": self.device_capacity,
            "margin_bytes": self.margin,
            "predicted_host_bytes_per_device": self.host_per_device,
            "predicted_host_bytes_per_node": self.host_per_node,
            "predicted_host_capacity_per_node_bytes": self.host_capacity_per_node,
            "predicted_alpha": self.alpha,
            "predicted_alpha_binding": self.alpha_binding,
            "predicted_alpha_bandwidth": finite(self.alpha_bandwidth),
            "predicted_alpha_host": finite(self.alpha_host),
        }
        plan = self.tiles
        row.update({
            "predicted_tile_tokens": self.tile_tokens,
            "predicted_checkpoint_every": plan.solution.checkpoint_every if plan else None,
            "predicted_alpha_min": min(plan.solution.alphas) if plan else None,
            "predicted_alpha_max": max(plan.solution.alphas) if plan else None,
        })
        t = self.time
        row.update({f"predicted_{f.name}": getattr(t, f.name) for f in dataclasses.fields(t)})
        row["predicted_iter_time_s"] = row.pop("predicted_iteration_s")
        return row


def prediction_hardware(hw: Hardware) -> Hardware:
    """``hw`` as predictions take it: without a device-host bandwidth (a CPU), copies are free; a
    CPU's processes exchange through its own memory, which the time model does not charge."""
    hw = dataclasses.replace(hw, host_link_bytes_per_s=hw.host_link_bytes_per_s or math.inf)
    if hw.device_type == "cpu":
        hw = dataclasses.replace(hw, intra_node_bytes_per_s=hw.intra_node_bytes_per_s or math.inf,
                                 inter_node_bytes_per_s=hw.inter_node_bytes_per_s or math.inf)
    return hw


def predict(problem: Problem, parallel: ParallelConfig, seq: int) -> Prediction:
    """Predict ``problem`` under ``parallel`` at ``seq`` tokens (see :mod:`memo.fit.memory` and
    :mod:`memo.fit.timing`)."""
    workload = problem.workload.at(parallel, seq)
    policy = policy_of(workload)
    hw, fit = problem.hardware, problem.fit
    layers = workload.model.num_layers // parallel.pp
    states = memory.model_states(workload, problem.distributed_optimizer, problem.optimizer_offload)
    devices = parallel.tp * parallel.cp * parallel.pp * parallel.dp
    local = min(devices, hw.devices_per_node or 1)  # the job's devices on one node
    frame = _Frame(workload, problem, states, local, policy.cp_buffers(workload))
    # the optimizer's host memory is allocated first; the activations may have the rest
    budget = host_share(frame.host_capacity - local * frame.optimizer_host, local)
    if budget < 0:
        return frame.out_of_host(OutOfHostMemory(
            f"out of host memory: Adam's states on the host take {frame.optimizer_host / GiB:.1f} GiB per device, "
            f"{local * frame.optimizer_host / GiB:.1f} GiB of the node's {frame.host_capacity / GiB:.1f} GiB usable, "
            "before any activation; lower train.optimizer_offload_fraction, add devices or set "
            "hardware.host_memory_gib", 0, alpha=policy.alpha))
    # The first pipeline stage binds: it holds the most micro-batches in flight, and as many
    # parameters as the last (whose output layer, or tied copy, is the first's embedding's size,
    # beside one final norm); its every chunk keeps one runtime's activations per micro-batch in flight.
    layers //= parallel.vpp
    in_flight = sum(pipeline_in_flight(parallel.pp, 0, problem.micro_batches, parallel.vpp))
    situation = Situation(workload, iteration_template(workload, layers * in_flight, policy.traced), layers,
                          in_flight, layer_seconds(workload, hw, fit, policy.cp_exchange(parallel)),
                          hw.host_link_bytes_per_s, budget)
    try:
        placed = policy.place(situation)
    except OutOfHostMemory as short:
        return frame.out_of_host(short)
    return frame.on_device(placed)


@dataclass(frozen=True)
class _Frame:
    """What every prediction of one configuration shares, and its two endings."""

    workload: Workload
    problem: Problem
    states: memory.ModelStates
    local: int  # the job's devices on one node
    cp_buffers: int

    @property
    def host_capacity(self) -> int:
        return int(self.problem.hardware.host_memory_bytes * self.problem.fit.host_usable_fraction)

    @property
    def optimizer_host(self) -> int:
        return self.states.offload.host_bytes

    def time(self, placed: Optional[Placed] = None) -> TimePrediction:
        return predict_time(self.workload, self.problem.micro_batches, self.problem.hardware, self.problem.fit,
                            self.states.params, placed, self.states.offload.offloaded_params)

    def common(self) -> dict:
        w, hw, fit = self.workload, self.problem.hardware, self.problem.fit
        # a CPU's "device" memory is its tensors': no driver context, library workspaces or NCCL
        gpu = hw.device_type == "cuda"
        sharded = shards_optimizer(self.problem.distributed_optimizer, w.parallel)
        nccl = memory.nccl_buffers(w.parallel, sharded, fit.nccl_channels) if gpu else memory.NO_NCCL
        reserved = int(fit.device_reserved_gib * GiB) + nccl.bytes if gpu else 0
        return dict(seq=w.seq, parallel=w.parallel, tile_tokens=w.layer_tile_tokens, states=self.states,
                    cp_buffers=self.cp_buffers, reserved=reserved, nccl=nccl, device_capacity=hw.device_memory_bytes,
                    margin=math.ceil(fit.memory_margin * hw.device_memory_bytes),
                    host_capacity_per_node=self.host_capacity)

    def out_of_host(self, short: OutOfHostMemory) -> Prediction:
        """Status ``oohm``: what the activations would take on the host beside Adam's states."""
        host = self.optimizer_host + short.host_bytes
        return Prediction(**self.common(), status="oohm", reason=short.reason, acts=None,
                          rounding_buffers=short.rounding_buffers, device_total=0, host_per_device=host,
                          host_per_node=host * self.local, alpha=short.alpha, alpha_binding=None,
                          alpha_bandwidth=None, alpha_host=None, time=self.time())

    def on_device(self, placed: Placed) -> Prediction:
        """The device's verdict on ``placed``: ok, or oom with why."""
        problem, hw = self.problem, self.problem.hardware
        common = self.common()
        gpu = hw.device_type == "cuda"
        # on a GPU, what the caching allocator holds outside the traced iteration (cuBLAS's workspaces)
        workspaces = int(problem.fit.device_workspace_mib * 2**20) if gpu else 0
        fixed_part = (common["reserved"] + workspaces + self.states.total + placed.rounding_buffers
                      + self.cp_buffers)
        # what the run may fill: the capacity less the margin kept for the fit's own error
        usable = hw.device_memory_bytes - common["margin"]
        # the allocator serves what offloaded tensors leave
        room = usable - fixed_part + placed.device_freed
        # a CPU's tensors come from malloc, which caches nothing: they take what is alive
        acts = memory.activations(placed.trace, room if gpu else 0, problem.plan, problem.plan_time_limit_s)
        if placed.device_freed:
            acts = memory.less_offloaded(acts, placed.device_freed)
        # the optimizer's step, after the passes: the states, the buffers, what persists and its own transient
        step = memory.optimizer_step_bytes(self.workload, problem.distributed_optimizer, problem.optimizer_offload,
                                           gpu and problem.pytorch_adam)
        # (with the context-parallel buffers of the backward still counted: an upper bound under cp)
        optimizer_phase = fixed_part + memory.persistent_bytes(placed.trace) + step
        if optimizer_phase > fixed_part + acts.allocated_peak:
            acts = dataclasses.replace(acts, peak_phase="optimizer", transient=step,
                                       allocated_peak=optimizer_phase - fixed_part,
                                       held=max(acts.held, optimizer_phase - fixed_part), skeletal=0, head=0,
                                       persistent=optimizer_phase - fixed_part - step, other=0)
        total = fixed_part + acts.held
        status, reason = "ok", ""
        if acts.refused_bytes is not None and total <= usable:
            status = "oom"
            reason = (
                f"the caching allocator cannot serve {acts.refused_bytes / GiB:.2f} GiB within "
                f"{room / GiB:.1f} GiB (fragmentation) at the peak in {acts.peak_phase}"
            )
        elif total > usable:
            status = "oom"
            allocator = "the memory plan" if problem.plan else "the caching allocator"
            reason = (
                f"needs {total / GiB:.2f} GiB of {hw.device_memory_bytes / GiB:.2f} GiB less a margin of "
                f"{common['margin'] / GiB:.2f} GiB: model states and buffers {fixed_part / GiB:.2f} GiB, "
                f"activations {acts.allocated_peak / GiB:.2f} GiB at their peak in {acts.peak_phase}, "
                f"{allocator} {acts.overhead / GiB:.2f} GiB more"
            )
        host = self.optimizer_host + placed.host_bytes
        return Prediction(**common, status=status, reason=reason, acts=acts, rounding_buffers=placed.rounding_buffers,
                          device_total=total, host_per_device=host, host_per_node=host * self.local,
                          alpha=placed.alpha, alpha_binding=placed.alpha_binding,
                          alpha_bandwidth=placed.alpha_bandwidth, alpha_host=placed.alpha_host,
                          time=self.time(placed), tiles=placed.tiles)
