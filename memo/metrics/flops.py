"""Model FLOPs, MFU and TGS exactly as the MEMO paper defines them (§5.1).

Model FLOPs per sample, for a causal GPT with FlashAttention-style attention:

    6·s·P + 6·n·h·s²

with s the sequence length (tokens), P the parameter count of the whole model (all tensor- and
pipeline-parallel shards, the tied embedding once; an untied model's input embedding is a lookup
and is left out, its output layer counted: :func:`memo.model.gpt.model_flops_parameters`), n the
number of layers and h the hidden size (the query heads' width: grouped keys and values make the
same two s×s products).
6·s·P is forward (2) plus backward (4) of every weight; 6·n·h·s² is the same for the two s×s
attention matmuls at half density (the causal mask). Recomputation adds no model FLOPs, so a
method that recomputes more scores a lower MFU for the same work.

**The ceiling** (:func:`mfu_ceiling`): the MFU a step would reach if it ran nothing but the model's
FLOPs, each at the rate its kernels reach on the device (:mod:`memo.fit.rates` measures them): the
weights' GEMMs, 6·s·P, at the GEMM rate; attention's forward, 2·n·h·s², at the attention forward's,
and its backward, counted as 2.5 forwards (FlashAttention's backward makes the scores again, as
the rates count it), at the backward's. MFU counts attention's backward as 2 forwards, so even a
step that runs nothing else reaches only the ceiling; ``mfu / mfu_ceiling`` is the share of what
the kernels allow a run gets.

Where a sequence's documents are kept apart (``train.document_mask``) attention computes only
each document's own square: s² becomes Σ nᵢ² over the documents' lengths nᵢ
(:func:`model_flops`). A run then reports both: ``mfu`` by the paper's formula, as if the whole
sequence were attended, and ``mfu_documents`` by the attention computed.
"""

# FlashAttention's backward over its forward: the two gradient products of each of QKᵀ and PV,
# and QKᵀ again to make the scores
ATTENTION_BACKWARD_FLOPS = 2.5


def model_flops(tokens: int, squared_spans: int, params: int, num_layers: int, attention_width: int) -> float:
    """Model FLOPs (forward and backward) of ``tokens`` tokens whose causal attention spans
    (a whole sequence, or each document of one where documents are kept apart) have lengths
    whose squares sum to ``squared_spans`` (tokens²); ``attention_width`` is heads · head size (the
    paper's h, the hidden size, unless the heads are narrower or wider, as Qwen3's)."""
    return 6.0 * tokens * params + 6.0 * num_layers * attention_width * squared_spans


def model_flops_per_sample(seq: int, params: int, num_layers: int, attention_width: int) -> float:
    """Model FLOPs of one training sample (forward and backward) of ``seq`` tokens."""
    return model_flops(seq, seq**2, params, num_layers, attention_width)


def mfu(flops_per_iter: float, iter_time_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1].

    Args:
        flops_per_iter: model FLOPs of one iteration over all devices (every sample of the
            global batch), from :func:`model_flops_per_sample`.
        iter_time_s: wall-clock seconds of one iteration.
        num_devices: devices the iteration ran on.
        peak_flops: dense peak FLOP/s of one device.
    """
    return flops_per_iter / (iter_time_s * num_devices * peak_flops)


def tgs(tokens_per_iter: int, iter_time_s: float, num_devices: int) -> float:
    """Tokens per GPU (device) per second: the global batch's tokens over time and devices."""
    return tokens_per_iter / (iter_time_s * num_devices)


def mfu_ceiling(tokens: int, squared_spans: int, params: int, num_layers: int, attention_width: int,
                gemm_flops: float, attention_forward_flops: float, attention_backward_flops: float,
                peak_flops: float) -> float:
    """The MFU of a step that ran only the model's FLOPs at its kernels' rates (see the module
    docstring): ``model_flops / (peak · seconds)``, ``seconds`` the GEMMs' and attention's at
    ``gemm_flops``, ``attention_forward_flops`` and ``attention_backward_flops`` (FLOP/s of one
    device, the backward's counted as 2.5 forwards); arguments as :func:`model_flops`."""
    attention = 2.0 * num_layers * attention_width * squared_spans  # the forward's, causal
    seconds = (6.0 * tokens * params / gemm_flops + attention / attention_forward_flops
               + ATTENTION_BACKWARD_FLOPS * attention / attention_backward_flops)
    return model_flops(tokens, squared_spans, params, num_layers, attention_width) / (peak_flops * seconds)
