"""Host memory for swapped activations: slabs on whole pages of their own, page-locked in place
at their exact size (the pinned allocator would round a request up to a power of two)."""

import torch

from memo.swap.alpha import HostMemoryError


PAGE = 4096  # bytes


def host_memory(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``numel`` elements of host memory; to be page-locked (``pin``), on whole pages of their
    own: two registrations must never share a page (CUDA refuses the second), which two small
    allocations from the C heap may."""
    if not pin:
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start:start + nbytes].view(dtype)


def register(slab: torch.Tensor) -> None:
    """Page-lock ``slab`` in place: one registration of its exact size in bytes, where the pinned
    allocator would round a request up to a power of two. (A slab registered in part makes a
    copy that spans both parts fail with CUDA's "invalid argument".)"""
    nbytes = slab.numel() * slab.element_size()
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(slab.data_ptr(), nbytes, 0)
    if int(error) != 0:
        if hasattr(cudart, "cudaGetLastError"):  # not bound by every PyTorch build
            cudart.cudaGetLastError()  # the failure must not surface at the next CUDA call
        raise HostMemoryError(
            f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (error {int(error)}): "
            "raise the locked-memory limit (ulimit -l) or lower hardware.host_memory_gib"
        )


def unregister(slab: torch.Tensor) -> None:
    """Undo :func:`register`: the memory can then be registered again, or freed."""
    torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
