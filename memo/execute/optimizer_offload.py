"""``train.optimizer_offload=host``: Adam's moments and the fp32 main weights in host memory,
Adam stepped on the CPU, through Megatron-core's own ``HybridDeviceOptimizer``.

How Megatron-core 0.16.1 builds it (``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``)
and what this module's byte model (:func:`offload_bytes`) therefore counts, per rank:

* It runs in the precision-aware mode of the distributed optimizer (Megatron's recipe for
  ``--optimizer-cpu-offload`` adds ``--use-precision-aware-optimizer``, which asserts the
  distributed optimizer): the optimizer then steps this rank's shards of the 16-bit weights and
  keeps no fp32 main copy of them on the device. Offloading turns the distributed optimizer on.
  Shards of fp32 weights are views still attached to autograd, which ``torch.optim`` refuses
  ("can't optimize a non-leaf Tensor"): offloading takes bf16 and fp16 weights only.
* Of those shards, in the optimizer's order, it takes the first ones while fewer than
  ``fraction`` of their elements are taken (counting only parameters that are ``is_cuda``), and
  copies each to the host: a page-locked copy in the weight's dtype, then (16-bit weights) an
  fp32 pageable copy of it, which is the main weight the CPU ``torch.optim.AdamW`` (fused) steps.
  The 16-bit page-locked copy is dropped at once; fp32 weights keep the page-locked copy itself
  as their main weight.
* At the first step AdamW allocates, per host tensor, its two fp32 moments (pageable: a tensor
  made ``zeros_like`` a page-locked one is not page-locked) and a 4-byte fp32 step counter, and
  the optimizer a page-locked fp32 buffer for the tensor's gradient (``pin_cpu_grads``).
  ``pin_cpu_params`` is not read: parameter copies are always page-locked.
* PyTorch's CUDA caching host allocator rounds every page-locked request up to a power of two
  (its default; ``pinned_max_round_threshold`` in ``PYTORCH_CUDA_ALLOC_CONF`` stops the rounding
  above a size) and keeps freed blocks page-locked for reuse.
* Megatron builds the hybrid optimizer twice: over the whole parameters, and again over the
  distributed optimizer's shards. The first, and the dropped 16-bit copies, hold host memory
  until Python's cycle collector frees them and the host allocator empties its cache;
  :func:`release_build_copies` does both, so that what stays is what :func:`offload_bytes` counts.

What Megatron overlaps (``overlap_cpu_optimizer_d2h_h2d``, on here): one CPU optimizer per
tensor; all gradient copies to the host are issued at once on a side stream, and each tensor's
Adam step waits only for its own copy, then sends its new weights back on another side stream.
So the copies of later tensors overlap the CPU steps of earlier ones, the copies back overlap
the CPU steps of later ones, and the device's share (``fraction`` < 1) steps on the GPU
meanwhile. What it does not overlap: the backward pass. The copies start inside
``optimizer.step()``, after the gradients' reduction and the global-norm clipping (which needs
every gradient), and the next forward waits on the stream of the copies back. Megatron's
other overlap with the backward pass, DDP's ``overlap_grad_reduce`` (the gradient
reduce-scatter per bucket), is a separate setting, not turned on here: it needs every
micro-batch but the last of a step run under ``no_sync``, which this training loop does not do.
"""

import gc
import warnings
from dataclasses import asdict, astuple, dataclass
from typing import Sequence

import torch
from megatron.core.optimizer import SGD, Adam, CPUAdam, CPUSGD, MegatronOptimizer, OptimizerConfig, \
    get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

# HybridDeviceOptimizer keeps the classes of its inner optimizers among its param groups' settings,
# so a checkpoint's common state names them; torch.load reads weights only unless allowed these.
STATE_CLASSES = (Adam, SGD, CPUAdam, CPUSGD)

