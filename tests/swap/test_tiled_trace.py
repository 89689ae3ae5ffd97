"""The allocation trace of a step whose layers are walked in sequence tiles and swapped (fake
tensors): the device's memory of the walk is exactly its declared stores and ``R`` tile buffers,
a tile keeps nothing on the device from its forward to its backward whatever the length and the
depth, a tile's requests do not depend on the sequence's length, and at 7B and 1M tokens nothing
else asks for half a store."""

import functools
import re
from collections import defaultdict

import pytest
import torch

from memo.execute import distributed
from memo.execute.distributed import ProcessInfo
from memo.policy import build_model, policy_of
from memo.profile.iteration import trace_iteration

from conftest import resolve_config
from test_tiled_layer import SEQ, SHAPES

TILE_PHASE = re.compile(r"layer\.\d+\.(fwd\.t\d+|bwd\.t\d+|rebuild)")
FORWARD_TILE = re.compile(r"layer\.\d+\.fwd\.t\d+")
COMMON = ("mode=profile", "method=memo", "train.dtype=bf16", "train.loss_tile_tokens=64")


def _trace(*overrides: str, seq: int):
    """The workload and the events of one fake-traced iteration of tiled memo in bf16, the loss's
    tiles fixed (each setting's last value, as Hydra takes it: several tests read one trace)."""
    settings = dict(override.split("=", 1) for override in (*COMMON, *overrides, f"seq={seq}"))
    return _traced(tuple(f"{key}={value}" for key, value in settings.items()))


@functools.cache
def _traced(overrides: tuple[str, ...]):
    run = resolve_config(*overrides)
    return run.workload, trace_iteration(run.workload, policy_of(run.workload), "fake").events


def _requests(events) -> dict:
    """The sizes of the requests (bytes) of each phase."""
    phases = defaultdict(list)
    for event in events:
        if event.op == "malloc":
            phases[event.phase].append(event.size)
    return phases


def _kept_past_their_phase(events) -> dict:
    """Per phase, the sizes of its requests still alive when the next phase begins."""
    live, kept = {}, defaultdict(list)
    for i, event in enumerate(events):
        if event.op == "malloc":
            live[event.id] = event
        else:
            live.pop(event.id, None)
        ends = i + 1 == len(events) or events[i + 1].phase != event.phase
        if ends:
            kept[event.phase] = sorted(e.size for e in live.values() if e.phase == event.phase)
    return kept


def _sizes(model, seq: int) -> dict:
    """Bytes of the declared tensors (one sequence, bf16): keys (as much again for values) and the
    residual stream's ``[s, b, h]``."""
    d = model.hidden_size // model.num_attention_heads
    return {"keys": 2 * seq * (model.num_query_groups or model.num_attention_heads) * d,
            "residual": 2 * seq * model.hidden_size}


def _tile_buffer_bytes(*overrides: str, seq: int) -> int:
    """Bytes of one tile buffer of the workload, as training lays it out (real tensors)."""
    workload = resolve_config(*COMMON[1:], *overrides, f"seq={seq}").workload
    distributed.initialize(workload.parallel, "cpu", ProcessInfo(rank=0, world_size=1, local_rank=0))
    try:
        walk = policy_of(workload).prepare(build_model(workload, "cpu").module, workload, torch.device("cpu"), 2**40)
        walk.release()
        return walk.swap.layout.buffer_bytes
    finally:
        distributed.shutdown()


