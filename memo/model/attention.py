"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-core's own ``DotProductAttention`` materializes the s×s score matrix and calls
``torch.cuda``; this module keeps attention memory O(s) (FlashAttention-style kernels on the GPU,
PyTorch's fused CPU kernel on the host), which is what every activation figure of MEMO assumes.
It plugs into the local layer spec as ``core_attention`` when Transformer Engine is absent. With
context parallelism each rank attends with its queries over the whole sequence's keys and values
(:mod:`memo.model.context_parallel`).

The kernel is chosen once per (device, dtype, head size) by trying the candidates in order of
speed on a small causal problem, forward and backward; the winner is the only one allowed
afterwards, so :attr:`SdpaAttention.backend` is the kernel that really ran.
"""

import functools
import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from memo.config import ConfigError
from memo.model.context_parallel import CP_COMM_TYPES, context_parallel_attention
from memo.model.documents import DocumentParams, Documents, block_kernel, document_attention
from memo.model.placement import Placed, Placement

# Fastest first on Hopper: cuDNN's fused attention, then FlashAttention-2, then the rest.
_CANDIDATES = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backend: str,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    grouped: bool = False,
    placement: Optional[Placement] = None,
    cp_group=None,
    cp_comm_type: str = "all_gather",
    documents: Optional[Documents] = None,
) -> torch.Tensor:
    """Causal attention with one SDPA kernel: ``[s, b, heads, dim]`` in, ``[s, b, heads·dim]`` out.

    ``placement`` (:class:`memo.model.placement.Placement`) sees the kernel's inputs and may
    replay its output instead of running it. With ``cp_group`` the tokens are this rank's part of
    a sequence split over that context-parallel group, exchanged by ``cp_comm_type``. With
    ``documents`` (the whole sequence's) each query attends within its document only
    (:func:`memo.model.documents.document_attention`, with ``backend``'s block kernel, or
    :func:`memo.model.context_parallel.context_parallel_attention`'s blocks cut by documents).
    """
    # [s, b, n, d] -> [b, n, s, d]: a view; the kernels take strided batch and head dims.
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

    def kernel() -> torch.Tensor:
        if cp_group is not None:
            return context_parallel_attention(q, k, v, cp_group, backend, scale, cp_comm_type, documents)
        if documents is not None:
            return document_attention(q, k, v, documents, block_kernel(backend, q, documents), scale)
        with sdpa_kernel([_CANDIDATES[backend]]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=grouped
            )

    out = kernel() if placement is None else placement.attention(q, k, v, kernel, scale, backend)
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


@functools.lru_cache(maxsize=None)
def select_backend(device_type: str, dtype: torch.dtype, head_dim: int, wanted: str = "auto",
                   grouped: bool = False) -> str:
    """Name of the first SDPA kernel (of ``wanted``, or of all when "auto") that runs here, for
    attention with one key/value head per query head, or fewer (``grouped``: not every fused
    kernel takes them).

    The probe runs forward and backward on query, key and value cut from one fused tensor, as
    Megatron's QKV projection hands them over, so strides match those of training.

    Raises:
        ConfigError: if ``wanted`` names a kernel that cannot run on this device and dtype.
    """
    names = list(_CANDIDATES) if wanted == "auto" else [wanted]
    heads = 2 if grouped else 1  # query heads per key/value head
    # A generator of its own: the probe must not move the global RNG that seeds the weights.
    generator = torch.Generator(device_type).manual_seed(0)
    for name in names:
        fused = torch.randn(64, 1, 2, (heads + 2) * head_dim, device=device_type, dtype=dtype,
                            generator=generator, requires_grad=True)
        q, k, v = fused.split([heads * head_dim, head_dim, head_dim], dim=-1)
        try:
            causal_attention(q.unflatten(-1, (heads, head_dim)).flatten(2, 3), k, v, backend=name,
                             grouped=grouped).sum().backward()
            return name
        except RuntimeError:
            continue
    shape = " with fewer key/value heads than query heads" if grouped else ""
    raise ConfigError(
        f"train.attention_backend={wanted} cannot run on {device_type} in {dtype} "
        f"with head size {head_dim}{shape}; use train.attention_backend=auto"
    )


class SdpaAttention(Placed, MegatronModule):
    """Causal self-attention for Megatron's ``[s, b, heads, head_dim]`` layout.

    Construction follows Megatron-core's ``CoreAttentionBuilder`` protocol, with ``backend``
    (a name from :func:`select_backend`) bound by the layer spec.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: str = "math",
    ):
        super().__init__(config=config)
        self.backend = backend
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaAttention supports causal masks only, not {attn_mask_type}")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = None  # the context-parallel group when the sequence is split over one
        self.cp_comm_type = cp_comm_type or "all_gather"
        if config.context_parallel_size > 1:
            if self.cp_comm_type not in CP_COMM_TYPES or self.dropout:
                raise ValueError(f"SdpaAttention's context parallelism runs cp_comm_type="
                                 f"{', '.join(CP_COMM_TYPES)} (not {cp_comm_type}) without dropout")
            self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.grouped = config.num_query_groups is not None and (
            config.num_query_groups != config.num_attention_heads
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attend causally (within each document, given :class:`~memo.model.documents.DocumentParams`);
        returns ``[s, b, heads·head_dim]``. ``attention_mask`` is unused: the causal mask is
        implicit, so no s×s tensor is ever built."""
        if attention_bias is not None:
            raise ValueError("SdpaAttention supports no attention bias")
        documents = None
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, DocumentParams):
                raise ValueError("SdpaAttention takes packed sequences as memo's DocumentParams only")
            if (self.dropout and self.training) or query.shape[1] != 1:
                raise ValueError("SdpaAttention keeps documents apart in one sequence per micro-batch, without "
                                 "attention dropout")
            documents = packed_seq_params.documents
        return causal_attention(
            query,
            key,
            value,
            self.backend,
            scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            grouped=self.grouped,
            placement=self.placement,
            cp_group=self.cp_group,
            cp_comm_type=self.cp_comm_type,
            documents=documents,
        )