FP32_BYTES = 4  # main weights, moments and gradients on the host are fp32
STEP_BYTES = 4  # the fused AdamW's step counter: an fp32 scalar per tensor


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes PyTorch's CUDA caching host allocator page-locks for a request of ``nbytes`` bytes:
    the next power of two (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def offloaded(numels: Sequence[int], fraction: float) -> list[bool]:
    """Which of a rank's parameter tensors (their element counts ``numels``, in the optimizer's
    order) ``HybridDeviceOptimizer`` puts on the host for ``offload_fraction=fraction``: each one
    while the elements taken so far are fewer than ``fraction`` of all (the last one taken may
    pass the share)."""
    threshold = sum(numels) * fraction  # a float, compared as Megatron compares it
    taken, chosen = 0, []
    for numel in numels:
        chosen.append(taken < threshold)
        if chosen[-1]:
            taken += numel
    return chosen


@dataclass(frozen=True)
class OffloadBytes:
    """One rank's optimizer offload, in bytes (elements for ``offloaded_params``). Host figures
    are what stays allocated from the first step on; page-locked ones as the host allocator
    allocates them (rounded up to powers of two)."""

    offloaded_params: int  # elements whose Adam states live on the host
    master_bytes: int  # fp32 main weights on the host (page-locked for fp32 weights)
    moment_bytes: int  # Adam's first and second moments, fp32, pageable
    step_bytes: int  # AdamW's step counters, one fp32 scalar per host tensor, pageable
    grad_bytes: int  # host copies of the gradients, fp32 (page-locked with pin_cpu_grads)
    pinned_bytes: int  # the page-locked part of the host bytes
    # Device memory the offload frees against Megatron's distributed optimizer: the moments and
    # (16-bit weights) the fp32 main weights of the host tensors; step counters aside.
    device_bytes_removed: int

    @property
    def host_bytes(self) -> int:
        """Every host byte the offload keeps."""
        return self.master_bytes + self.moment_bytes + self.step_bytes + self.grad_bytes

    @property
    def pageable_bytes(self) -> int:
        """The host bytes that are not page-locked."""
        return self.host_bytes - self.pinned_bytes

    def row(self) -> dict:
        """The figures as result-row columns (bytes; elements for ``offloaded_params``)."""
        return {**asdict(self), "host_bytes": self.host_bytes}

    def __add__(self, other: "OffloadBytes") -> "OffloadBytes":
        return OffloadBytes(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


NO_OFFLOAD = OffloadBytes(0, 0, 0, 0, 0, 0, 0)


def offload_bytes(numels: Sequence[int], param_bytes: int, fraction: float = 1.0,
                  pin_grads: bool = True) -> OffloadBytes:
    """Host bytes ``HybridDeviceOptimizer`` keeps for one rank, and device bytes it frees.

    Args:
        numels: element counts of the tensors the optimizer steps, in its order: this rank's
            shards of the parameters under the distributed optimizer (fp32 shards before 16-bit
            ones within each parameter group), all of them on the device.
        param_bytes: bytes per element of the weights (2 for bf16 and fp16, 4 for fp32).
        fraction: ``optimizer_offload_fraction``, in (0, 1].
        pin_grads: ``pin_cpu_grads``: the gradients' host copies are page-locked.

    Per host tensor of n elements: main weight 4·n pageable (16-bit weights) or
    ``pinned_block_bytes(4·n)`` (fp32 weights), moments 2·4·n, step 4, gradient
    ``pinned_block_bytes(4·n)`` (or 4·n unpinned); freed on the device 8·n, plus 4·n for
    16-bit weights.
    """
    offload = NO_OFFLOAD
    for numel, host in zip(numels, offloaded(numels, fraction), strict=True):
        if not host:
            continue
        fp32 = FP32_BYTES * numel
        fp32_weights = param_bytes == FP32_BYTES  # the page-locked copy is the main weight
        master = pinned_block_bytes(fp32) if fp32_weights else fp32
        grad = pinned_block_bytes(fp32) if pin_grads else fp32
        offload += OffloadBytes(
            offloaded_params=numel,
            master_bytes=master,
            moment_bytes=2 * fp32,
            step_bytes=STEP_BYTES,
            grad_bytes=grad,
            pinned_bytes=(master if fp32_weights else 0) + (grad if pin_grads else 0),
            # fp32 weights are their own main weights on the device too
            device_bytes_removed=2 * fp32 + (0 if fp32_weights else fp32),
        )
    return offload


def offload_config(fraction: float, **fields) -> OptimizerConfig:
    """Megatron's ``OptimizerConfig`` of ``fields`` (which must ask for Adam and the distributed
    optimizer) with Adam's states of ``fraction`` of the parameters offloaded to the host,
    page-locked gradient copies, and the copies overlapped with the CPU steps.

    The precision-aware mode is set after construction: ``OptimizerConfig.__post_init__`` asks
    Transformer Engine's version for it (and fails where Transformer Engine is not installed)
    only to decide ``store_param_remainders``, which is Transformer Engine's FusedAdam's and has
    no meaning for the host's fp32 main weights; it is off here. For offloading,
    ``__post_init__`` checks nothing else (Adam, the distributed optimizer: asserted here).
    """
    config = OptimizerConfig(
        **fields,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=True,
        pin_cpu_grads=True,
        pin_cpu_params=True,
        store_param_remainders=False,
    )
    if config.optimizer != "adam" or not config.use_distributed_optimizer:
        raise ValueError("optimizer offload needs optimizer='adam' and use_distributed_optimizer=True")
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return config


def build_offloaded(config: OptimizerConfig, model_chunks: list) -> MegatronOptimizer:
    """``get_megatron_optimizer(config, model_chunks)`` for an :func:`offload_config`, with what
    its building leaves behind on the host released (:func:`release_build_copies`)."""
    with warnings.catch_warnings():
        # Megatron compares torch.__version__ as text ("2.13" < "2.3"), and warns wrongly.
        warnings.filterwarnings("ignore", message="CPU offload is recommended for PyTorch >= 2.3.0")
        optimizer = get_megatron_optimizer(config, model_chunks)
    release_build_copies()
    return optimizer


def release_build_copies() -> None:
    """Free the host copies Megatron made while building the offloaded optimizer and no longer
    holds: the first ``HybridDeviceOptimizer`` (over whole parameters), kept alive by the
    reference cycle of its step hooks until the cycle collector runs, and the dropped 16-bit
    page-locked copies, which the host allocator keeps page-locked in its cache."""
    gc.collect()
    # torch.accelerator's host-cache call is recent; the CUDA one has been there since 2.5
    empty = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
    empty()


def optimizer_parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers a Megatron optimizer is made of: a ``ChainedOptimizer``'s, else itself."""
    return optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def hybrid_optimizers(optimizer: MegatronOptimizer) -> list[HybridDeviceOptimizer]:
    """The ``HybridDeviceOptimizer`` inside each of ``optimizer``'s distributed optimizers
    (a rank without trainable parameters has none)."""
    return [part.optimizer for part in optimizer_parts(optimizer) if isinstance(part.optimizer, HybridDeviceOptimizer)]


def settle_loaded_state(hybrid: HybridDeviceOptimizer, step: torch.Tensor) -> None:
    """Put a loaded ``hybrid``'s state where its stepping expects it, as its own steps leave it:
    each parameter's moments in storage of their own on that parameter's device (megatron-core
    moves the device sub-optimizer's to the host too, since without Transformer Engine both
    sub-optimizers are PyTorch's AdamW, and keeps views of the loaded whole tensors), its master
    weight the tensor its sub-optimizer steps, and a step of its own (``step``'s value) where a
    fused or capturable Adam keeps it (the parameter's device), else on the host."""
    for sub in hybrid.sub_optimizers:
        for group in sub.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                state = sub.state[param]  # (the same dict as the hybrid's state of its parameter)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].to(param.device, copy=True)
                state["master_param"] = param
                state["step"] = step.to(device=param.device if on_device else "cpu", dtype=torch.float32, copy=True)


def built_offload_bytes(optimizer: MegatronOptimizer, param_bytes: int) -> OffloadBytes:
    """:func:`offload_bytes` of a built offloaded ``optimizer`` (``param_bytes`` bytes per weight
    element): its tensors, fraction and gradient pinning as it holds them. Bytes."""
    total = NO_OFFLOAD
    for hybrid in hybrid_optimizers(optimizer):
        numels = [p.numel() for group in hybrid.param_groups for p in group["params"]]
        total += offload_bytes(numels, param_bytes, hybrid.offload_fraction, hybrid.pin_cpu_grads)
    return total
