"""α per tile and the checkpoint interval k (memo.swap.tile_alpha): hand-computed cases, the
reduction to the paper's α at one tile per layer and k = 1, the smallest k, and oohm."""

import math

import pytest

from memo.swap.alpha import HostMemoryError, SkeletalBytes, solve_alpha
from memo.swap.tile_alpha import TileShape, smallest_checkpoint_interval, solve_tiles

MIB = 2**20


@pytest.mark.parametrize("layer_time, bandwidth, budget", [
    (0.010, 20e9, 64 * 2**30),  # bandwidth binds
    (0.010, 20e9, 6.3 * 2**30),  # the host binds
    (1.0, 20e9, 64 * 2**30),  # nothing binds: α = 1
    (0.001, 20e9, 64 * 2**30),  # even α = 0 cannot hide: α = 0
])
def test_one_tile_per_layer_and_every_layer_a_checkpoint_is_the_papers_alpha(layer_time, bandwidth, budget):
    sizes = SkeletalBytes(input=32 * MIB, attention=40 * MIB, other=400 * MIB)
    paper = solve_alpha(sizes, 24, layer_time, bandwidth, budget)
    tiles = solve_tiles(TileShape(sizes, layers=24, tiles=1, buffers=2), [layer_time], bandwidth, budget)
    assert tiles.checkpoint_every == 1
    assert tiles.alphas[0] == pytest.approx(paper.alpha, abs=1e-12)
    assert tiles.binding[0] == paper.binding
    assert tiles.host_bytes == pytest.approx(22 * sizes.swapped(paper.alpha))


def test_each_tiles_alpha_is_its_bandwidth_bound_by_hand():
    # a tile: 1 MiB of input, 2 MiB of attention, 8 MiB of other tensors; 1 GB/s
    sizes = SkeletalBytes(input=MIB, attention=2 * MIB, other=8 * MIB)
    times = [0.004, 0.006, 0.008, 0.010]  # attention grows with t
    solution = solve_tiles(TileShape(sizes, layers=4, tiles=4, buffers=2), times, 2**30, 2**40)
    # tile t hides behind tile t + 1 (the last behind the next layer's tile 0):
    # α_t = (B·T_f(t + 1) − 3 MiB) / 8 MiB, with B = 1 GiB/s = 1024 MiB/s
    expected = [(1024 * times[(t + 1) % 4] - 3) / 8 for t in range(4)]
    assert solution.alpha_bandwidth == pytest.approx(expected)
    assert solution.alphas == pytest.approx([min(1.0, max(a, 0.0)) for a in expected])
    assert solution.alphas[0] < solution.alphas[1] < solution.alphas[2]  # later tiles swap more
    assert solution.binding == ("bandwidth",) * 4 and solution.checkpoint_every == 1


def test_the_host_lowers_every_alpha_to_one_cap():
    sizes = SkeletalBytes(input=MIB, attention=2 * MIB, other=8 * MIB)
    shape = TileShape(sizes, layers=4, tiles=4, buffers=2)  # 14 units swap: tiles 0, 1 of 4 layers, 2, 3 of 3
    free = solve_tiles(shape, [1.0] * 4, 2**30, 2**40)
    assert free.alphas == (1.0,) * 4 and free.binding == ("none",) * 4
    # k = 1: every layer's input (layer 3's last two tiles stay in the buffers, its first two swap)
    base = 14 * 2 * MIB + 4 * 4 * MIB
    budget = base + 8 * MIB * 14 * 0.25  # room for α = 0.25 everywhere
    capped = solve_tiles(shape, [1.0] * 4, 2**30, budget)
    assert capped.alphas == pytest.approx((0.25,) * 4) and capped.binding == ("host",) * 4
    assert capped.host_bytes == pytest.approx(budget)
    # tiles the bandwidth already holds under the cap keep their α; the others share what is left
    times = [1.0, 0.0032, 1.0, 1.0]  # α_0 = 0.0346 (behind tile 1), the others at 1 but for the host
    mixed = solve_tiles(shape, times, 2**30, budget)
    wanted_0 = (1024 * 0.0032 - 3) / 8
    assert mixed.alphas[0] == pytest.approx(wanted_0)
    cap = (budget - base - 8 * MIB * 4 * wanted_0) / (8 * MIB * 10)  # tiles 1..3 swap in 4 + 3 + 3 units
    assert mixed.alphas[1:] == pytest.approx((cap,) * 3)
    assert mixed.host_bytes == pytest.approx(budget)


def test_the_smallest_checkpoint_interval_that_fits_and_oohm_naming_the_host_term():
    sizes = SkeletalBytes(input=4 * MIB, attention=MIB, other=8 * MIB)
    shape = TileShape(sizes, layers=8, tiles=2, buffers=2)  # 14 units swap, layer 7 resident
    attention = 14 * MIB
    # k = 1: 7 inputs of 8 MiB; k = 2: layers 0, 2, 4, 6; k = 4: 0, 4; k = 8: layer 0
    assert [shape.host_inputs(k) for k in (1, 2, 4, 8)] == [7, 4, 2, 1]
    assert smallest_checkpoint_interval(shape, attention + 7 * 8 * MIB) == 1
    assert smallest_checkpoint_interval(shape, attention + 4 * 8 * MIB) == 2
    assert smallest_checkpoint_interval(shape, attention + 3 * 8 * MIB) == 3  # layers 0, 3, 6
    assert solve_tiles(shape, [0.01, 0.01], 2**30, attention + 2 * 8 * MIB).checkpoint_every == 4
    with pytest.raises(HostMemoryError, match="layer inputs") as error:
        solve_tiles(shape, [0.01, 0.01], 2**30, attention + 8 * MIB - 1)
    assert "\n" not in str(error.value)
    # a fixed α is checked the same way, with the smallest k for it
    fixed = solve_tiles(shape, [0.01, 0.01], 2**30, 2**40, fixed=[0.5, 1.0])
    assert fixed.alphas == (0.5, 1.0) and fixed.checkpoint_every == 1 and fixed.binding == ("fixed", "fixed")
    assert math.isclose(fixed.host_bytes, attention + 7 * (0.5 + 1.0) * 8 * MIB + 7 * 8 * MIB)
