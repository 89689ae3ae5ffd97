"""DeepSpeed-Ulysses' attention as Megatron-core's core attention (``method=deepspeed_ulysses``).

DeepSpeed's own ``deepspeed.sequence.layer.DistributedAttention`` wraps a local attention: an
all-to-all turns q, k and v from this rank's tokens of every head into every token of
``heads/cp`` heads, the local attention runs causally over the whole sequence, and a second
all-to-all turns its output back. DeepSpeed takes each rank's tokens as one contiguous part of
the sequence (rank ``r`` holds tokens ``[r·s/cp, (r + 1)·s/cp)``), not Megatron's load-balanced
chunks, so the data and RoPE positions of this method are split that way
(:data:`memo.model.context_parallel.SEQUENCE_LAYOUTS`). The local attention is our SDPA kernel.

DeepSpeed is an optional extra; its communication layer (``deepspeed.comm``) is initialized here
over the process group torch already has. On a CPU it builds its shared-memory collective once
(a C++ compiler, cached under ``~/.cache/torch_extensions``).
"""

import torch
import torch.distributed as dist

from memo.config import ConfigError
from memo.model.attention import SdpaAttention, causal_attention

MISSING = ("method=deepspeed_ulysses needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]' "
           "(on a machine without CUDA it builds no ops; DS_BUILD_OPS=0 is its default on Linux)")


def require_deepspeed() -> None:
    """Raise :class:`ConfigError` (one line naming the extra) if DeepSpeed does not import."""
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except ImportError as error:
        raise ConfigError(MISSING) from error


class _LocalAttention(torch.nn.Module):
    """Causal attention over every token of some heads: ``[s, b, heads, dim]`` in and out."""

    def __init__(self, core: SdpaAttention):
        super().__init__()
        self.backend, self.scale, self.grouped = core.backend, core.softmax_scale, core.grouped

    def forward(self, query, key, value):
        out = causal_attention(query, key, value, self.backend, scale=self.scale, grouped=self.grouped)
        return out.view(*query.shape)


class DeepSpeedUlyssesAttention(SdpaAttention):
    """Our core attention with the sequence exchanged by DeepSpeed's ``DistributedAttention``
    over the context-parallel group (plain causal attention when there is none); constructed as
    :class:`SdpaAttention` is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require_deepspeed()
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        self.local = _LocalAttention(self)
        self.distributed = None
        if self.cp_group is not None:
            if not deepspeed.comm.is_initialized():
                deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
            # [s/cp, b, heads, dim]: heads (2) scattered, tokens (0) gathered
            self.distributed = DistributedAttention(self.local, self.cp_group, scatter_idx=2, gather_idx=0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """``[s/cp, b, heads·dim]``: attention of this rank's tokens over the whole sequence."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("DeepSpeedUlyssesAttention supports neither attention bias nor packed sequences")
        if self.distributed is None:
            out = self.local(query, key, value)
        else:
            out = self.distributed(query, key, value, batch_dim_idx=1)
        return out.reshape(out.shape[0], out.shape[1], -1)
