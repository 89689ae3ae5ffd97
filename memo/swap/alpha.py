"""MEMO's swap ratio α: the largest fraction of tokens whose skeletal activations are swapped.

    maximize α  subject to
        (S_input + S_attn + α·S_other) / B  ≤  T_layer          (the swap hides behind compute)
        (n − 2)·(S_input + S_attn + α·S_other)  ≤  M_host        (the host holds every swapped layer)
        0 ≤ α ≤ 1

S_* are bytes of one layer's skeletal activations on one device: the layer input, what attention
produced (its output and log-sum-exp), and everything else. Only ``n − 2`` layers swap: the last
two start their backward pass right after their forward.
"""

import math
from dataclasses import dataclass
from typing import Optional


class HostMemoryError(RuntimeError):
    """Swapped activations cannot fit in the host memory available: status ``oohm``."""


@dataclass(frozen=True)
class SkeletalBytes:
    """Bytes of one transformer layer's skeletal activations on one device."""

    input: int
    attention: int
    other: int

    def swapped(self, alpha: float) -> float:
        """Bytes one layer sends to the host at swap ratio ``alpha``."""
        return self.input + self.attention + alpha * self.other


@dataclass(frozen=True)
class AlphaSolution:
    """α and why: ``binding`` is "bandwidth", "host", "none" (α reached 1) or "fixed" (given).

    The one value the runtime's report (:mod:`memo.swap.prepare`) and the fit's prediction
    (:mod:`memo.fit.memory`) both take from :func:`choose_alpha`.
    """

    alpha: float
    binding: str
    alpha_bandwidth: float  # the bandwidth constraint's bound alone (may lie outside [0, 1])
    alpha_host: float  # the host constraint's bound alone (math.inf when nothing swaps)


def _bound(budget: float, sizes: SkeletalBytes) -> float:
    """Largest α with ``sizes.swapped(α) ≤ budget`` (± inf when ``other`` is 0)."""
    room = budget - sizes.input - sizes.attention
    if sizes.other == 0:
        return math.inf if room >= 0 else -math.inf
    return room / sizes.other


def host_bound(sizes: SkeletalBytes, num_layers: int, host_budget: float) -> float:
    """The host constraint's bound on α (``math.inf`` if at most two layers, which never swap)."""
    swapped_layers = num_layers - 2
    if swapped_layers <= 0:
        return math.inf
    return _bound(host_budget / swapped_layers, sizes)


def check_host(sizes: SkeletalBytes, num_layers: int, host_budget: float, alpha: float) -> None:
    """Raise :class:`HostMemoryError` if ``alpha`` needs more than ``host_budget`` bytes."""
    if alpha > host_bound(sizes, num_layers, host_budget) + 1e-12:
        need = max(num_layers - 2, 0) * sizes.swapped(alpha)
        raise HostMemoryError(
            f"out of host memory: alpha={alpha:g} swaps {need / 2**30:.2f} GiB per device but "
            f"{host_budget / 2**30:.2f} GiB can be pinned; lower alpha, shorten seq, add devices, "
            "or set hardware.host_memory_gib"
        )


def solve_alpha(
    sizes: SkeletalBytes,
    num_layers: int,
    layer_time_s: float,
    bandwidth_bytes_per_s: float,
    host_budget: float,
) -> AlphaSolution:
    """Solve MEMO's α problem (see the module docstring).

    Args:
        sizes: one layer's skeletal bytes on this device.
        num_layers: transformer layers on this device (n).
        layer_time_s: measured forward time of one layer, seconds (T_layer).
        bandwidth_bytes_per_s: measured device-to-host copy bandwidth, bytes/s (B).
        host_budget: host bytes available to this device's swapped activations (M_host).

    Raises:
        HostMemoryError: if even α = 0 does not fit in ``host_budget``.
    """
    by_bandwidth = _bound(bandwidth_bytes_per_s * layer_time_s, sizes)
    by_host = host_bound(sizes, num_layers, host_budget)
    if by_host < 0:
        check_host(sizes, num_layers, host_budget, 0.0)
    alpha = min(1.0, by_bandwidth, by_host)
    if alpha >= 1.0:
        binding = "none"
    else:
        binding = "host" if by_host <= by_bandwidth else "bandwidth"
    return AlphaSolution(max(alpha, 0.0), binding, by_bandwidth, by_host)


def choose_alpha(
    sizes: SkeletalBytes,
    num_layers: int,
    layer_time_s: float,
    bandwidth_bytes_per_s: float,
    host_budget: float,
    fixed: Optional[float],
) -> AlphaSolution:
    """α as a run uses it: ``fixed`` (checked against the host, binding "fixed") or, when None,
    solved (:func:`solve_alpha`); both bounds are reported either way.

    Raises:
        HostMemoryError: if the swapped activations do not fit in ``host_budget``.
    """
    if fixed is None:
        return solve_alpha(sizes, num_layers, layer_time_s, bandwidth_bytes_per_s, host_budget)
    check_host(sizes, num_layers, host_budget, fixed)
    return AlphaSolution(fixed, "fixed", _bound(bandwidth_bytes_per_s * layer_time_s, sizes),
                         host_bound(sizes, num_layers, host_budget))
