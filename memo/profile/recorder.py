"""Record allocation requests and phases of a model running in this process.

:class:`AllocationRecorder` is a ``TorchDispatchMode``: every operator output whose storage it
has not seen is a new request of the storage's size, and the storage's finalizer records its
release. A storage is freed when its last user lets go (a view, an autograd saved tensor, the
engine), which is exactly when an allocator would see the free. The same mode records real CPU
tensors and fake tensors (``FakeTensorMode``, any size, nothing allocated): storage sizes and
lifetimes do not depend on the data.

:class:`PhaseMarker` names the phase every event belongs to, from module hooks in the forward
pass and from gradient hooks in the backward pass: when the gradient of a block's output is
ready, that block's backward begins.
"""

import weakref
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memo.profile.trace import EMBEDDING_LOOKUP, Event, layer_phase


def _tensors(tree) -> list:
    """The tensors in an operator's arguments or results (tensors, lists, tuples and dicts of
    them, and other values): what ``tree_flatten`` finds there, at a fraction of its cost, which
    a trace pays for every operator."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _released(recorder: "weakref.ref[AllocationRecorder]", key: int, request: int, size: int) -> None:
    alive = recorder()
    if alive is not None:
        alive._free(key, request, size)


class AllocationRecorder(TorchDispatchMode):
    """Appends an :class:`Event` to ``events`` for every storage created or freed while active.

    ``phase`` is read at each event. Storages created before the mode was entered (weights,
    optimizer states) are not requests, nor are their views and in-place updates; a release
    seen after :meth:`stop` is not recorded.
    """

    def __init__(self, phase: Callable[[], str]):
        super().__init__()
        self.events: list[Event] = []
        self._phase = phase
        self._live: dict[int, int] = {}  # id(storage object) -> request id
        self._next_id = 0
        self._recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._recording:
            # Most outputs live on a storage already seen (views, in-place ops on what the
            # recording made): only the others are looked for among the inputs' storages.
            unseen = [s for s in (t.untyped_storage() for t in _tensors(out)) if id(s) not in self._live]
            if unseen:
                # An output on an input's storage (an in-place op, a view such as a weight's
                # transpose) is no new request, even when that storage predates the recording. A
                # lifted constant (torch.tensor(...) in the model's code) is: it was just made.
                inputs = set() if func is torch.ops.aten.lift_fresh.default else {
                    id(t.untyped_storage()) for t in _tensors((args, kwargs))}
                for storage in unseen:
                    if id(storage) not in inputs:
                        self._see(storage)
        return out

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live:
            return
        request = self._next_id
        self._next_id += 1
        self._live[key] = request
        size = storage.nbytes()
        self.events.append(Event("malloc", request, size, self._phase()))
        # The storage's Python object lives as long as the storage itself, so this runs at the
        # moment the memory would go back to the allocator. The finalizer holds the recorder
        # weakly: the registry of finalizers is a root, and a storage that outlives the recording
        # (a weight's gradient, an optimizer's state) would otherwise keep the recorder, its phase
        # callback and through it the model, its optimizer and its process groups for good.
        weakref.finalize(storage, _released, weakref.ref(self), key, request, size)

    def _free(self, key: int, request: int, size: int) -> None:
        if self._live.get(key) == request:
            del self._live[key]
        if self._recording:
            self.events.append(Event("free", request, size, self._phase()))

    def stop(self) -> None:
        """End recording; requests still live stay unfreed in :attr:`events`."""
        self._recording = False

    def request_of(self, tensor: torch.Tensor) -> Optional[int]:
        """The request whose storage ``tensor`` lives in, if it was made while recording and is
        still alive."""
        return self._live.get(id(tensor.untyped_storage()))


class PhaseMarker:
    """Tracks the phase of one GPT iteration through hooks on a Megatron ``GPTModel``.

    Forward hooks set ``embedding.fwd`` (``embedding.fwd.lookup`` within the word embedding's
    lookup), ``layer.<i>.fwd``, ``head.fwd`` and ``loss.fwd``, and put
    a gradient hook on each block's output that sets the block's backward phase. Once
    :meth:`backward` was called, forward hooks (recomputation in the backward pass) no longer
    change the phase. ``on_change`` is called with every new phase.
    """

    def __init__(self, gpt: torch.nn.Module, on_change: Optional[Callable[[str], None]] = None):
        self.phase = "setup"
        self._on_change = on_change
        self._in_backward = False
        self._handles = []
        self._hook_block(gpt.embedding, "embedding.fwd", "embedding.bwd")
        # the word embedding's lookup, in a phase of its own: the tiled one (memo.model.embedding)
        # makes and frees each tile's rows there, which a template sizes at one tile
        lookup = gpt.embedding.word_embeddings
        self._handles += [lookup.register_forward_pre_hook(lambda *_: self._forward(EMBEDDING_LOOKUP)),
                          lookup.register_forward_hook(lambda *_: self._forward("embedding.fwd"))]
        for layer in gpt.decoder.layers:
            number = layer.layer_number - 1  # Megatron counts layers from 1
            self._hook_block(layer, layer_phase(number, "fwd"), layer_phase(number, "bwd"))
        head_start = gpt.decoder.final_layernorm or gpt.output_layer
        self._handles.append(head_start.register_forward_pre_hook(lambda *_: self._forward("head.fwd")))
        self._hook_block(gpt.output_layer, None, "head.bwd", after="loss.fwd")
        tiled = getattr(gpt, "tiled_loss", None)  # memo.model.loss: output layer and loss in one
        if tiled is not None:
            self._handles.append(tiled.register_forward_pre_hook(self._tiled_loss_started))

    def _tiled_loss_started(self, _module, inputs) -> None:
        self._forward("loss.fwd")
        hidden = inputs[0]
        if hidden.requires_grad:  # its gradient is ready once the loss's backward is done
            hidden.register_hook(self._head_backward)

    def _head_backward(self, _grad) -> None:
        # unless the loss's input is the last layer's output (the final norm inside the loss's
        # tiles), whose hook, registered first, has named that layer's backward already
        if self.phase == "loss.bwd":
            self._set("head.bwd")

    def _hook_block(self, module, forward: Optional[str], backward: str, after: Optional[str] = None):
        if forward is not None:
            self._handles.append(module.register_forward_pre_hook(lambda *_: self._forward(forward)))

        def on_output(_module, _inputs, output):
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._set(backward))
                    break  # the first output is the block's activations
            if after is not None:
                self._forward(after)

        self._handles.append(module.register_forward_hook(on_output))

    def _forward(self, phase: str) -> None:
        if not self._in_backward:
            self._set(phase)

    def _set(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            if self._on_change is not None:
                self._on_change(phase)

    def enter_layer(self, layer: int, part: str) -> None:
        """Name the phase from here on ``layer.<layer>.<part>``, forward or backward: a part of a
        layer's pass (a layer walked in tiles names each tile's,
        :class:`memo.swap.tiled_layer.TiledLayers`)."""
        self._set(layer_phase(layer, part))

    def backward(self) -> None:
        """Call right before ``loss.backward()``."""
        self._in_backward = True
        self._set("loss.bwd")

    def optimizer(self) -> None:
        """Call right before the optimizer step."""
        self._set("optimizer")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def record(gpt: torch.nn.Module, step: Callable[[PhaseMarker], None]) -> AllocationRecorder:
    """Run ``step(marker)`` on Megatron ``GPTModel`` ``gpt`` with every allocation recorded and
    phased; returns the stopped recorder (its ``events``, and :meth:`AllocationRecorder.request_of`
    for what is still alive)."""
    marker = PhaseMarker(gpt)
    recorder = AllocationRecorder(lambda: marker.phase)
    try:
        with recorder:
            step(marker)
    finally:
        recorder.stop()
        marker.remove()
    return recorder
