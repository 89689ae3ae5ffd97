"""One iteration's allocation requests for any sequence length and number of layers, from two
small fake-tensor traces.

A layout search predicts thousands of iterations (every layout, a binary search over lengths);
tracing each would take seconds. Two facts make them cheap and exact:

* Every request's size is affine in the tokens a rank holds (attention keeps no s×s tensor), and
  the order of requests does not depend on it: two traces at two lengths give every size as
  ``base + slope·tokens``. The structure of the two traces is compared, so a model for which this
  fails is refused rather than mispredicted.
* All transformer layers allocate alike (:mod:`memo.profile.layers`): a trace of five layers has
  the first two and the last two layers as the real model has them, and its layer 2 stands for
  every layer in between. Each of those ``n − 5`` extra layers holds, from its forward to its
  backward, the requests layer 2 makes in its forward and frees only in a backward phase; they are
  added as live over exactly that span of layer 2 (in phases ``inner_layers.fwd`` and
  ``inner_layers.bwd`` of their own), which gives the same peak of live bytes as the ``n``-layer
  iteration.

* The tiled loss (``train.loss=tiled``) runs its tiles one after another and frees each tile's
  requests before the next: the template traces one tile as long as the sequence, and a
  request made and freed inside one loss phase is sized at one tile of the predicted run. One
  such request is as long as the sequence, the fp32 gradient of the per-token loss: it is
  counted at one tile too, 4 bytes a token short (4 MiB at 1M tokens; tested). The tiled
  embedding's lookup (under sequence parallelism) and backward pass run in tiles of their own the
  same way: a request made and freed inside ``embedding.fwd.lookup`` or ``embedding.bwd`` is
  sized at one of those.

* Layers walked in sequence tiles (``method.tile_tokens``) are traced as three tiles a layer, at
  two tile sizes: a request is sized by the sequence (the stores of keys, values and their
  gradients, the input store, the layers' outputs and their gradients), or by the tile (what a tile
  phase, a rebuild or a chain makes, and the swap runtime's tile buffers). Tiles after the first
  repeat the second's requests, their attention one block more each, made and freed within the
  tile; and no layer keeps a request on the device from its forward to its backward (its kept
  tensors are in the tile buffers and on the host), so three layers stand for any number. The
  iteration of three layers of three tiles, every request sized at the run's length or tile, has
  the peak of live bytes of the iteration of any number of layers and tiles (tested against
  direct traces; the trace is at α = 0 and k = 1, its recomputation the most a tile makes).

Gradients are left out: Megatron keeps them in one buffer allocated before training, which
:mod:`memo.fit.memory` counts with the model states. Other requests alive at the end of the traced
iteration (Megatron's persistent sequence-parallel all-gather buffer, RoPE's angles and cos/sin
table) persist from one iteration to the next and are counted from where the trace makes them.
"""

import dataclasses
import functools
import itertools
import re
from typing import Optional

import torch

from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, Workload
from memo.model.gpt import padded_vocab_size
from memo.model.tiles import auto_tile_tokens, eighth_tile_tokens
from memo.profile.affine import Affine
from memo.profile.iteration import Traced, trace_iteration
from memo.profile.trace import EMBEDDING_LOOKUP, Event, Trace, forward_block_phase, layer_phase
from memo.swap.alpha import SkeletalBytes

TEMPLATE_LAYERS = 5
# A walk in tiles keeps no layer's tensors on the device once its tiles are done (they are in the
# tile buffers and on the host), so three layers stand for any number: the first, one between
# (the middle), the last (whose last tiles stay in the buffers).
TILED_TEMPLATE_LAYERS = 3
# The phases of the extra layers' requests, apart from the middle layer's own, so that every
# traced layer still allocates alike (the planner checks it).
INNER_LAYERS = "inner_layers"
_TRACED_TOKENS = (2048, 4096)  # per sequence-parallel chunk
TRACED_TILES = 3  # tiles a layer of a walk in tiles is traced with: the first, one between, the last
# The smallest tile traced, per sequence-parallel chunk: the norms and the embedding's backward
# work in eighths of at least 64 tokens, so from 512 tokens on a tile twice as long makes as many
# requests, each twice as long.
MIN_TRACED_TILE = 512
# phases of a walk in tiles whose requests are sized by the tile: a tile's forward or backward and
# their attention blocks, a layer's rebuild of its keys and values, a chain (tile by tile)
_TILE_PHASE = re.compile(r"\.t\d+(\.d?b\d+)?$|\.(rebuild|chain)$")


