"""The transformer layer of MEMO's methods: Megatron-core's ``TransformerLayer``, put in the
layer spec, with control over what its forward pass keeps for the backward pass.

* ``activations="swap"``: the layer hands its forward to its placement
  (:class:`memo.model.placement.Placement`, given after the model is built): a
  :class:`memo.swap.runtime.SwapRuntime` swaps and recomputes its skeletal activations
  token-wise (methods ``memo`` and ``full_swap``), a :class:`memo.swap.tiled_layer.TiledLayers`
  walks it in tiles of tokens.
* ``activations="recompute"``: the layer keeps only its input and runs its forward again in
  the backward pass, attention included (method ``full_recompute``, the paper's ablation).
* ``activations="keep"``: the layer keeps everything, as Megatron's would: the trace from which
  the fit planner takes a swapping method's activations (:mod:`memo.profile.template`).

The computation itself is Megatron's, unchanged. Without grad (validation) a layer runs plainly,
or as its placement evaluates it (a walk in tiles walks it, so that no whole-sequence attention
is made).
Under swapping the layer's own modules write the tensors it saves straight into the placement's
rounding buffer (:mod:`memo.model.placement`).
"""

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.utils.checkpoint import checkpoint

from memo.model.placement import Placed

ACTIVATIONS = ("swap", "recompute", "keep")


class MemoTransformerLayer(Placed, TransformerLayer):
    """Megatron's transformer layer with MEMO's activation management (see module docstring)."""

    def __init__(self, *args, activations: str = "swap", **kwargs):
        super().__init__(*args, **kwargs)
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations} is not one of {ACTIVATIONS}")
        self.activations = activations

    def run(self, **kwargs):
        """Megatron's forward pass, as is: ``(hidden_states, context)``."""
        return super().forward(**kwargs)

    def forward(self, *args, **kwargs):
        """The layer's forward; Megatron's ``TransformerBlock`` passes keyword arguments only."""
        if args:
            raise TypeError("MemoTransformerLayer takes keyword arguments only")
        if self.activations == "keep" or (self.placement is None and not torch.is_grad_enabled()):
            return self.run(**kwargs)
        if not torch.is_grad_enabled():
            return self.placement.evaluate(self, kwargs)
        if self.placement is not None:  # swapping, or a walk in tiles
            return self.placement.forward(self, kwargs)
        if self.activations == "recompute":
            # No dropout in our models, so there is no random state to replay.
            return checkpoint(self.run, use_reentrant=False, preserve_rng_state=False, **kwargs)
        raise RuntimeError("get the layers' runtime ready (memo.policy: its prepare) before training with swapping")
