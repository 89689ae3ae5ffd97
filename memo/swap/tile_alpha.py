"""α per tile and the checkpoint interval k of MEMO in sequence tiles.

A layer walked in ``T`` tiles makes ``T`` units of the swap runtime (unit ``u = i·T + t``); the
last ``R`` units keep everything in the tile buffers. Every other unit sends to the host what its
tile's attention produced (output and log-sum-exp, ``S_attn``) and the first ``α_t`` of every other
saved tensor (``S_other``); the inputs of the checkpoint layers ``0, k, 2k, ...`` go to the host
whole (``S_input`` a layer), except a layer whose every unit stays in the buffers, whose input stays
on the device. Per tile ``t``::

    maximize Σ_t α_t  subject to
        (S_attn + S_input/T + α_t·S_other) / B  ≤  T_f(t + 1)      (hidden behind the next tile)
        Σ_{swapped units} (S_attn + α_t·S_other) + (checkpoint inputs)·S_input  ≤  M_host
        0 ≤ α_t ≤ 1

with ``T_f(t + 1)`` the forward time of the next tile (tile 0 of the next layer after the last).
Attention grows with ``t``, so the bandwidth bound does: later tiles hide more of their copy.
First the smallest ``k`` whose α = 0 bytes fit the host (``oohm`` when none does), then each α_t
at its bandwidth bound, all of them lowered to one cap until the host fits (the objective is
linear: any fill reaching the budget is optimal, and one cap keeps the later tiles' advantage).

With ``T = 1`` and ``k = 1`` (every layer a checkpoint, the last two resident) this is
:func:`memo.swap.alpha.solve_alpha` exactly.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from memo.swap.alpha import HostMemoryError, SkeletalBytes


@dataclass(frozen=True)
class TileShape:
    """What swaps: ``layers`` layers of ``tiles`` tiles, ``buffers`` of whose units stay on the
    device; ``sizes`` are one tile's skeletal bytes, ``sizes.input`` its share of the layer input."""

    sizes: SkeletalBytes
    layers: int
    tiles: int
    buffers: int

    @property
    def units(self) -> int:
        return self.layers * self.tiles

    @property
    def swapped_units(self) -> int:
        return max(self.units - self.buffers, 0)

    def swapped_per_tile(self) -> list[int]:
        """Of each tile index ``t``, how many layers' unit ``i·T + t`` swaps."""
        return [sum(1 for i in range(self.layers) if i * self.tiles + t < self.swapped_units)
                for t in range(self.tiles)]

    def host_inputs(self, k: int) -> int:
        """Checkpoint layers whose input goes to the host: every k-th, but those whose every unit
        stays in the buffers."""
        return sum(1 for i in range(0, self.layers, k) if i * self.tiles < self.swapped_units)

    def host_bytes(self, alphas: Sequence[float], k: int) -> float:
        """Bytes on the host at ``alphas`` (α of each tile) and checkpoint interval ``k``."""
        swapped = sum(n * (self.sizes.attention + a * self.sizes.other)
                      for n, a in zip(self.swapped_per_tile(), alphas, strict=True))
        return swapped + self.host_inputs(k) * self.tiles * self.sizes.input


@dataclass(frozen=True)
class TileSolution:
    """α of each tile, k, and why: per tile ``binding`` is "bandwidth", "host", "none" (α = 1) or
    "fixed" (given)."""

    alphas: tuple[float, ...]
    checkpoint_every: int
    binding: tuple[str, ...]
    alpha_bandwidth: tuple[float, ...]  # each tile's bandwidth bound alone (may lie outside [0, 1])
    host_bytes: float


def smallest_checkpoint_interval(shape: TileShape, host_budget: float,
                                 alphas: Optional[Sequence[float]] = None) -> int:
    """The smallest k with which ``alphas`` (α = 0 if ``None``) fit ``host_budget`` bytes.

    Raises:
        HostMemoryError: if none does, naming the host term that does not fit.
    """
    alphas = [0.0] * shape.tiles if alphas is None else list(alphas)
    for k in range(1, max(shape.layers, 1) + 1):
        if shape.host_bytes(alphas, k) <= host_budget:
            return k
    k = max(shape.layers, 1)
    inputs = shape.host_inputs(k) * shape.tiles * shape.sizes.input
    need = shape.host_bytes(alphas, k)
    raise HostMemoryError(
        f"out of host memory: tiles swap {need / 2**30:.2f} GiB per device with one checkpoint layer "
        f"({(need - inputs) / 2**30:.2f} GiB of attention outputs and swapped tokens, "
        f"{inputs / 2**30:.2f} GiB of layer inputs) but {host_budget / 2**30:.2f} GiB can be pinned; "
        "shorten seq, add devices, or set hardware.host_memory_gib")


