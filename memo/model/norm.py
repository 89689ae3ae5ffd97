"""LayerNorm and RMSNorm for the local (non-Transformer-Engine) layer spec, sequence parallelism
included.

Megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism. Under it each tensor-parallel
rank normalizes its own slice of the sequence, so the norm's weight gradients are partial sums;
marking the weights ``sequence_parallel`` makes Megatron's ``finalize_model_grads`` all-reduce
them over the tensor-parallel group, as Transformer Engine's norms are treated.

Under a swap placement (``placement``), the output and statistics are written into the
rounding buffer that keeps them (:mod:`memo.model.placement`).

The model's final norm can be left to the tiled loss (``in_loss``), which normalizes one tile at a
time (:mod:`memo.model.loss`): its forward then hands its input on unchanged, and
:meth:`normalize` is the norm. The weights keep their place and names in the model.
"""

import torch

from memo.model.placement import Placed, layer_norm, rms_norm


class LayerNorm(Placed, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm constructor and sequence-parallel marking."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
        self.in_loss = False

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.in_loss else self.normalize(x)


class RMSNorm(Placed, torch.nn.Module):
    """RMSNorm (a weight, no bias, no mean) with Megatron's norm constructor and sequence-parallel
    marking, on PyTorch's fused kernel (:func:`memo.model.placement.rms_norm`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.in_loss = False

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.in_loss else self.normalize(x)


def norm_class(normalization: str) -> type:
    """The local spec's norm for ``model.normalization`` ("LayerNorm" or "RMSNorm")."""
    return {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
