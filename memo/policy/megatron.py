"""Megatron-core's own layers and what Megatron does with their activations: keep them (``none``),
recompute them (``megatron_full_recompute``, ``megatron_selective``; ``deepspeed_ulysses`` with
DeepSpeed-Ulysses' attention), or offload them to the host (``megatron_offload``, Transformer
Engine's layers; its bytes: :mod:`memo.policy.megatron_offload`)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from memo.config import Method, ParallelConfig, Workload
from memo.config.validate import CP_COMM_TYPES
from memo.model import LayerBuild
from memo.model.deepspeed_attention import require_deepspeed
from memo.policy.base import ActivationPolicy, LayerSeconds, OutOfHostMemory, Placed, Situation, _host_lines
from memo.model.gpt import layer_matmul_weights, mlp_matmul_weights
from memo.policy.megatron_offload import megatron_recompute, offloaded_bytes, offloaded_layers

GiB = 2**30


@dataclass(frozen=True)
class MegatronLayers(ActivationPolicy):
    """Megatron's ``TransformerLayer`` with the recomputation or offloading its method names."""

    method: Method

    @property
    def layers(self) -> LayerBuild:
        m = self.method
        return LayerBuild(ulysses=m.cp_attention == "deepspeed", recompute=megatron_recompute(m),
                          offload_modules=m.offload_modules)

    @property
    def offloads(self) -> bool:
        return self.method.offload_modules is not None

    @property
    def traced(self) -> ActivationPolicy:
        """Megatron's offloading is traced without it: :meth:`place` takes its bytes out."""
        return MegatronLayers(dataclasses.replace(self.method, offload_modules=None)) if self.offloads else self

    def check_training(self, parallel: ParallelConfig) -> None:
        super().check_training(parallel)
        if self.layers.ulysses:
            require_deepspeed()

    @property
    def exchanges(self) -> tuple[str, ...]:
        """DeepSpeed-Ulysses exchanges by its all-to-all only; our attention by any of Megatron's three."""
        return ("a2a",) if self.layers.ulysses else CP_COMM_TYPES

    def layer_tiles_tried(self, tried: tuple[Optional[int], ...], own: Optional[int]) -> tuple[Optional[int], ...]:
        return (own,)

    def recompute_seconds(self, workload: Workload, seconds: LayerSeconds, alpha: float = 1.0,
                          checkpoint_every: int = 1) -> float:
        """Full recomputation runs a layer's forward once more; selective, the modules it names:
        core attention's forward, the MLP's GEMMs (their share of the layer's), the norms (no
        GEMM: not counted)."""
        granularity = self.method.recompute_granularity
        if granularity == "full":
            return seconds.forward
        if granularity != "selective":
            return 0.0
        modules = self.method.recompute_modules or ("core_attn",)  # (Megatron's default)
        mlp = mlp_matmul_weights(workload.model) / layer_matmul_weights(workload.model)
        return ("core_attn" in modules) * seconds.attention + ("mlp" in modules) * mlp * seconds.gemm

    def place(self, situation: Situation) -> Placed:
        """Without offloading, everything on the device as traced. Megatron's offloading, on
        ``layers`` layers: the activations peak as the backward pass begins, every layer's tensors
        made: every offloading layer (all but the last, :func:`offloaded_layers`) then has its copies
        on the host, and the one whose backward comes next is brought back one group ahead, so
        ``layers − 2`` layers' freed bytes are off the device at the peak. A layer's copies to the
        host run beside its forward, and back beside the backward of the layer after it: what
        takes longer than those is exposed."""
        placed = super().place(situation)
        if not self.offloads:
            return placed
        s = situation
        layers = s.layers * s.in_flight
        per_layer = offloaded_bytes(s.workload)
        offloading = offloaded_layers(layers)
        host = offloading * per_layer.per_layer_host
        if host > s.host_budget:
            raise OutOfHostMemory(
                f"out of host memory: Megatron's offloading copies {host / GiB:.2f} GiB per device to the host "
                f"but {s.host_budget / GiB:.2f} GiB can be pinned; shorten seq, offload fewer modules, add "
                "devices or set hardware.host_memory_gib", host)
        copy = per_layer.per_layer_host / s.host_link
        exposed = (max(0.0, copy - s.seconds.forward) + max(0.0, copy - s.seconds.backward)) * offloading \
            / max(layers, 1)
        return dataclasses.replace(placed, host_bytes=host, swap_exposed_s=exposed,
                                   device_freed=max(offloading - 1, 0) * per_layer.per_layer_device_freed)

    def report_lines(self, prediction) -> list[str]:
        return _host_lines(prediction) if self.offloads else super().report_lines(prediction)

