"""The rates the fit predicts time with, measured on this machine (``hardware=auto`` on a GPU).

The fit's time is FLOPs over rates: weight GEMMs at ``fit.gemm_efficiency`` of the peak, causal
attention's forward and backward at ``fit.attention_forward_efficiency`` and
``fit.attention_backward_efficiency``, copies between host and device at the hardware's
``host_link_bytes_per_s``. The table's figures stand for machines one does not have; on the machine
itself they are measured once (a few seconds), cached in :data:`RATES_CACHE` under a key of the
device, the software (PyTorch, CUDA, cuDNN), the dtype and the head size, and read back by every
later run with that key.
"""

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from memo.config import ConfigError, FitConfig, Run
from memo.hardware import Hardware
from memo.metrics import ATTENTION_BACKWARD_FLOPS
from memo.model import head_size, torch_dtype
from memo.model.attention import causal_attention, select_backend
from memo.results import read_cache, write_cache

log = logging.getLogger("memo")

RATES_CACHE = Path.home() / ".cache" / "memo" / "rates.json"
# Attention is measured at one length, a tile's (memo's tiles run its kernels at about this size),
# with the query heads of a 7-8B model.
ATTENTION_TOKENS = 16384
ATTENTION_HEADS = 32
GEMM_SIZE = 8192  # square bf16 GEMMs at this size reach the sustained rate of a Hopper part
HOST_COPY_BYTES = 1 << 30


def mean_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Mean wall seconds of ``fn()`` over ``repeat`` runs after one warm-up, the device synchronized."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, repeat: int) -> float:
    """FLOP/s of an ``n``×``n`` by ``n``×``n`` matrix multiply."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / mean_seconds(lambda: a @ b, device, repeat)


def attention_flops(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int,
                    backend: str, repeat: int) -> tuple[float, float]:
    """Causal attention FLOP/s of the forward pass and of forward plus backward, the backward
    counted as 2.5 forwards (FlashAttention recomputes the scores)."""
    q, k, v = (torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    forward_flops = 2 * seq * seq * heads * head_dim  # QKᵀ and PV, causal half of 2·2·s²·h
    forward = mean_seconds(lambda: causal_attention(q, k, v, backend), device, repeat)
    # (gradients returned, not accumulated into q, k, v: the backward alone, as a step runs it)
    both = mean_seconds(lambda: torch.autograd.grad(causal_attention(q, k, v, backend).sum(), (q, k, v)), device,
                        repeat)
    return forward_flops / forward, (1 + ATTENTION_BACKWARD_FLOPS) * forward_flops / both


def host_bandwidth(device: torch.device, nbytes: int, repeat: int) -> tuple[float, float]:
    """H2D and D2H bytes/s between registered (page-locked) host memory and the device."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    status = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))
    if status != 0:
        cudart.cudaGetLastError()  # (cleared, or the next kernel launch would report it)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {status})")
    try:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h2d = nbytes / mean_seconds(lambda: dev.copy_(host, non_blocking=True), device, repeat)
        d2h = nbytes / mean_seconds(lambda: host.copy_(dev, non_blocking=True), device, repeat)
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())
    return h2d, d2h


def backward_flops(forward: float, both: float) -> float:
    """The attention backward's own FLOP/s from the forward's and forward plus backward's (as
    :func:`attention_flops` counts them): its FLOPs over the seconds it adds to the forward's."""
    return ATTENTION_BACKWARD_FLOPS / ((1 + ATTENTION_BACKWARD_FLOPS) / both - 1 / forward)


@dataclass(frozen=True)
class Rates:
    """What this machine's kernels reach: FLOP/s per device, bytes/s each way (None on a CPU, whose
    tensors are host memory)."""

    gemm_flops: float
    attention_forward_flops: float
    attention_backward_flops: float  # the backward alone, counted as 2.5 forwards
    h2d_bytes_per_s: Optional[float]
    d2h_bytes_per_s: Optional[float]

    def row(self, key: str, prefix: str = "rates.") -> dict:
        """The result-row columns of these rates: ``rates.*`` where the fit predicted the run with
        them, :data:`KERNEL_RATES` where they measure its kernels only (its MFU ceiling)."""
        return {f"{prefix}key": key, **{f"{prefix}{k}": v for k, v in dataclasses.asdict(self).items()}}


# the row's section of the rates its MFU ceiling was taken at, where the fit did not use them
KERNEL_RATES = "kernel_rates."


def measure(device: torch.device, dtype: torch.dtype, head_dim: int, small: bool = False) -> Rates:
    """Measure :class:`Rates` on ``device`` (``small``: sizes a CPU does in about a second)."""
    n, seq, heads, repeat = (256, 512, 2, 2) if small else (GEMM_SIZE, ATTENTION_TOKENS, ATTENTION_HEADS, 10)
    h2d = d2h = None
    try:
        gemm = gemm_flops(device, dtype, n, repeat)
        backend = select_backend(device.type, dtype, head_dim)
        forward, both = attention_flops(device, dtype, seq, heads, head_dim, backend, repeat)
        if device.type == "cuda":
            h2d, d2h = host_bandwidth(device, HOST_COPY_BYTES, repeat)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (about 2.5 GiB at most) back before the run's choice reads the free memory
    rates = Rates(gemm, forward, backward_flops(forward, both), h2d, d2h)
    if not all(0 < r < float("inf") for r in (rates.gemm_flops, rates.attention_forward_flops,
                                               rates.attention_backward_flops)):
        raise RuntimeError(f"the timings are inconsistent (another process loads the device?): {rates}")
    return rates