def _check_fits(shape: TileShape, alphas: Sequence[float], k: int, host_budget: float) -> None:
    need = shape.host_bytes(alphas, k)
    if need > host_budget:
        raise HostMemoryError(
            f"out of host memory: tiles with alpha up to {max(alphas):g} and a checkpoint layer every {k} "
            f"swap {need / 2**30:.2f} GiB per device but {host_budget / 2**30:.2f} GiB can be pinned; "
            "lower alpha, raise the checkpoint interval, shorten seq, or set hardware.host_memory_gib")


def _cap(shape: TileShape, alphas: list[float], k: int, host_budget: float) -> float:
    """The largest β with every α_t lowered to at most β fitting the host (β ≥ max α_t: no cap)."""
    counts, other = shape.swapped_per_tile(), shape.sizes.other
    if shape.host_bytes(alphas, k) <= host_budget or other == 0:
        return math.inf
    base = shape.host_bytes([0.0] * shape.tiles, k)
    # host(β) = base + other·Σ_t n_t·min(α_t, β), piecewise linear and rising in β
    levels = sorted(set(alphas))
    below = 0.0  # Σ n_t·α_t over the tiles whose α_t lies under the current level
    for i, level in enumerate(levels):
        at_or_above = sum(n for n, a in zip(counts, alphas) if a >= level)
        floor = levels[i - 1] if i else 0.0
        top = base + other * (below + at_or_above * level)
        if top > host_budget:
            return floor + (host_budget - base - other * (below + at_or_above * floor)) / (other * at_or_above)
        below += sum(n * a for n, a in zip(counts, alphas) if a == level)
    return math.inf


def solve_tiles(shape: TileShape, tile_times_s: Sequence[float], bandwidth_bytes_per_s: float,
                host_budget: float, fixed: Optional[Sequence[float]] = None,
                checkpoint_every: Optional[int] = None) -> TileSolution:
    """α of each tile and k (see the module docstring), or ``fixed`` α (checked against the host,
    with the smallest k that fits); ``checkpoint_every`` fixes k instead of choosing it.

    Args:
        tile_times_s: forward seconds of each tile (``T_f(t)``, t = 0 .. T − 1).
        bandwidth_bytes_per_s: measured device-to-host copy bandwidth (B).
        host_budget: host bytes this device's swapped activations may take (M_host).

    Raises:
        HostMemoryError: if even α = 0 fits with no k.
    """
    if len(tile_times_s) != shape.tiles:
        raise ValueError(f"{len(tile_times_s)} tile times for {shape.tiles} tiles")
    sizes, T = shape.sizes, shape.tiles
    must = sizes.attention + sizes.input
    bounds = []
    for t in range(T):
        budget = bandwidth_bytes_per_s * tile_times_s[(t + 1) % T]
        room = budget - must
        bounds.append((math.inf if room >= 0 else -math.inf) if sizes.other == 0 else room / sizes.other)
    if fixed is not None:
        alphas = [float(a) for a in fixed]
        k = checkpoint_every or smallest_checkpoint_interval(shape, host_budget, alphas)
        _check_fits(shape, alphas, k, host_budget)
        return TileSolution(tuple(alphas), k, ("fixed",) * T, tuple(bounds), shape.host_bytes(alphas, k))
    k = checkpoint_every or smallest_checkpoint_interval(shape, host_budget)
    _check_fits(shape, [0.0] * T, k, host_budget)
    wanted = [min(1.0, max(b, 0.0)) for b in bounds]
    cap = _cap(shape, wanted, k, host_budget)
    alphas = [max(min(a, cap), 0.0) for a in wanted]
    binding = tuple("host" if a < w else ("none" if a >= 1.0 else "bandwidth") for a, w in zip(alphas, wanted))
    return TileSolution(tuple(alphas), k, binding, tuple(bounds), shape.host_bytes(alphas, k))
