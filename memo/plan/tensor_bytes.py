"""The CPU's counterpart of the GPU allocator's peak: the most bytes of tensor storage a training
step holds at once, model states included (the row's ``peak_tensor_bytes``).

A CPU run has no allocator statistics (its peak resident set counts the interpreter, the
libraries and the host side of swapped activations alike). The step the memory plan's runtime
records storage by storage (:class:`memo.plan.runtime.PlanRuntime`) is counted over what is
resident (:func:`step_peak`): the weights, their gradients (Megatron's gradient buffer), every
optimizer's states and fp32 main weights, and the device buffers of the layers' runtime (MEMO's
rounding and tile buffers). The host side of swapping is not counted: its slabs are made before
training (:func:`memo.swap.host_memory.host_memory`) and a swap copies into them in place, so a
step makes no storage there. This is what the fit predicts of a device (:mod:`memo.fit.memory`),
and what ``hardware.device_memory_gib`` bounds on a CPU.
"""

import gc
import itertools
import weakref
from typing import Callable, Optional, Sequence

import torch

from memo.profile.trace import Event


def _resident(module: torch.nn.Module, device_buffers: Sequence[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    tensors = list(device_buffers)
    for p in module.parameters():
        tensors += [p, p.grad, getattr(p, "main_grad", None)]
    for optimizer in (o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)):
        for group in optimizer.param_groups:
            tensors += list(group["params"])
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def resident_bytes(module: torch.nn.Module, device_buffers: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages that live from step to step: ``module``'s weights and gradients
    (``.grad`` and Megatron's ``.main_grad``), the states and parameters of every optimizer alive
    in this process (Adam's moments, fp32 main weights), and ``device_buffers``."""
    return sum(s.nbytes() for s in _resident(module, device_buffers).values())


def _resident_freed(watch: "weakref.ref[ResidentBytes]", size: int) -> None:
    alive = watch()
    if alive is not None and alive.events is not None:
        alive.events.append(Event("free", next(alive.ids), size, alive.phase()))


class ResidentBytes:
    """The resident storages (:func:`resident_bytes`) when a recorded step starts, and a ``free``
    event in ``events`` (ids below 0) for each the step lets go of until :meth:`stop`: a gradient
    set to None by the optimizer's ``zero_grad``, which the next backward makes again."""

    def __init__(self, module: torch.nn.Module, device_buffers: Sequence[torch.Tensor], events: list,
                 phase: Callable[[], str]):
        storages = _resident(module, device_buffers)
        self.bytes = sum(s.nbytes() for s in storages.values())
        self.events: Optional[list] = events
        self.ids = itertools.count(-1, -1)
        self.phase = phase
        # held weakly, as the recorder's finalizers hold it: a weight outlives the step
        for storage in storages.values():
            weakref.finalize(storage, _resident_freed, weakref.ref(self), storage.nbytes())

    def stop(self) -> None:
        self.events = None


def step_peak(events: Sequence[Event], resident: int) -> tuple[int, str]:
    """The peak of tensor bytes of a step recorded as ``events`` over the ``resident`` bytes it
    started with (bytes, and the phase of the instant). What the step makes and keeps (a first
    step's gradients and Adam's states, buffers made on first use) every later step holds from
    its start, so it counts as held throughout; what the step makes and frees counts while alive,
    and a resident storage it lets go of (a ``free`` with no ``malloc``) from then on. (A resident
    storage freed and made again, a gradient set to None, would count twice until its free:
    :class:`memo.execute.optimizer.HostOptimizer` zeroes gradients in place.)"""
    freed = {e.id for e in events if e.op == "free"}
    kept = sum(e.size for e in events if e.op == "malloc" and e.id not in freed)
    live = peak = 0
    phase = "step start"
    for event in events:
        if event.id not in freed:
            continue
        live += event.size if event.op == "malloc" else -event.size
        if live > peak:
            peak, phase = live, event.phase
    return resident + kept + peak, phase