def rates_key(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What the rates depend on: the device, the software that runs its kernels, the attention
    kernel chosen, dtype, head size."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        software = f"torch={torch.__version__}|cuda={torch.version.cuda}|cudnn={torch.backends.cudnn.version()}"
    else:
        name = "cpu"
        software = f"torch={torch.__version__}|threads={torch.get_num_threads()}"
    kernel = select_backend(device.type, dtype, head_dim)
    return f"{name}|{software}|{kernel}|{str(dtype).removeprefix('torch.')}|head_dim={head_dim}"


def cached_rates(device: torch.device, dtype: torch.dtype, head_dim: int, cache: Path = RATES_CACHE,
                 measure_rates: Optional[Callable[[], Rates]] = None) -> tuple[Rates, str, bool]:
    """This machine's :class:`Rates` under :func:`rates_key`: read from ``cache``, or measured (by
    ``measure_rates``, default :func:`measure`) and recorded there (atomically; an unreadable or
    malformed cache is measured over). Returns the rates, their key and whether they were measured now."""
    key = rates_key(device, dtype, head_dim)
    recorded = read_cache(cache)
    try:
        return Rates(**recorded[key]), key, False
    except (KeyError, TypeError):  # not there, or not rates: measured (again)
        pass
    rates = (measure_rates or (lambda: measure(device, dtype, head_dim)))()
    write_cache(cache, recorded | {key: dataclasses.asdict(rates)})
    return rates, key, True


def with_rates(fit: FitConfig, hw: Hardware, rates: Rates) -> tuple[FitConfig, Hardware]:
    """``fit``'s efficiencies and ``hw``'s host link as ``rates`` measured them: each rate over the
    device's peak, the slower copy direction (swapping moves the same bytes out and back).

    Raises:
        ConfigError: where ``hw`` has no peak to take the rates as shares of.
    """
    if not hw.peak_flops:
        raise ConfigError(f"hardware={hw.name} has no peak FLOP/s to measure rates against; set hardware.peak_flops")
    fit = dataclasses.replace(fit, gemm_efficiency=rates.gemm_flops / hw.peak_flops,
                              attention_forward_efficiency=rates.attention_forward_flops / hw.peak_flops,
                              attention_backward_efficiency=rates.attention_backward_flops / hw.peak_flops)
    if rates.h2d_bytes_per_s is not None:
        hw = dataclasses.replace(hw, host_link_bytes_per_s=min(rates.h2d_bytes_per_s, rates.d2h_bytes_per_s))
    return fit, hw


def _of_the_run(run: Run, cache: Path) -> tuple[Rates, str, bool]:
    """:func:`cached_rates` of the current GPU at the model's head size and the run's dtype."""
    model = run.workload.model
    device = torch.device("cuda", torch.cuda.current_device())
    return cached_rates(device, torch_dtype(run.workload), head_size(model), cache)


def row_of_this_device(run: Run, cache: Path = RATES_CACHE) -> dict:
    """The :data:`KERNEL_RATES` columns of the current GPU (:func:`cached_rates` at the model's
    head size and the run's dtype), whatever hardware the run names: what the row's MFU ceiling is
    taken at (:func:`memo.metrics.flops.mfu_ceiling`), not what its fit was predicted with (a
    row's ``rates.*``, which its calibration predicts it again at). None on the CPU, or where the
    measurement fails (one warning). Raises nothing."""
    if run.device_type != "cuda":
        return {}
    try:
        rates, key, fresh = _of_the_run(run, cache)
    except Exception as failed:
        log.warning("the rates of this device were not measured (%s): the row has no MFU ceiling", failed)
        return {}
    return rates.row(key, KERNEL_RATES) | {f"{KERNEL_RATES}measured_now": fresh}


def of_this_device(run: Run, hw: Hardware, cache: Path = RATES_CACHE) -> tuple[Run, Hardware, dict]:
    """``run``'s fit and ``hw`` with the rates of the current GPU (:func:`cached_rates` at the
    model's head size and the run's dtype), and the row's ``rates.*`` columns, where
    ``hardware=auto`` on a GPU and ``fit.measured_rates``; else, or where the measurement fails
    (one warning), as they are, with no columns. Raises nothing: a choosing rank must reach the
    process group."""
    if run.hardware.name != "auto" or run.device_type != "cuda" or not run.fit.measured_rates:
        return run, hw, {}
    try:
        rates, key, fresh = _of_the_run(run, cache)
        fit, hw = with_rates(run.fit, hw, rates)
    except Exception as failed:
        log.warning("the rates of this device were not measured (%s): the fit takes fit.*_efficiency "
                    "and the table's host link", failed)
        return run, hw, {}
    log.info("rates of this device (%s, %s): GEMM %.0f TFLOP/s, attention %.0f forward / %.0f backward TFLOP/s, "
             "host copies %.1f GB/s", key, "measured now" if fresh else f"from {cache}", rates.gemm_flops / 1e12,
             rates.attention_forward_flops / 1e12, rates.attention_backward_flops / 1e12,
             hw.host_link_bytes_per_s / 1e9)
    return dataclasses.replace(run, fit=fit), hw, rates.row(key) | {"rates.measured_now": fresh}
