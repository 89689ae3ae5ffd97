"""Tiles swapped (memo.swap.tiled_layer with a swap runtime): every tile a unit with its own α,
R tile buffers reused, every k-th layer's input on the host and the others made again through
the layers between. Gradients over two steps equal keeping everything (float64), every wait of
the walk is needed, and the host holds exactly its formula."""

import pytest
import torch

from memo.swap.layout import ATTENTION, TOKENS
from memo.swap.streams import DeferredStreams
from memo.swap.layer_inputs import LayerInputs

from swap_training import train_gradients
from test_swap_runtime import RUNTIME_WAITS, missing_wait_shows
from test_tiled_layer import SEQ, SHAPES, _assert_close

FP64 = ("train.loss=tiled", "train.dtype=fp64")
RAMP = [0.0, 0.25, 0.5, 1.0]  # α of the four tiles of 64 tokens: later tiles hide more copy time


@pytest.fixture(scope="module")
def reference(parallel_state):
    cache = {}

    def get(model: str, *more: str):
        key = (model, *more)
        if key not in cache:
            cache[key] = train_gradients("none", *SHAPES[model], *FP64, *more, seq=SEQ)
        return cache[key]

    return get


@pytest.mark.parametrize("model, alphas, buffers, k", [
    ("tiny", [0.0] * 4, 2, 1),
    ("tiny", [0.5] * 4, 2, 2),
    ("tiny_llama", [1.0] * 4, 2, 4),
    ("tiny_llama", RAMP, 3, 2),
    ("tiny", RAMP[::-1], 3, 1),
])
def test_swapped_tiles_give_the_gradients_of_keeping_everything(reference, model, alphas, buffers, k):
    """Four layers of four tiles: 16 units through 2 or 3 buffers, each buffer reused 5 to 8
    times; the inputs of layers 0, k, 2k, ... on the host; copies done as late as the events
    allow."""
    expected_losses, expected, _ = reference(model)
    streams = DeferredStreams()
    losses, grads, walk = train_gradients("memo", *SHAPES[model], *FP64, "method.tile_tokens=64", seq=SEQ,
                                          streams=streams, tile_alphas=alphas, tile_buffers=buffers,
                                          checkpoint_every=k)
    runtime = walk.swap
    assert walk.inputs.host.shape[0] == -(-4 // k)
    assert runtime.keeps == tuple(int(a * 64) for a in alphas) * 4 and streams.copies_run > 0
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    _assert_close(grads, expected)
    rows = runtime.take_accounting()
    layout = runtime.layout
    tokens = layout.bytes_of(TOKENS)
    dropped = sum(tokens * (64 - k) // 64 for k in runtime.keeps[:runtime.swapped_units])
    assert sum(r["recomputed"] for r in rows) == 2 * dropped  # two steps


def test_full_swap_in_tiles_swaps_every_token_and_recomputes_none(reference):
    expected_losses, expected, _ = reference("tiny_llama")
    losses, grads, walk = train_gradients("full_swap", *SHAPES["tiny_llama"], *FP64, "method.tile_tokens=64",
                                          seq=SEQ, streams=DeferredStreams())
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    _assert_close(grads, expected)
    assert walk.swap.keeps == (64,) * 16
    assert sum(r["recomputed"] for r in walk.swap.take_accounting()) == 0


@pytest.mark.parametrize("alphas, k", [([0.5] * 4, 1), (RAMP, 3)])
def test_the_host_holds_exactly_its_formula_and_the_device_r_tile_buffers(parallel_state, alphas, k):
    *_, walk = train_gradients("memo", *SHAPES["tiny_llama"], "method.tile_tokens=64", seq=SEQ, steps=1,
                               tile_alphas=alphas, tile_buffers=3, checkpoint_every=k)
    runtime, layout = walk.swap, walk.swap.layout
    model = walk.layers[0].config
    c, h = 64, model.hidden_size
    heads, d = model.num_attention_heads, model.hidden_size // model.num_attention_heads
    # a tile's attention output [c, b, heads, d] and float32 log-sum-exp [b, heads, c]
    assert layout.bytes_of(ATTENTION) == 4 * c * heads * d + 4 * c * heads
    per_tile = [layout.bytes_of(ATTENTION) + layout.bytes_of(TOKENS) * int(a * c) // c for a in alphas]
    # every tile but the last layer's last three, which stay in the buffers
    assert runtime.slab.numel() == 4 * sum(per_tile) - sum(per_tile[1:])
    # the inputs of layers 0, k, 2k, ... in fp32
    assert walk.inputs.host.numel() * walk.inputs.host.element_size() == -(-4 // k) * SEQ * h * 4
    assert [b.numel() for b in runtime.buffers] == [layout.buffer_bytes] * 3
    walk.release()


# the walk's own waits, besides the runtime's: on the layer inputs it sends to the host, and on
# the kept attention outputs a chain of layers brings back
WALK_WAITS = [
    ("offload", "d2h", "compute"),  # an input copied out before compute made it
    ("prefetch_rows", "h2d", "compute"),  # an input's rows copied into the store the layer above still reads
    ("reload", "h2d", "compute"),  # the top layer's input copied into the store without a prefetch, too early
    ("reload", "compute", "h2d"),  # the keys made from the store before the input is back
    ("kept_output", "h2d", "compute"),  # a tile's output copied over the previous tile's in use
    ("kept_output", "compute", "h2d"),  # a chain reading a tile's output before it is back
]


@pytest.mark.parametrize("site, waiter, producer", RUNTIME_WAITS + WALK_WAITS)
def test_each_missing_wait_of_the_walk_would_corrupt_the_gradients_or_fail_the_ordering_check(
        reference, site, waiter, producer):
    """Tiles of 128: two per layer, both of the last layer's in the buffers (its input stays on
    the device), every other layer's input brought back as the layer above frees the store; k = 3
    for the chains (layer 2's input made from layer 0's). For the top layer's own reload, tiles of
    64: four a layer, two of the last layer's sent out, so its input is too."""
    k = 3 if site == "kept_output" else 1
    tile = 64 if (site, waiter) == ("reload", "h2d") else 128

    def train(streams):
        return train_gradients("memo", *SHAPES["tiny"], *FP64, f"method.tile_tokens={tile}", seq=SEQ, steps=1,
                               streams=streams, tile_alphas=[0.5] * (SEQ // tile), checkpoint_every=k)[1]

    assert missing_wait_shows(train, reference("tiny")[1], site, waiter, producer), "nothing sees this missing wait"



def test_a_layer_input_sent_to_the_host_is_held_until_compute_has_waited_for_its_copy():
    """The plan's arena hands a freed tensor's memory to compute at once (it ignores
    record_stream): a layer input on its way to the host is held until compute has waited for the
    copy, which the walk makes it do at the end of the layer's forward."""
    streams = DeferredStreams()
    x = torch.arange(12.0).view(3, 2, 2)
    inputs = LayerInputs.empty(2, x, pin=False)
    inputs.host.zero_()
    inputs.offload(1, x, streams)
    assert inputs.sending[0] is x and not inputs.host[1].any()  # the copy has not run: x is held
    inputs.sent(streams)
    assert inputs.sending is None and torch.equal(inputs.host[1], x)
