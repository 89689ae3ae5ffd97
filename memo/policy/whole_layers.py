"""memo's own transformer layer over whole layers: ``full_recompute`` (keep each layer's input,
recompute the layer), the layer keeping everything (what a prediction traces for MEMO), and MEMO's
token-wise swapping and recomputation (``memo``, ``full_swap``: :class:`SwappedLayers`).

MEMO's prediction: two rounding buffers of one layer's skeletal tensors each hold every skeletal
tensor on the device (the last two layers keep all of theirs there); every other layer's input,
attention output and first α of its other skeletal tensors go to the host, so host memory per
node is ``(n − 2)·(S_input + S_attn + α·S_other)`` per device times the devices of a node.
"""

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from memo.config import ConfigError, Method, Workload
from memo.hardware import Hardware
from memo.model import LayerBuild, attention_width
from memo.model.placement import LayerRuntime
from memo.policy.base import ActivationPolicy, LayerSeconds, OutOfHostMemory, Placed, Situation, _host_lines
from memo.profile.template import IterationTemplate
from memo.swap import HostMemoryError, host_budget, prepare_swapped_layers
from memo.swap.alpha import AlphaSolution, SkeletalBytes, choose_alpha
from memo.swap.streams import Streams

_ALIGN = 256  # bytes: each tensor in a rounding buffer starts at a multiple


@dataclass(frozen=True)
class OurLayers(ActivationPolicy):
    """memo's layer keeping each layer's input and recomputing it (``recompute``), or keeping
    everything (``keep``), on whole layers."""

    method: Method

    @property
    def layers(self) -> LayerBuild:
        return LayerBuild(activations=self.method.layer_activations)

    def layer_tiles_tried(self, tried: tuple[Optional[int], ...], own: Optional[int]) -> tuple[Optional[int], ...]:
        if self.method.walks_tiles:
            return tuple(dict.fromkeys([*tried, own]))
        return (own,)

    def recompute_seconds(self, workload: Workload, seconds: LayerSeconds, alpha: float = 1.0,
                          checkpoint_every: int = 1) -> float:
        """Recomputing layers run their forward once more."""
        return seconds.forward if self.method.layer_activations == "recompute" else 0.0


@dataclass(frozen=True)
class SwappedLayers(OurLayers):
    """MEMO on whole layers: the swap runtime (:class:`memo.swap.SwapRuntime`) keeps every
    layer's saved tensors in two rounding buffers and swaps the first α of the tokens of each to
    the host, recomputing the rest."""

    has_runtime: ClassVar[bool] = True

    @property
    def layers(self) -> LayerBuild:
        return LayerBuild(activations="swap", token_wise_saves=True)

    @property
    def traced(self) -> ActivationPolicy:
        """The same layer keeping everything: :meth:`place` takes the kept tensors out."""
        return OurLayers(Method(name=self.method.name, layer_activations="keep"))

    def check_trace(self) -> None:
        raise ConfigError(
            f"method={self.method.name} moves skeletal tensors into its rounding buffers at run time, "
            "which a trace does not follow yet; trace method=none or a recomputation method"
        )

    @property
    def alpha(self) -> Optional[float]:
        return self.method.alpha

    def host_budget(self, hw: Hardware, device: torch.device, job_devices: int) -> float:
        """Its share of the node's host memory, and on a GPU of what can be pinned
        (:func:`memo.swap.host_budget`)."""
        return host_budget(hw, device, job_devices)

    def prepare(self, model, workload: Workload, device: torch.device, host_budget: float,
                streams: Optional[Streams] = None, group=None) -> LayerRuntime:
        return prepare_swapped_layers(model, workload, device, host_budget, self.alpha, streams, group)

    def recompute_seconds(self, workload: Workload, seconds: LayerSeconds, alpha: float = 1.0,
                          checkpoint_every: int = 1) -> float:
        """The dropped tokens run again up to FC2's input: QKV, the projection and FC1."""
        return (1 - alpha) * seconds.token_wise

    def place(self, situation: Situation) -> Placed:
        s, w = situation, situation.workload
        sizes = swapped_sizes(s.template, w)
        rounding = rounding_buffer_bytes(sizes)
        rounding *= s.in_flight  # (a pipeline stage's runtimes each have their two)
        try:  # each runtime its share of the host budget, α solved for its layers
            plan = host_plan(sizes, s.layers, self.alpha, s.seconds.forward, s.host_link, s.host_budget / s.in_flight)
        except HostMemoryError as error:
            need = s.in_flight * max(s.layers - 2, 0) * math.ceil(sizes.swapped(self.alpha or 0.0))
            raise OutOfHostMemory(str(error), need, rounding, self.alpha) from None
        solution = plan.solution
        alpha = solution.alpha
        # a swapped layer allocates what it recomputes of its dropped tokens as its backward starts
        recompute = math.ceil((1 - alpha) * sizes.other)
        trace = s.template.instance(s.tokens, s.layers * s.in_flight, swap=True, recompute_bytes=recompute,
                                    loss_tile_tokens=w.loss_tile_tokens)
        return Placed(trace, host_bytes=plan.per_device * s.in_flight, rounding_buffers=rounding,
                      recompute_s=self.recompute_seconds(w, s.seconds, alpha),
                      swap_exposed_s=_exposed_copies(w, s, sizes.swapped(alpha)), alpha=alpha,
                      alpha_binding=solution.binding, alpha_bandwidth=solution.alpha_bandwidth,
                      alpha_host=solution.alpha_host)

    def report_lines(self, prediction) -> list[str]:
        return _host_lines(prediction) + [alpha_line(prediction)]


