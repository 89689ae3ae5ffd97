"""The work a step does, counted operator by operator, against hand-computed values: a linear
layer's three products, an attention call's pairs, and one small step of memo in tiles whose
recomputation and copies are exactly what its α and tiles make unavoidable."""

import torch

from memo.metrics.work import FORWARD, INPUT_GRAD, WEIGHT_GRAD, WorkCounter
from memo.policy import policy_of
from memo.profile.work import count_step

from conftest import resolve_config


def test_a_linear_layers_products_are_attributed_to_its_weight_by_pass():
    weight = torch.randn(48, 32, requires_grad=True)  # [o, i]
    x = torch.randn(5, 7, 32, requires_grad=True)  # 35 tokens
    with WorkCounter([("w", weight)]) as counter:
        torch.nn.functional.linear(x, weight).sum().backward()
    each = 2 * 35 * 48 * 32
    assert dict(counter.work.gemm_flops) == {("w", FORWARD): each, ("w", INPUT_GRAD): each, ("w", WEIGHT_GRAD): each}
    assert counter.work.other_gemm_flops == 0


def test_a_square_weights_forward_and_input_gradient_are_told_apart():
    weight = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(10, 32, requires_grad=True)
    with WorkCounter([("w", weight)]) as counter:
        (x @ weight.t() @ weight.t()).sum().backward()  # two forward products, two of each gradient
    each = 2 * 10 * 32 * 32
    assert dict(counter.work.gemm_flops) == {("w", FORWARD): 2 * each, ("w", INPUT_GRAD): 2 * each,
                                             ("w", WEIGHT_GRAD): 2 * each}


def test_attention_calls_count_the_pairs_they_attend_and_the_keys_they_read():
    q = torch.randn(1, 8, 64, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(2))
    with WorkCounter([]) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert counter.work.attention_pairs(False) == counter.work.attention_pairs(True) == 64 * 65 // 2
    assert counter.work.attention_forward_flops() == 4 * 8 * 16 * 64 * 65 // 2
    call = next(c for c in counter.work.attention if not c.backward)
    assert (call.query_heads, call.key_heads, call.causal) == (8, 2, True)
    # grouped heads handed over as they are: two heads of 64 tokens, keys and values, each way
    assert counter.work.key_value_bytes_read == 2 * (2 * 2 * 64 * 16 * 4)


def test_a_tiled_memo_step_recomputes_and_copies_exactly_what_its_alpha_and_tiles_need():
    # tiny_llama: h 256, 8 query heads over 2 key/value groups of d 32, SwiGLU of f 768, vocabulary
    # 8192; 2 layers of 256 tokens in 4 tiles of 64, α 0.5 (32 tokens kept a tile), fp32 (e = 4)
    workload = resolve_config("model=tiny_llama", "model.num_layers=2", "method=memo", "alpha=0.5", "seq=256",
                              "method.tile_tokens=64").workload
    step = count_step(workload, policy_of(workload), fake=False)
    work = step.work
    recomputed = work.recomputed_flops
    # keys and values of layer 0 only (layer 1's are in the store when its backward begins):
    #   2·s·h·2gd = 2·256·256·128 = 16,777,216
    # 6 tiles sent out (the walk's last two stay in the buffers), 32 tokens dropped of each, each
    # made again up to FC2's input without its key and value: query 2·256·256, projection 2·256·256,
    # FC1 2·256·1536: 1,048,576 a token, 6·32·1,048,576 = 201,326,592
    # the tiled loss's logits once more: 2·256·256·8192 = 1,073,741,824
    assert recomputed == 16_777_216 + 201_326_592 + 1_073_741_824
    # each way: both layers' inputs 2·256·256·4 = 524,288; per tile sent, attention's output
    # 64·256·4 = 65,536 and log-sum-exp 64·8·4 = 2,048, and 32 tokens of the rest: two float32 norm
    # statistics and, of 4 bytes each, norm 256, query 256, residual 256, norm 256, FC1 1536,
    # SwiGLU 768: 32·(8 + 4·3328) = 426,240; 6·493,824 = 2,962,944
    assert step.copied["d2h"] == step.copied["h2d"] == 524_288 + 2_962_944
    # attention: each layer's causal pairs once forward, once backward, none again
    assert work.attention_pairs(False) == work.attention_pairs(True) == 2 * 256 * 257 // 2