def _affine(events_a: list[Event], events_b: list[Event], tokens: tuple[int, int]) -> list[Affine]:
    if len(events_a) != len(events_b) or any(
        (a.op, a.id, a.phase) != (b.op, b.id, b.phase) for a, b in zip(events_a, events_b)
    ):
        raise ConfigError(
            "the traced iteration allocates in a different order at different lengths, "
            "so it cannot be scaled; use mode=plan at the length you need"
        )
    return [Affine.through(a.size, b.size, tokens) for a, b in zip(events_a, events_b)]


def _of_layer(phase: str, layer: int, direction: str) -> bool:
    """Whether ``phase`` is part of ``layer``'s forward (``direction`` "fwd": the layer's own and
    its tiles') or backward pass ("bwd": also its rebuild and its chain)."""
    own = layer_phase(layer, direction)
    parts = (own, f"layer.{layer}.rebuild", f"layer.{layer}.chain") if direction == "bwd" else (own,)
    return phase in parts or phase.startswith(own + ".")


class IterationTemplate:
    """The requests of one iteration of rank 0, as functions of its tokens and layer count.

    Built by :func:`iteration_template`; ``tokens`` are the tokens of one sequence on one
    context-parallel rank (``seq / cp``), all tensor-parallel ranks together.
    """

    def __init__(self, small: Trace, large: Trace, tokens: tuple[int, int], layers: int):
        self.layers = layers  # layers traced: TEMPLATE_LAYERS (tiled: 3), or the model's own if fewer
        self._tokens = tokens
        self.tiled = small.meta["tile_tokens"] is not None
        self.full = TILED_TEMPLATE_LAYERS if self.tiled else TEMPLATE_LAYERS
        self.middle = self.full // 2  # the template layer that stands for every inner layer
        self.meta = small.meta
        self.events = small.events
        self.sizes = _affine(small.events, large.events, tokens)
        requests = small.requests()
        # The tiled loss's and the tiled embedding's per-tile requests: made and freed inside one
        # loss phase, inside the embedding's backward or (under sequence parallelism, which it
        # reduce-scatters tile by tile) inside its lookup: request -> whose tile
        parallel = small.meta["parallel"]
        tiled_phases = ("embedding.bwd", EMBEDDING_LOOKUP) if parallel["sequence_parallel"] and parallel["tp"] > 1 \
            else ("embedding.bwd",)
        self.per_tile = {
            r.id: "loss" if r.malloc_phase.startswith("loss.") else "embedding" for r in requests
            if small.meta.get("loss") == "tiled" and r.free_phase == r.malloc_phase
            and (r.malloc_phase.startswith("loss.") or r.malloc_phase in tiled_phases)
        }
        # Gradients live in buffers made before training (counted with the model states); the
        # other requests alive at the end persist between iterations and are counted here.
        self.gradients = set(small.meta["gradient_requests"])
        # Kept for a layer's backward: made in a forward phase, freed in that layer's backward.
        self.kept = {
            layer: {
                r.id
                for r in requests
                if r.free_phase == layer_phase(layer, "bwd") and forward_block_phase(r.malloc_phase)
            }
            for layer in range(layers)
        }
        # What each extra layer holds from its forward to its backward: the middle layer's
        # requests made in its forward that live on into a backward phase.
        # (Empty tensors, such as the ends of the tiles' kept graphs, hold nothing.)
        self._size_of = {e.id: s for e, s in zip(self.events, self.sizes) if e.op == "malloc"}
        self.carried = (
            [
                r.id
                for r in requests
                if _of_layer(r.malloc_phase, self.middle, "fwd") and r.free_phase is not None
                and ".bwd" in r.free_phase and (self.sizes_of(r.id) != (0, 0))
            ]
            if layers == self.full
            else []
        )
        self._made_in = {r.id: r.malloc_phase for r in requests}
        # A walk in tiles: the requests sized by the tile rather than by the sequence, and one
        # tile's skeletal bytes (the swap runtime's), both traced at TRACED_TILES tiles a layer.
        self.tile_sized = set(small.meta.get("tile_buffer_requests") or ()) | {
            r.id for r in requests if _TILE_PHASE.search(r.malloc_phase)} if self.tiled else set()
        skeletal = [small.meta.get("tile_skeletal_bytes"), large.meta.get("tile_skeletal_bytes")]
        self._tile_skeletal = None if None in skeletal else [
            Affine.through(a, b, tokens) for a, b in zip(*skeletal, strict=True)]

    def sizes_of(self, request_id: int) -> tuple[int, int]:
        """Bytes of one request in the two traces the template was made of."""
        line = self._size_of[request_id]
        return line.at(self._tokens[0]), line.at(self._tokens[1])

    def size(self, request_id: int, tokens: int) -> int:
        """Bytes of one request of the template at ``tokens``."""
        return self._size_of[request_id].at(tokens)

    def kept_bytes(self, layer: int, tokens: int) -> int:
        """Bytes ``layer`` keeps for its backward (its skeletal activations), input included."""
        return sum(self.size(i, tokens) for i in self.kept[layer])

    def input_bytes(self, tokens: int) -> int:
        """Bytes of a layer's input as kept for its backward (made by the layer before)."""
        layer = min(self.middle, self.layers - 1)
        before = (layer_phase(layer - 1, "fwd"),) if layer else ("embedding.fwd", EMBEDDING_LOOKUP)
        return sum(self.size(i, tokens) for i in self.kept[layer] if self._made_in[i] in before)

    def loss_tile(self, tokens: int, loss_tile_tokens: Optional[int] = None) -> int:
        """The tokens of one tile of the tiled loss, counted as ``tokens`` is (all tensor-parallel
        ranks together): at most ``tokens``."""
        parallel, model = self.meta["parallel"], self.meta["model"]
        chunks = parallel["tp"] if parallel["sequence_parallel"] else 1
        vocab = padded_vocab_size(ModelConfig(**model), parallel["tp"]) // parallel["tp"]
        element = getattr(torch, self.meta["dtype"]).itemsize
        tile = loss_tile_tokens or auto_tile_tokens(
            tokens // chunks, chunks, self.meta["micro_batch_size"], vocab,
            model["ffn_hidden_size"] // parallel["tp"], element)
        return min(tokens, tile * chunks)

    def embedding_tile(self, tokens: int, loss_tile_tokens: Optional[int] = None) -> int:
        """The tokens of one tile of the tiled embedding's backward pass, counted as ``tokens`` is:
        at most ``tokens``."""
        parallel = self.meta["parallel"]
        chunks = parallel["tp"] if parallel["sequence_parallel"] else 1
        tile = loss_tile_tokens or eighth_tile_tokens(tokens // chunks)
        return min(tokens, tile * chunks)

    def tile_skeletal(self, layer_tile_tokens: int) -> SkeletalBytes:
        """One tile's skeletal bytes as the swap runtime keeps them (its share of the layer input,
        attention's output and log-sum-exp, the rest), for tiles of ``layer_tile_tokens`` tokens
        (all tensor-parallel ranks together) of a walk that swaps."""
        if self._tile_skeletal is None:
            raise ValueError("the template is not of a walk in tiles that swaps")
        return SkeletalBytes(*(a.at(TRACED_TILES * layer_tile_tokens) for a in self._tile_skeletal))

    def instance(self, tokens: int, num_layers: int, swap: bool = False, recompute_bytes: int = 0,
                 loss_tile_tokens: Optional[int] = None, layer_tile_tokens: Optional[int] = None) -> Trace:
        """The iteration of ``num_layers`` layers at ``tokens``, gradients left out.

        Args:
            loss_tile_tokens: ``train.loss_tile_tokens`` (``None``: its default), for the tiled loss.
            layer_tile_tokens: a walk in tiles: tokens of a tile (all tensor-parallel ranks
                together); the tile-sized requests are sized at it, the three traced tiles standing
                for all.
            swap: MEMO's rounding buffers hold the kept tensors of every layer, the last two
                included, so those leave the allocator (and so do the extra layers').
            recompute_bytes: with ``swap``, bytes a swapped layer allocates at the start of its
                backward pass to recompute its dropped tokens.
        """
        if num_layers < self.layers or (num_layers > self.layers and self.layers < self.full):
            raise ValueError(f"a template of {self.layers} layers cannot stand for {num_layers}")
        if self.tiled != (layer_tile_tokens is not None):
            raise ValueError("a template of a walk in tiles needs layer_tile_tokens, and only such a template")
        # Every layer's kept tensors live in the rounding buffers (the last two layers' too);
        # all but the last two recompute their dropped tokens at the start of their backward.
        buffered = range(self.layers) if swap else range(0)
        swapped = range(self.layers - 2) if swap else range(0)
        dropped = self.gradients.union(*(self.kept[layer] for layer in buffered))
        extra = num_layers - self.layers
        carried = [] if swap else [self.size(i, tokens) for i in self.carried] * extra
        # from the middle layer's first forward event to its last backward one
        start = next(i for i, e in enumerate(self.events) if _of_layer(e.phase, self.middle, "fwd")) \
            if carried else -1
        end = max(i for i, e in enumerate(self.events) if _of_layer(e.phase, self.middle, "bwd")) \
            if carried else -1
        recompute = {layer_phase(layer, "bwd") for layer in swapped} if recompute_bytes else set()
        tiles = {"loss": self.loss_tile(tokens, loss_tile_tokens),
                 "embedding": self.embedding_tile(tokens, loss_tile_tokens)}
        fresh = itertools.count(max(self._size_of, default=0) + 1)
        carried_ids = [next(fresh) for _ in carried]
        events: list[Event] = []
        phase = None
        for position, (event, size) in enumerate(zip(self.events, self.sizes)):
            if position == start:
                events.extend(Event("malloc", i, s, f"{INNER_LAYERS}.fwd") for i, s in zip(carried_ids, carried))
            if event.phase != phase:
                phase = event.phase
                if phase in recompute:
                    rid = next(fresh)
                    events += [
                        Event("malloc", rid, recompute_bytes, phase),
                        Event("free", rid, recompute_bytes, phase),
                    ]
            if event.id not in dropped:
                if event.id in self.per_tile:
                    at = tiles[self.per_tile[event.id]]
                else:
                    at = TRACED_TILES * layer_tile_tokens if event.id in self.tile_sized else tokens
                events.append(Event(event.op, event.id, size.at(at), event.phase))
            if position == end:
                events.extend(Event("free", i, s, f"{INNER_LAYERS}.bwd") for i, s in zip(carried_ids, carried))
        return Trace(
            events, {**self.meta, "seq": tokens, "model": {**self.meta["model"], "num_layers": num_layers}}
        )


def iteration_template(workload: Workload, num_layers: int, traced: Traced) -> IterationTemplate:
    """The template of ``num_layers`` layers of ``workload``'s model on one rank of its tensor-
    parallel layout, its layers built and run as ``traced`` (an activation policy's
    :attr:`memo.policy.ActivationPolicy.traced`) runs them; the rest of the layout, the length and
    the loss tile do not change it, nor, for a walk in tiles, the tile (but for the eighths of it
    the norms work in, see :func:`traced_tile_tokens`). Templates are cached per process, so a
    sweep traces each shape once.
    """
    chunk = workload.parallel.tp if workload.parallel.sequence_parallel else 1
    tiled = workload.layer_tile_tokens is not None
    layers = min(num_layers, TILED_TEMPLATE_LAYERS if tiled else TEMPLATE_LAYERS)
    return _template(
        _frozen(dataclasses.replace(workload.model, num_layers=layers, init_from=None)),  # one for every depth
        workload.method.name,
        traced,
        workload.parallel.tp,
        workload.parallel.sequence_parallel,
        workload.micro_batch_size,
        workload.dtype,
        workload.loss,
        traced_tile_tokens(workload.layer_tile_tokens // chunk) if tiled else None,
    )


def traced_tile_tokens(tile_tokens: int) -> int:
    """The smaller tile a template of tiles of ``tile_tokens`` tokens (per sequence-parallel chunk)
    is traced at: the tile halved while it stays a whole number of at least
    :data:`MIN_TRACED_TILE` tokens (the template's second trace doubles it), so that its norms'
    eighths are as many as the run's.

    Raises:
        ConfigError: for a tile below :data:`MIN_TRACED_TILE` tokens.
    """
    if tile_tokens < MIN_TRACED_TILE:
        raise ConfigError(f"mode=fit models tiles of at least {MIN_TRACED_TILE} tokens per sequence-parallel "
                          f"rank, not {tile_tokens}; choose a larger method.tile_tokens")
    while tile_tokens % 2 == 0 and tile_tokens // 2 >= MIN_TRACED_TILE:
        tile_tokens //= 2
    return tile_tokens


def _frozen(model: ModelConfig) -> tuple:
    """A model's shape as a hashable value for the cache."""
    return tuple(sorted(dataclasses.asdict(model).items()))


@functools.lru_cache(maxsize=64)
def _template(
    model: tuple,
    method: str,
    traced: Traced,
    tp: int,
    sequence_parallel: bool,
    micro_batch_size: int,
    dtype: str,
    loss: str,
    tile: Optional[int],
) -> IterationTemplate:
    shape = ModelConfig(**dict(model))
    parallel = ParallelConfig(tp=tp, sequence_parallel=sequence_parallel)
    chunk = tp if sequence_parallel else 1
    # whole layers at two lengths; tiles as TRACED_TILES tiles a layer at two tile sizes
    per_chunk = _TRACED_TOKENS if tile is None else (TRACED_TILES * tile, 2 * TRACED_TILES * tile)
    tokens = tuple(t * chunk for t in per_chunk)
    tiles = (None, None) if tile is None else (tile * chunk, 2 * tile * chunk)
    # one tile of the tiled loss per pass (every token of the rank): see the module docstring
    small, large = (
        trace_iteration(Workload(shape, Method(name=method), parallel, t, micro_batch_size, dtype, loss=loss,
                                 loss_tile_tokens=t // chunk, layer_tile_tokens=c), traced)
        for t, c in zip(tokens, tiles)
    )
    return IterationTemplate(small, large, tokens, shape.num_layers)