def alpha_line(prediction) -> str:
    """The report's line of α: the one used, what bound it, and a walk's tiles' spread."""
    p, tiles = prediction, prediction.tiles
    return (f"alpha {p.alpha if p.alpha is None else round(p.alpha, 4)}, bound by {p.alpha_binding}"
            + (f"; per tile {min(tiles.solution.alphas):.3f} to {max(tiles.solution.alphas):.3f}, "
               f"a checkpoint layer every {tiles.solution.checkpoint_every}" if tiles else ""))


def _exposed_copies(workload: Workload, s: Situation, swapped_bytes: float) -> float:
    """A layer's copy to the host beyond the next layer's forward, and back beyond the backward,
    averaged over the stage's layers (its last two do not swap)."""
    seconds = s.seconds
    copy = swapped_bytes / s.host_link
    exposed = max(0.0, copy - seconds.forward) + max(0.0, copy - seconds.backward)
    per_stage = workload.model.num_layers // workload.parallel.pp
    return exposed * max(per_stage - 2, 0) / per_stage


def swapped_sizes(template: IterationTemplate, workload: Workload) -> SkeletalBytes:
    """One layer's skeletal bytes on one device as MEMO's runtime keeps them, split as its α
    problem needs them: the layer input (as traced), what attention produced (its output,
    ``b·s·h/tp`` elements, and its fp32 log-sum-exp per head and token), and the rest."""
    model, parallel, b = workload.model, workload.parallel, workload.micro_batch_size
    tokens = workload.seq // parallel.cp
    layer = min(2, template.layers - 1)
    total = template.kept_bytes(layer, tokens)
    layer_input = template.input_bytes(tokens)
    heads = model.num_attention_heads // parallel.tp
    attention = b * tokens * (attention_width(model) // parallel.tp * workload.dtype_bytes + heads * 4)
    return SkeletalBytes(layer_input, attention, total - layer_input - attention)


def rounding_buffer_bytes(sizes: SkeletalBytes) -> int:
    """Two rounding buffers, each one layer's skeletal tensors (``sizes``), 256-byte aligned."""
    return 2 * -(-(sizes.input + sizes.attention + sizes.other) // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class HostPlan:
    """MEMO's swap on one device: α, why, and the host bytes it needs."""

    solution: AlphaSolution
    per_device: int  # bytes


def host_plan(sizes: SkeletalBytes, layers: int, alpha: Optional[float], layer_time_s: float, bandwidth: float,
              budget: float) -> HostPlan:
    """α (given, or solved from the layer's predicted forward time) and the host bytes per device.

    Raises:
        HostMemoryError: if even α = 0 does not fit ``budget`` (status ``oohm``).
    """
    solution = choose_alpha(sizes, layers, layer_time_s, bandwidth, budget, alpha)
    per_device = max(layers - 2, 0) * math.ceil(sizes.swapped(solution.alpha))
    return HostPlan(solution, per_device)

