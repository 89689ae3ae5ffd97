"""A pipeline stage's runtimes: one per micro-batch in flight on each of its model chunks.

MEMO's runtimes (whole layers, :class:`memo.swap.runtime.SwapRuntime`; tiles,
:class:`memo.swap.tiled_layer.TiledLayers`) keep what one micro-batch's layers save, from their
forward pass to their backward pass, in buffers of their own: rounding or tile buffers on the
device, a region of their host slab, stores. Without pipelining one micro-batch's backward
follows its forward, so one set serves a step. Under Megatron's pipeline schedules a stage runs
the forward passes of later micro-batches before the backward pass of an earlier one (1F1B keeps
up to ``pp − rank`` in flight on pipeline rank ``rank``; :func:`memo.execute.pipeline.in_flight`
counts them for any schedule), so each chunk has one runtime per micro-batch in flight, each
with its own buffers, host memory (the stage's host budget shared among them) and copy streams.

A chunk's micro-batches start and end in order, so micro-batch ``j`` uses runtime ``j mod n`` of
its chunk's ``n``: the runtime of micro-batch ``j − n`` is free by then. :meth:`InFlight.use`
makes a runtime the one the chunk's layers run under (the placements of its modules, as
:mod:`memo.model.placement` describes them), before that micro-batch's forward pass and again
before its backward pass (the schedule calls it when the chunk's output receives its gradient).
"""

from typing import Callable, Optional

import torch

from memo.model.placement import Accounting, LayerRuntime, Placed, RuntimeReport


# a runtime's report's bytes that the stage holds once per runtime
_SUMMED = ("swap.host_budget_bytes", "swap.host_bytes", "swap.rounding_buffer_bytes", "tiles.host_budget_bytes",
           "tiles.host_bytes", "tiles.tile_buffer_bytes")


class _Chunk:
    """One model chunk's runtimes and, for each, the placement it gave each module of the layers."""

    def __init__(self, layers: list, runtimes: list[LayerRuntime], placements: list[list]):
        self.modules = [m for layer in layers for m in layer.modules() if isinstance(m, Placed)]
        self.first_layer = layers[0].layer_number - 1 if layers else 0  # (in the whole model)
        self.runtimes, self.placements = runtimes, placements


class InFlight:
    """The :class:`memo.model.placement.LayerRuntime` of a pipeline stage (see the module
    docstring). Build it with :func:`in_flight_runtimes`."""

    def __init__(self, chunks: list[_Chunk]):
        self._chunks = chunks
        self._all = [r for chunk in chunks for r in chunk.runtimes]

    @property
    def by_chunk(self) -> list[list[LayerRuntime]]:
        """Each chunk's runtimes, micro-batch ``j``'s at ``j mod`` their number."""
        return [chunk.runtimes for chunk in self._chunks]

    @property
    def counts(self) -> list[int]:
        """Runtimes (micro-batches in flight) of each chunk."""
        return [len(chunk.runtimes) for chunk in self._chunks]

    def use(self, chunk: int, micro_batch: int) -> None:
        """Let ``chunk``'s layers run under the runtime of ``micro_batch`` (0-based, of the step)."""
        own = self._chunks[chunk]
        for module, placement in zip(own.modules, own.placements[micro_batch % len(own.runtimes)], strict=True):
            module.place(placement)

    def attach(self, layers: list) -> None:
        raise ValueError("a pipeline stage's runtimes are attached as they are made (in_flight_runtimes)")

    def release(self) -> None:
        for runtime in self._all:
            runtime.release()

    def token_order(self, micro_batch: dict) -> dict:
        # (every runtime of a stage walks the same tiles)
        return self._all[0].token_order(micro_batch)

    def accounting(self) -> Optional[Accounting]:
        """Each layer's bytes summed over the micro-batches in flight, the layers numbered in the
        whole model."""
        layers: dict[int, dict] = {}
        device = 0
        for chunk in self._chunks:
            for runtime in chunk.runtimes:
                taken = runtime.accounting()
                if taken is None:
                    return None
                device += taken.device_bytes
                for row in taken.layers:
                    index = chunk.first_layer + row["layer"]
                    sums = layers.setdefault(index, {"layer": index, "device": 0, "host": 0, "recomputed": 0})
                    for key in ("device", "host", "recomputed"):
                        sums[key] += row[key]
        return Accounting(tuple(layers[i] for i in sorted(layers)), device)

    def report(self) -> RuntimeReport:
        """The first runtime's decisions (every runtime of a chunk decides alike; a walk's stores
        are its chunk's), the bytes they hold summed over the stage's runtimes, and how many there
        are (``pipeline.in_flight``)."""
        reports = [runtime.report() for runtime in self._all]
        first = reports[0]
        row = {**first.row, "pipeline.in_flight": sum(self.counts)}
        for key in _SUMMED:
            if row.get(key) is not None:
                row[key] = sum(report.row[key] for report in reports)
        summary = f"{first.summary + '; ' if first.summary else ''}one set per micro-batch in flight: {self.counts}"
        return RuntimeReport(row=row, layer_records=first.layer_records, summary=summary,
                             skeletal_bytes=first.skeletal_bytes)

    def device_buffers(self) -> list[torch.Tensor]:
        return [b for runtime in self._all for b in runtime.device_buffers()]

    def device_stores(self) -> list[torch.Tensor]:
        # (a chunk's walks share their stores: each once)
        return list({id(s): s for runtime in self._all for s in runtime.device_stores()}.values())

    def name_phases(self, on_phase: Optional[Callable[[int, str], None]]) -> None:
        for runtime in self._all:
            runtime.name_phases(on_phase)


def in_flight_runtimes(chunks: list, counts: list[int], prepare: Callable[[object], LayerRuntime]) -> InFlight:
    """A stage's runtimes: ``counts[c]`` of them for chunk ``chunks[c]`` (an unwrapped Megatron
    ``GPTModel``), each made by ``prepare(chunk)``, which attaches it to the chunk's layers."""
    made = []
    for chunk, count in zip(chunks, counts, strict=True):
        layers = list(chunk.decoder.layers)
        modules = [m for layer in layers for m in layer.modules() if isinstance(m, Placed)]
        runtimes, placements = [], []
        for _ in range(count):
            runtimes.append(prepare(chunk))
            placements.append([m.placement for m in modules])
        made.append(_Chunk(layers, runtimes, placements))
    return InFlight(made)
