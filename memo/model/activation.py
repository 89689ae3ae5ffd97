"""The MLP's activation as a module of the local layer spec: GeLU, or SwiGLU on FC1's ``[gate, up]``.

Megatron's MLP builds it from ``MLPSubmodules.activation_func`` and calls it on FC1's whole
output (its ``use_te_activation_func`` path, which takes any module, not only Transformer
Engine's). Its own unfused SwiGLU would keep ``silu(gate)`` and a copy of ``up`` (as
``up + glu_linear_offset``) besides FC1's output; this one keeps FC1's output only, and with a
swap placement (``placement``) writes its output, which FC2 saves, into the rounding buffer
(:mod:`memo.model.placement`).
"""

import torch
from megatron.core.transformer.module import MegatronModule

from memo.model.placement import Placed, gelu, swiglu


class Activation(Placed, MegatronModule):
    """GeLU, or SwiGLU where the config has a gated linear unit (SiLU-gated). A Megatron module,
    so that the MLP's ``sharded_state_dict`` (distributed checkpoints) finds nothing to save here."""

    def __init__(self, config):
        super().__init__(config=config)
        self.gated = config.gated_linear_unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.placement) if self.gated else gelu(x, self.placement)
