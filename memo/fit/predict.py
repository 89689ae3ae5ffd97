"""One configuration's prediction: memory per device and per node, α, verdict and time."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from memo.config import FitConfig, ParallelConfig, Workload
from memo.fit import memory
from memo.fit.template import iteration_template
from memo.fit.timing import TimePrediction, predict_time, tile_forward_times
from memo.hardware import GiB, Hardware
from memo.swap import HostMemoryError, host_share
from memo.swap.tile_alpha import TileShape
from memo.results import finite


@dataclass(frozen=True)
class Problem:
    """What stays fixed while layouts and lengths vary."""

    workload: Workload  # each prediction takes its own layout and length instead of this one's
    hardware: Hardware
    fit: FitConfig
    micro_batches: int = 1
    distributed_optimizer: Optional[bool] = None  # None: where dp·cp > 1 (memo.config.shards_optimizer)
    plan: bool = False  # transient tensors from the memory plan instead of the caching allocator
    alpha: Optional[float] = None  # swapping methods: the swapped fraction given, or None to solve it
    optimizer_offload: float = 0.0  # share of the parameters whose Adam states live on the host
    plan_time_limit_s: float = 10.0


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
    reserved: int  # fit.device_reserved_gib
    device_total: int  # what the verdict compares with the capacity (0 when oohm)
    device_capacity: int
    host_per_device: int
    host_per_node: int
    host_capacity_per_node: int
    alpha: Optional[float]
    alpha_binding: Optional[str]
    alpha_bandwidth: Optional[float]
    alpha_host: Optional[float]
    time: TimePrediction
    tiles: Optional[memory.TileHostPlan] = None  # layers walked in tiles that swap

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
            "predicted_device_bytes": self.device_total,
            "predicted_device_capacity_bytes": self.device_capacity,
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
    """``hw`` as predictions take it: without a device-host bandwidth (a CPU), copies are free."""
    return dataclasses.replace(hw, host_link_bytes_per_s=hw.host_link_bytes_per_s or math.inf)


def predict(problem: Problem, parallel: ParallelConfig, seq: int) -> Prediction:
    """Predict ``problem`` under ``parallel`` at ``seq`` tokens (see :mod:`memo.fit.memory` and
    :mod:`memo.fit.timing`)."""
    workload = problem.workload.at(parallel, seq)
    model, method, hw, fit = workload.model, workload.method, problem.hardware, problem.fit
    tokens = seq // parallel.cp
    layers = model.num_layers // parallel.pp
    in_flight = min(parallel.pp, problem.micro_batches)
    template = iteration_template(workload, layers * in_flight)
    states = memory.model_states(workload, problem.distributed_optimizer, problem.optimizer_offload)
    devices = parallel.tp * parallel.cp * parallel.pp * parallel.dp
    local = min(devices, hw.devices_per_node or 1)  # the job's devices on one node
    host_capacity = int(hw.host_memory_bytes * fit.host_usable_fraction)
    swap = workload.swaps

    def timed(alpha: float = 1.0, swapped: float = 0.0, tiles: Optional[memory.TileHostPlan] = None,
              exposed: Optional[float] = None) -> TimePrediction:
        return predict_time(workload, problem.micro_batches, hw, fit, alpha, swapped, states.params,
                            exposed_copy_s=tiles.exposed_copy_s if tiles else exposed,
                            checkpoint_every=tiles.solution.checkpoint_every if tiles else 1,
                            offloaded_params=states.offload.offloaded_params)

    common = dict(
        seq=seq,
        parallel=parallel,
        tile_tokens=workload.tile_tokens,
        states=states,
        # a walk in tiles exchanges into its stores; whole layers through their attention's buffers
        cp_buffers=memory.tiled_context_parallel_stores(workload) if workload.tiled
        else memory.context_parallel_buffers(workload),
        reserved=int(fit.device_reserved_gib * GiB),
        device_capacity=hw.device_memory_bytes,
        host_capacity_per_node=host_capacity,
    )
    alpha = solution = tile_plan = None
    host = rounding = recompute = 0
    # the optimizer's host memory is allocated first; the activations may have the rest
    optimizer_host = states.offload.host_bytes
    host_budget = host_share(host_capacity - local * optimizer_host, local)
    if host_budget < 0:
        return Prediction(
            **common, status="oohm", reason=(
                f"out of host memory: Adam's states on the host take {optimizer_host / GiB:.1f} GiB per device, "
                f"{local * optimizer_host / GiB:.1f} GiB of the node's {host_capacity / GiB:.1f} GiB usable, before "
                "any activation; lower train.optimizer_offload_fraction, add devices or set hardware.host_memory_gib"),
            acts=None, rounding_buffers=0, device_total=0, host_per_device=optimizer_host,
            host_per_node=optimizer_host * local, alpha=problem.alpha, alpha_binding=None, alpha_bandwidth=None,
            alpha_host=None, time=timed())
    if workload.tiled and workload.method.swaps:
        blocks = memory.tile_blocks(workload)
        sizes = template.tile_skeletal(workload.tile_tokens)
        try:
            tile_plan = memory.tile_host_plan(sizes, layers, tile_forward_times(workload, hw, fit, blocks),
                                              problem.alpha, hw.host_link_bytes_per_s, host_budget)
        except HostMemoryError as error:
            shape = TileShape(sizes, layers, len(blocks), 2)
            need = math.ceil(shape.host_bytes([problem.alpha or 0.0] * len(blocks), max(layers, 1)))
            return Prediction(
                **common, status="oohm", reason=str(error), acts=None, rounding_buffers=0, device_total=0,
                host_per_device=optimizer_host + need, host_per_node=(optimizer_host + need) * local,
                alpha=problem.alpha, alpha_binding=None, alpha_bandwidth=None, alpha_host=None, time=timed())
        host = tile_plan.per_device
        alphas = tile_plan.solution.alphas
        alpha = sum(alphas) / len(alphas)
    elif swap:
        sizes = memory.swapped_sizes(template, workload)
        rounding = memory.rounding_buffer_bytes(sizes)
        fixed = problem.alpha
        try:
            plan = memory.host_plan(
                sizes,
                layers,
                fixed,
                timed().layer_forward_s,
                hw.host_link_bytes_per_s,
                host_budget,
            )
        except HostMemoryError as error:
            need = max(layers - 2, 0) * math.ceil(sizes.swapped(fixed or 0.0))
            return Prediction(
                **common,
                status="oohm",
                reason=str(error),
                acts=None,
                rounding_buffers=rounding,
                device_total=0,
                host_per_device=optimizer_host + need,
                host_per_node=(optimizer_host + need) * local,
                alpha=fixed,
                alpha_binding=None,
                alpha_bandwidth=None,
                alpha_host=None,
                time=timed(),
            )
        solution, host = plan.solution, plan.per_device
        alpha = solution.alpha
        recompute = math.ceil((1 - alpha) * sizes.other)
    fixed_part = common["reserved"] + states.total + rounding + common["cp_buffers"]
    room = hw.device_memory_bytes - fixed_part
    trace = template.instance(tokens, layers * in_flight, swap=swap, recompute_bytes=recompute,
                              loss_tile_tokens=workload.loss_tile_tokens, tile_tokens=workload.tile_tokens)
    offload = exposed = None
    if method.offloads:
        passes = timed()
        offload = memory.megatron_offload(workload, layers * in_flight, hw.host_link_bytes_per_s,
                                          passes.layer_forward_s, passes.layer_backward_s)
        host, exposed = offload.host_bytes, offload.exposed_copy_s
        if host > host_budget:
            return Prediction(
                **common, status="oohm", reason=(
                    f"out of host memory: Megatron's offloading copies {host / GiB:.2f} GiB per device to the host "
                    f"but {host_budget / GiB:.2f} GiB can be pinned; shorten seq, offload fewer modules, add "
                    "devices or set hardware.host_memory_gib"),
                acts=None, rounding_buffers=0, device_total=0, host_per_device=optimizer_host + host,
                host_per_node=(optimizer_host + host) * local, alpha=None, alpha_binding=None,
                alpha_bandwidth=None, alpha_host=None, time=timed())
        room += offload.device_freed  # the allocator serves what the offloaded tensors leave
    acts = memory.activations(trace, room, problem.plan, problem.plan_time_limit_s)
    if offload is not None:
        acts = memory.less_offloaded(acts, offload.device_freed)
    total = fixed_part + acts.held
    status, reason = "ok", ""
    if acts.refused_bytes is not None and total <= hw.device_memory_bytes:
        status = "oom"
        reason = (
            f"the caching allocator cannot serve {acts.refused_bytes / GiB:.2f} GiB within "
            f"{room / GiB:.1f} GiB (fragmentation) at the peak in {acts.peak_phase}"
        )
    elif total > hw.device_memory_bytes:
        status = "oom"
        allocator = "the memory plan" if problem.plan else "the caching allocator"
        reason = (
            f"needs {total / GiB:.1f} GiB of {hw.device_memory_bytes / GiB:.1f} GiB: model states and "
            f"buffers {fixed_part / GiB:.1f} GiB, activations {acts.allocated_peak / GiB:.1f} GiB at "
            f"their peak in {acts.peak_phase}, {allocator} {acts.overhead / GiB:.1f} GiB more"
        )
    return Prediction(
        **common,
        status=status,
        reason=reason,
        acts=acts,
        rounding_buffers=rounding,
        device_total=total,
        host_per_device=optimizer_host + host,
        host_per_node=(optimizer_host + host) * local,
        alpha=alpha,
        alpha_binding=solution.binding if solution else _tile_binding(tile_plan),
        alpha_bandwidth=solution.alpha_bandwidth if solution else (
            min(tile_plan.solution.alpha_bandwidth) if tile_plan else None),
        alpha_host=solution.alpha_host if solution else None,
        time=timed(tiles=tile_plan) if tile_plan else timed(alpha if swap else 1.0,
                                                                  sizes.swapped(alpha) if swap else 0.0,
                                                                  exposed=exposed),
        tiles=tile_plan,
    )


def _tile_binding(plan: Optional[memory.TileHostPlan]) -> Optional[str]:
    """What bound the tile whose α is the smallest."""
    if plan is None:
        return None
    alphas = plan.solution.alphas
    return plan.solution.binding[alphas.index(min(alphas))]
