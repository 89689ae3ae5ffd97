"""Layers walked in sequence tiles (memo.swap.tiled_layer): losses and every gradient over three
steps equal keeping everything, for both layer types and several tile sizes."""

import pytest
import torch

from memo.config import ConfigError
from memo.model.tiles import tile_order
from memo.policy import SequenceTiles, SwappedLayers, policy_of
from memo.swap.tiled_layer import TiledLayers

from conftest import resolve_config
from swap_training import train_gradients

SEQ = 256
SHAPES = {
    "tiny": ("model.num_layers=4", "model.vocab_size=1000"),
    "tiny_llama": ("model=tiny_llama", "model.num_layers=4", "model.vocab_size=1000"),
}


@pytest.fixture(scope="module")
def reference(parallel_state):
    cache = {}

    def get(model: str, dtype: str):
        if (model, dtype) not in cache:
            cache[model, dtype] = train_gradients("none", *SHAPES[model], "train.loss=tiled",
                                                  f"train.dtype={dtype}", seq=SEQ)
        return cache[model, dtype]

    return get


def _assert_close(got, expected, steps=None):
    """Every gradient of the first ``steps`` steps (None: all) close to keeping everything's."""
    for step, (g, e) in enumerate(zip(got[:steps], expected[:steps], strict=True)):
        assert g.keys() == e.keys()
        for name in e:
            torch.testing.assert_close(g[name], e[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=step, n=name: f"step {s + 1}: {n}: {m}")


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("method", ["memo", "full_recompute"])
@pytest.mark.parametrize("tile", [SEQ, SEQ // 4, SEQ // 8])
def test_tiled_gradients_of_two_steps_equal_keeping_everything(reference, model, method, tile):
    # In float64: Adam's first step turns a gradient's float32 rounding into a step of up to lr
    # where the gradient is near its epsilon (1e-8), so the blocks' merge and the per-tile sums,
    # which round in another order than whole attention and one GEMM over all tokens, move the
    # third step's float32 gradients by a few 1e-6 (measured); float64 keeps them within 1e-8.
    expected_losses, expected, _ = reference(model, "fp64")
    losses, grads, walk = train_gradients(method, *SHAPES[model], f"method.tile_tokens={tile}",
                                          "train.dtype=fp64", seq=SEQ)
    assert isinstance(walk, TiledLayers) and walk.tile_tokens == tile
    assert next(iter(grads[0].values())).dtype == torch.float64
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    _assert_close(grads, expected)


@pytest.mark.parametrize("model", list(SHAPES))
def test_tiled_float32_gradients_equal_keeping_everything_to_rounding(reference, model):
    expected_losses, expected, _ = reference(model, "fp32")
    losses, grads, _ = train_gradients("memo", *SHAPES[model], f"method.tile_tokens={SEQ // 8}", seq=SEQ)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    _assert_close(grads, expected, steps=1)  # the same weights: float32 rounding apart


@pytest.mark.parametrize("overrides, fragment", [
    (["method=memo", "method.tile_tokens=100"], "does not divide seq=256"),
    (["method=megatron_full_recompute", "method.tile_tokens=64"], "not method=megatron_full_recompute"),
    (["method=none", "method.tile_tokens=64"], "not method=none"),
    (["method=memo", "method.tile_tokens=six"], "method.tile_tokens=six is not a sequence length"),
    (["method=memo", "method.tile_tokens=64", "parallel.cp=4"], "does not divide the 8 chunks"),
    (["method=memo", "method.tile_tokens=64", "parallel.cp=2", "parallel.tp=2",
      "parallel.sequence_parallel=true"], "without sequence parallelism so far"),
])
def test_a_tiled_run_it_cannot_do_is_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as error:
        resolve_config(*overrides, f"seq={SEQ}")
    assert "\n" not in str(error.value)


def test_whole_layers_are_the_default():
    assert resolve_config("method=memo").workload.layer_tile_tokens is None
    assert isinstance(policy_of(resolve_config("method=memo").workload), SwappedLayers)
    run = resolve_config("method=memo", "method.tile_tokens=4k", "seq=8k")
    assert run.workload.layer_tile_tokens == 4096 and isinstance(policy_of(run.workload), SequenceTiles)


@pytest.mark.slow
@pytest.mark.torchrun(2, "tiles_worker.check_tiles tp2", "tiles_worker.check_tiles tp2-sp",
                      "tiles_worker.check_tiles cp2")
def test_tiled_gradients_match_keeping_everything_with_tensor_sequence_and_context_parallelism(
        torchrun_results):
    """Two processes: heads split over tp; under sequence parallelism each tile gathered from both
    ranks' rows (the tokens in tile order); under context parallelism each rank's tiles attend over
    the store gathered from both, and their key and value gradients are summed over both."""
    split, sequence, context = torchrun_results
    assert split.passed() == ("2 tiled runs match over 2 steps (tp2)",) * 2
    assert sequence.passed() == ("3 tiled runs match over 2 steps (tp2-sp)",) * 2
    assert context.passed() == ("3 tiled runs match over 2 steps (cp2)",) * 2


def test_tile_order_gives_each_rank_its_rows_of_every_tile():
    tokens = torch.arange(16).unsqueeze(0)  # one sequence, tiles of 8 tokens over 2 ranks
    ordered = tile_order(tokens, 1, 8, 2)
    shards = ordered.chunk(2, dim=1)  # sequence parallelism's split
    assert shards[0].tolist() == [[0, 1, 2, 3, 8, 9, 10, 11]] and shards[1].tolist() == [[4, 5, 6, 7, 12, 13, 14, 15]]
    gathered_tile_1 = torch.cat([shard[:, 4:8] for shard in shards], dim=1)
    assert gathered_tile_1.tolist() == [list(range(8, 16))]
