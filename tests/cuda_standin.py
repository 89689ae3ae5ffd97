"""A stand-in for CUDA on a machine without it, so that Megatron-core's GPU-only code
(DistributedDataParallel's buffers, the distributed optimizer, ``HybridDeviceOptimizer``) runs
unchanged on the CPU with a gloo group, and a test can ask where each tensor would live.

Inside :func:`cuda_stand_in` every tensor stays in host memory, but:

* "device" tensors are those made for a CUDA device (a factory's ``device="cuda"`` or device
  index, ``.cuda()``, ``.to("cuda")``) and every new tensor an operation makes from one; they
  answer ``is_cuda`` True and ``type()`` ``"torch.cuda.<T>"``, and ``.cpu()`` / ``.to("cpu")``
  copy them out, as on a GPU. ``device`` still says where the bytes are (the CPU), so that
  PyTorch's kernels run;
* page-locked tensors are the copies ``.pin_memory()`` and ``pin_memory=True`` make; they answer
  ``is_pinned()`` True, and :meth:`CudaStandIn.host_block_bytes` gives the block PyTorch's CUDA
  caching host allocator would page-lock for them (the request rounded up to a power of two);
* streams and events do nothing: every operation has finished when it returns.
"""

import contextlib
import weakref
from typing import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

# Factories: where their result lives is their ``device`` argument (the host when absent).
_FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.rand, torch.randn,
    torch.randint, torch.empty_strided, torch.as_tensor,
})
# ... and these, without a ``device`` argument, make it where their input is.
_LIKE = frozenset({
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
})


def _names_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return torch.device(device).type == "cuda"


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _storage(tensor: torch.Tensor):
    """``tensor``'s storage, or ``None`` for a wrapper without one of its own (torch.distributed's
    ``ShardedTensor``, which a checkpoint's save and load make around tensors that have one)."""
    try:
        return tensor.untyped_storage()
    except RuntimeError:
        return None


class CudaStandIn(TorchFunctionMode):
    """The torch-function mode of :func:`cuda_stand_in`; it tracks storages, so views and
    ``param.data = ...`` swaps keep the place of the memory they use."""

    def __init__(self):
        super().__init__()
        self._device = weakref.WeakSet()
        self._pinned = weakref.WeakSet()

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory stands for GPU memory."""
        storage = _storage(tensor)
        return storage is not None and storage in self._device

    def pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory stands for page-locked host memory."""
        return tensor.untyped_storage() in self._pinned

    def host_block_bytes(self, tensor: torch.Tensor) -> int:
        """Host bytes ``tensor``'s storage takes: its size, or for page-locked memory the block
        PyTorch's CUDA caching host allocator hands out for it (a power of two)."""
        nbytes = tensor.untyped_storage().nbytes()
        if not self.pinned(tensor) or nbytes == 0:
            return nbytes
        block = 1
        while block < nbytes:
            block *= 2
        return block

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self._device.add(tensor.untyped_storage())
        return tensor

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self._pinned.add(tensor.untyped_storage())
        return tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.is_cuda.__get__:
            return self.on_device(args[0])
        if func == torch.Tensor.device.__get__ and self.on_device(args[0]):
            return torch.device("cuda", 0)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(args[0])
            return name.replace("torch.", "torch.cuda.", 1) if self.on_device(args[0]) else name
        if func is torch.Tensor.is_pinned:
            return self.pinned(args[0])
        if func is torch.Tensor.pin_memory:
            return self._pin(args[0].clone())
        if func is torch.Tensor.cuda:
            return args[0] if self.on_device(args[0]) else self._to_device(args[0].clone())
        if func is torch.Tensor.cpu:
            return args[0].clone() if self.on_device(args[0]) else args[0]
        if func is torch.Tensor.to:
            return self._move(func, args, kwargs)
        if func in _FACTORIES or func in _LIKE:
            pin = kwargs.pop("pin_memory", False)
            out = self._make(func, args, kwargs)
            return self._pin(out) if pin else out
        return self._where_inputs_are(func(*args, **kwargs), [*_tensors(args), *_tensors(kwargs)])

    def _make(self, func, args, kwargs) -> torch.Tensor:
        """A factory's result, on the device its ``device`` names (a ``*_like``'s without one:
        its input's)."""
        if "device" not in kwargs and func in _LIKE:
            return self._where_inputs_are(func(*args, **kwargs), [*_tensors(args)])
        on_device = kwargs.get("device") is not None and _names_cuda(kwargs["device"])
        if on_device:
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        return self._to_device(out) if on_device else out

    def _where_inputs_are(self, out, inputs: list[torch.Tensor]):
        """``out``, an operation's result: each new storage in it is on the device if an input is."""
        if any(self.on_device(t) for t in inputs):
            seen = {id(_storage(t)) for t in inputs}
            for tensor in _tensors(out):
                if (storage := _storage(tensor)) is not None and id(storage) not in seen:
                    self._to_device(tensor)
        return out

    def _move(self, func, args, kwargs):
        """``Tensor.to``: the conversion runs on the host; a move between host and device is a copy."""
        tensor, rest = args[0], []
        target = kwargs.pop("device", None)
        for arg in args[1:]:
            if isinstance(arg, torch.Tensor):
                target = "cuda" if self.on_device(arg) else "cpu"
                rest.append(arg.dtype)
            elif isinstance(arg, (str, int, torch.device)) and not isinstance(arg, bool):
                target = arg
            else:
                rest.append(arg)
        out = func(tensor, *rest, **kwargs) if rest or kwargs else tensor
        on_device = self.on_device(tensor) if target is None else _names_cuda(target)
        if on_device == self.on_device(tensor):
            return self._where_inputs_are(out, [tensor])
        if out.untyped_storage() is tensor.untyped_storage():
            out = out.clone()
        return self._to_device(out) if on_device else out


class _Event:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return _Event()


@contextlib.contextmanager
def cuda_stand_in() -> Iterator[CudaStandIn]:
    """CUDA stood in for by the host (see the module's docstring) until the block ends; the
    ``torch.cuda`` functions Megatron calls answer for device 0, whose work is always done."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: 0)
        patch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
        patch.setattr(torch.cuda, "Stream", _Stream)
        patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        # the host allocator's cache: nothing is cached here
        patch.setattr(torch.accelerator, "empty_host_cache", lambda: None)
        with CudaStandIn() as mode:
            yield mode