@pytest.mark.parametrize("model", list(SHAPES))
def test_the_walks_device_memory_is_its_declared_stores_and_two_tile_buffers(model):
    shape = (*SHAPES[model], "method.tile_tokens=64")
    workload, events = _trace(*shape, seq=SEQ)
    requests, size = _requests(events), _sizes(workload.model, SEQ)
    keys, residual, buffer = size["keys"], size["residual"], _tile_buffer_bytes(*shape, seq=SEQ)
    # before layer 0's tiles: keys and values, their float32 gradients, the input store into
    # which a layer's input comes back from the host, two tile buffers; and the layer's output
    assert sorted(requests["layer.0.fwd"]) == sorted([keys, keys, 2 * keys, 2 * keys, residual, buffer, buffer,
                                                      residual])
    for layer in range(1, 4):
        assert requests[f"layer.{layer}.fwd"] == [residual]  # its output, the next one's input
    for layer in range(4):  # the gradient stream below each layer
        assert requests[f"layer.{layer}.bwd"] == [residual]


@pytest.mark.parametrize("layers, seq", [(4, SEQ), (8, SEQ), (4, 2 * SEQ)])
def test_a_tile_keeps_nothing_on_the_device_until_its_backward(layers, seq):
    """The device's skeletal bytes are the two tile buffers (allocated once, by layer 0) for any
    depth and length: every other tensor a tile's forward makes is gone by the tile's end, but
    for the empty end of its graph (its RoPE angles are views of the model's one table)."""
    _, events = _trace(*SHAPES["tiny_llama"], f"model.num_layers={layers}", "method.tile_tokens=64", seq=seq)
    kept = _kept_past_their_phase(events)
    tiles = [phase for phase in kept if FORWARD_TILE.fullmatch(phase)]
    assert len(tiles) == layers * seq // 64
    assert all(kept[phase] == [0] for phase in tiles)  # RoPE's table is the model's, made with its angles


def test_a_tiles_requests_do_not_depend_on_the_sequence_length():
    shape = (*SHAPES["tiny_llama"], "method.tile_tokens=64")
    short, long = (_requests(_trace(*shape, seq=seq)[1]) for seq in (SEQ, 2 * SEQ))
    # every tile of every layer but the last, whose last two tiles keep everything in the buffers
    tiles = [phase for phase in short if TILE_PHASE.fullmatch(phase) and "rebuild" not in phase
             and not phase.startswith("layer.3.") and phase != "layer.0.fwd.t0"]
    assert len(tiles) == 3 * 2 * SEQ // 64 - 1
    for phase in tiles:  # tile t sees t + 1 blocks at either length
        assert sorted(short[phase]) == sorted(long[phase]), phase
    for layer in range(4):  # the rebuild: every tile's keys and values, as many requests per tile
        assert sorted(long[f"layer.{layer}.rebuild"]) == sorted(short[f"layer.{layer}.rebuild"] * 2)


def test_a_7b_layer_at_1m_tokens_asks_for_half_a_store_only_for_its_declared_tensors():
    seq = 1024 * 1024
    # the loss in tiles of 32k, whose fp32 logits (6.6 GB) stay under half the store (8.6 GB), as
    # the layers' tiles of 64k and their two buffers (7 GB each) do: a fake trace takes the time of
    # its operators, and the loss's tiles are many of them
    workload, events = _trace("model=7b", "model.num_layers=2", "method.tile_tokens=64k",
                              "train.loss_tile_tokens=32768", seq=seq)
    phases, size = _requests(events), _sizes(workload.model, seq)
    half = size["keys"]  # of the key/value store
    big = {phase: sorted(s for s in sizes if s >= half) for phase, sizes in phases.items()}
    assert not any(big[phase] for phase in phases if TILE_PHASE.fullmatch(phase))
    residual, keys = size["residual"], size["keys"]
    declared = {
        "embedding.fwd.lookup": [residual],  # layer 0's input
        "layer.0.fwd": sorted([keys, keys, 2 * keys, 2 * keys, residual, residual]),  # stores, output
        "layer.1.fwd": [residual],
        "loss.bwd": [residual],  # the gradient stream, from the loss (the final norm is in its tiles)
        "layer.1.bwd": [residual], "layer.0.bwd": [residual],
    }
    assert {phase: sizes for phase, sizes in big.items() if sizes} == declared
