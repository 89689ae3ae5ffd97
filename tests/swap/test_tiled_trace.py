"""The allocation trace of a step whose layers are walked in sequence tiles (fake tensors): the
stores and what a layer keeps are exactly their declared sizes, a tile's requests do not depend on
the sequence's length, and at 7B and 1M tokens nothing else asks for half a store."""

import re
from collections import defaultdict

import pytest

from memo.profile.iteration import trace_iteration

from conftest import resolve_config
from test_tiled_layer import SEQ, SHAPES


TILE_PHASE = re.compile(r"layer\.\d+\.(fwd\.t\d+|bwd\.t\d+|rebuild)")


def _requests(*overrides: str, seq: int):
    """The workload and the sizes of the requests (bytes) of each phase of one fake-traced
    iteration of tiled memo in bf16, the loss's tiles fixed."""
    run = resolve_config("mode=profile", "method=memo", "train.dtype=bf16", "train.loss_tile_tokens=64",
                         *overrides, f"seq={seq}")
    phases = defaultdict(list)
    for event in trace_iteration(run.workload, "fake").events:
        if event.op == "malloc":
            phases[event.phase].append(event.size)
    return run.workload, phases


def _sizes(model, seq: int) -> dict:
    """Bytes of the declared tensors of a layer (one sequence): keys (as much again for values),
    the residual stream's ``[s, b, h]``, memo's kept attention output and log-sum-exp."""
    d = model.hidden_size // model.num_attention_heads
    return {"keys": 2 * seq * (model.num_query_groups or model.num_attention_heads) * d,
            "residual": 2 * seq * model.hidden_size, "out": 2 * seq * model.num_attention_heads * d,
            "lse": 4 * seq * model.num_attention_heads}


@pytest.mark.parametrize("model", list(SHAPES))
def test_the_stores_and_what_a_layer_keeps_are_exactly_their_declared_sizes(model):
    workload, phases = _requests(*SHAPES[model], "method.tile_tokens=64", seq=SEQ)
    size = _sizes(workload.model, SEQ)
    keys, kept = size["keys"], [size["out"], size["lse"], size["residual"]]
    # the stores once, before layer 0's tiles: keys and values, their float32 gradients
    assert sorted(phases["layer.0.fwd"]) == sorted([keys, keys, 2 * keys, 2 * keys, *kept])
    for layer in range(1, 4):
        assert sorted(phases[f"layer.{layer}.fwd"]) == sorted(kept)
    for layer in range(4):  # the gradient stream below each layer
        assert phases[f"layer.{layer}.bwd"] == [size["residual"]]


def test_a_tiles_requests_do_not_depend_on_the_sequence_length():
    shape = (*SHAPES["tiny_llama"], "method.tile_tokens=64")
    _, short = _requests(*shape, seq=SEQ)
    _, long = _requests(*shape, seq=2 * SEQ)
    tiles = [phase for phase in short if TILE_PHASE.fullmatch(phase) and "rebuild" not in phase]
    assert len(tiles) == 4 * 2 * SEQ // 64  # every layer's tiles, forward and backward
    for phase in tiles:  # tile t sees t + 1 blocks at either length
        assert sorted(short[phase]) == sorted(long[phase]), phase
    for layer in range(4):  # the rebuild: every tile's keys and values, as many requests per tile
        assert sorted(long[f"layer.{layer}.rebuild"]) == sorted(short[f"layer.{layer}.rebuild"] * 2)


def test_a_7b_layer_at_1m_tokens_asks_for_half_a_store_only_for_its_declared_tensors():
    seq = 1024 * 1024
    workload, phases = _requests("model=7b", "model.num_layers=2", "method.tile_tokens=64k",
                                 "train.loss_tile_tokens=8192", seq=seq)
    size = _sizes(workload.model, seq)
    half = size["keys"]  # of the key/value store
    big = {phase: sorted(s for s in sizes if s >= half) for phase, sizes in phases.items()}
    assert not any(big[phase] for phase in phases if TILE_PHASE.fullmatch(phase))
    residual, keys = size["residual"], size["keys"]
    declared = {
        "embedding.fwd": [residual],  # layer 0's input
        "layer.0.fwd": sorted([keys, keys, 2 * keys, 2 * keys, size["out"], residual]),
        "layer.1.fwd": [size["out"], residual],
        "loss.bwd": [residual],  # the gradient stream, from the loss (the final norm is in its tiles)
        "layer.1.bwd": [residual], "layer.0.bwd": [residual],
    }
    assert {phase: sizes for phase, sizes in big.items() if sizes} == declared
