"""Each method resolves to one activation policy, which alone answers what the method does: how
its layers are built, what a prediction traces for it, which layouts a search tries, and what it
recomputes; checked against the methods' files in conf/method/ and hand-computed figures."""

import dataclasses

import pytest

from memo.config import ConfigError, Method, ParallelConfig
from memo.config.validate import CP_COMM_TYPES
from memo.hardware import HARDWARE
from memo.model import LayerBuild
from memo.policy import LayerSeconds, MegatronLayers, OurLayers, SequenceTiles, SwappedLayers, policy_of
from memo.policy.tiles import tile_forward_times

from conftest import resolve_config

CPU = HARDWARE["cpu"]
# forward: gemm 1 + attention 2 + tp 0.5 + cp 0.25 = 3.75; backward: 2 + 5 + 0.5 + 0.75 = 8.25
SECONDS = LayerSeconds(gemm=1.0, attention=2.0, attention_backward=5.0, tp_pass=0.5, cp_forward=0.25,
                       cp_backward=0.75, token_wise=0.6, keys_values=0.3)


def _policy(*overrides: str):
    workload = resolve_config(*overrides).workload
    return workload, policy_of(workload)


@pytest.mark.parametrize("method, kind, layers", [
    ("none", MegatronLayers, LayerBuild()),
    ("megatron_full_recompute", MegatronLayers, LayerBuild(recompute=(
        ("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1)))),
    ("megatron_selective", MegatronLayers, LayerBuild(recompute=(
        ("recompute_granularity", "selective"), ("recompute_method", None), ("recompute_num_layers", None),
        ("recompute_modules", ("core_attn",))))),
    ("megatron_offload", MegatronLayers, LayerBuild(offload_modules=("core_attn", "attn_proj"))),
    ("megatron_offload_recompute", MegatronLayers, LayerBuild(
        offload_modules=("qkv_linear", "core_attn", "attn_proj"), recompute=(
            ("recompute_granularity", "selective"), ("recompute_method", None), ("recompute_num_layers", None),
            ("recompute_modules", ("mlp",))))),
    ("deepspeed_ulysses", MegatronLayers, LayerBuild(ulysses=True, recompute=(
        ("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1)))),
    ("full_recompute", OurLayers, LayerBuild(activations="recompute")),
    ("memo", SwappedLayers, LayerBuild(activations="swap", token_wise_saves=True)),
    ("full_swap", SwappedLayers, LayerBuild(activations="swap", token_wise_saves=True)),
])
def test_each_method_is_one_policy_that_says_how_its_layers_are_built(method, kind, layers):
    # (the MLP's recomputation with Megatron's offloading on a model without biases: tests/fit/test_megatron_offload.py)
    workload, policy = _policy(f"method={method}", *(["model=tiny_llama"] if method == "megatron_offload_recompute" else []))
    assert type(policy) is kind and policy.layers == layers
    assert policy.layers.sequence_layout == ("contiguous" if method == "deepspeed_ulysses" else "load_balanced")
    # the same method walking its layers in tiles is another policy
    if method in ("memo", "full_swap", "full_recompute"):
        tiled = policy_of(workload.in_layer_tiles(256))
        assert type(tiled) is SequenceTiles
        assert tiled.layers == LayerBuild(activations="swap" if method != "full_recompute" else "recompute")


def test_alpha_is_the_policys_own_fixed_one():
    assert _policy("method=memo")[1].alpha is None  # solved
    assert _policy("method=memo", "alpha=0.25")[1].alpha == 0.25
    assert _policy("method=full_swap")[1].alpha == 1.0
    assert _policy("method=none")[1].alpha is None


def test_a_prediction_traces_what_a_trace_can_follow():
    _, memo = _policy("method=memo")
    assert memo.traced == OurLayers(Method(name="memo", layer_activations="keep"))
    with pytest.raises(Exception, match="moves skeletal tensors into its rounding buffers"):
        memo.check_trace()
    _, offload = _policy("method=megatron_offload")
    assert offload.traced.layers == LayerBuild()  # Megatron's layers without the offloading
    _, none = _policy("method=none")
    assert none.traced is none
    workload, tiles = _policy("method=memo", "alpha=0.5", "method.tile_tokens=256", "seq=1k")
    assert tiles.traced.alpha is None and tiles.traced.layers == tiles.layers  # (traced at α = 0)


def test_what_each_policy_recomputes_per_layer():
    workload = resolve_config().workload
    assert _policy("method=none")[1].recompute_seconds(workload, SECONDS) == 0
    assert _policy("method=megatron_full_recompute")[1].recompute_seconds(workload, SECONDS) == 3.75
    assert _policy("method=megatron_selective")[1].recompute_seconds(workload, SECONDS) == 2.0
    assert _policy("method=full_recompute")[1].recompute_seconds(workload, SECONDS) == 3.75
    memo = _policy("method=memo")[1]
    assert memo.recompute_seconds(workload, SECONDS, alpha=0.25) == pytest.approx(0.75 * 0.6)
    swapped_tiles = policy_of(_policy("method=memo")[0].in_layer_tiles(256))
    # the keys and values again, and (k − 1)/2 layers' token-wise work between checkpoint layers
    assert swapped_tiles.recompute_seconds(workload, SECONDS, checkpoint_every=3) == pytest.approx(0.3 + 1.75)
    recomputed_tiles = policy_of(_policy("method=full_recompute")[0].in_layer_tiles(256))
    assert recomputed_tiles.recompute_seconds(workload, SECONDS) == pytest.approx(3.75 + 0.3)


def test_a_tiles_forward_time_is_its_share_of_the_token_wise_work_and_of_its_attention_blocks():
    # two tiles at blocks 0 and 1: attention (j + ½) of 2 → 0.5 and 1.5 of the 2 s
    assert tile_forward_times(SECONDS, [0, 1]) == pytest.approx([1.75 / 2 + 0.5, 1.75 / 2 + 1.5])


def test_only_policies_that_put_activations_on_the_host_measure_it():
    import torch

    device = torch.device("cpu")
    for method in ("none", "full_recompute", "megatron_full_recompute"):
        assert _policy(f"method={method}")[1].host_budget(CPU, device, 1) == 0.0
    assert _policy("method=memo")[1].host_budget(dataclasses.replace(CPU, host_memory_bytes=2**30), device, 1) \
        == 2**30
    recomputed = policy_of(_policy("method=full_recompute")[0].in_layer_tiles(256))
    assert recomputed.host_budget(CPU, device, 1) == 0.0


def test_the_layouts_a_search_tries_are_the_policys():
    assert _policy("method=deepspeed_ulysses")[1].exchanges == ("a2a",)
    assert _policy("method=memo")[1].exchanges == CP_COMM_TYPES
    # a method that walks tiles tries each tile of fit.tile_tokens and its own; one that cannot, its own
    assert _policy("method=memo")[1].layer_tiles_tried((None, 8192), 16384) == (None, 8192, 16384)
    assert _policy("method=none")[1].layer_tiles_tried((None, 8192), None) == (None,)
    # tiles under context parallelism: one exchange, no sequence parallelism, and only tiles the
    # fit models that split the sequence's chunks
    workload, _ = _policy("method=memo", "seq=64k")
    tiles = policy_of(workload.in_layer_tiles(8192))
    cp = ParallelConfig(tp=2, cp=2, sequence_parallel=True)
    assert tiles.candidate_layout(workload.in_layer_tiles(8192), cp, 65536) == dataclasses.replace(
        cp, sequence_parallel=False)
    assert tiles.candidate_layout(workload.in_layer_tiles(8192), dataclasses.replace(cp, cp_comm_type="p2p"),
                                  65536) is None
    assert tiles.candidate_layout(workload.in_layer_tiles(3 * 8192), cp, 65536) is None  # splits no chunk
    assert tiles.candidate_layout(workload.in_layer_tiles(256), ParallelConfig(), None) is None  # below 512
    assert _policy("method=memo")[1].candidate_layout(workload, cp, 65536) == cp


def test_training_runs_pipeline_parallelism_with_every_policy():
    for method in ("none", "memo", "full_recompute", "megatron_full_recompute"):
        assert _policy(f"method={method}")[1].training_refusal(ParallelConfig(pp=2)) is None


def test_a_plan_of_tiles_refuses_context_parallelism():
    # its template counts seq / tile tiles, one rank's whole sequence: under cp a rank walks a share
    workload, tiles = _policy("method=memo", "alpha=0.5", "method.tile_tokens=512", "seq=2k", "mode=plan")
    split = dataclasses.replace(workload, parallel=ParallelConfig(cp=2))
    with pytest.raises(ConfigError, match="without context parallelism, not parallel.cp=2; set parallel.cp=1"):
        tiles.planned_trace(split)
