"""What to predict for a run, and a run that plans itself: the fastest way to train it that fits
this machine, chosen from the fit's own predictions before the model is built.

A run's ``auto`` settings (:class:`memo.config.Choices`: ``method.keep_all``, ``method.tile_tokens``,
``train.optimizer_offload``, ``train.loss_tile_tokens``) are candidates here, its explicit
settings fixed. Keeping every activation comes first where memo may choose it (on a GPU, α left
to solve): no copy and no recomputation, so where it fits nothing is faster. Then whole layers
with Adam on the device: the time model charges tiles
their recomputation and Adam on the host its copies and its CPU step, so where that candidate
fits nothing is faster and no other is predicted. Otherwise every candidate is predicted at the
run's length and the fastest that fits wins; the layers' tiles tried are the powers of two
that split the sequence, from half of it down to what the fit models. A run that no candidate
fits is refused in one line naming the term that binds and the longest length that fits.
``mode=fit`` predicts the same candidates (:func:`candidates`).
"""

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

from memo import hardware
from memo.config import WHOLE_LAYERS, ConfigError, DoesNotFit, Run, SeqSearch
from memo.fit.predict import Prediction, Problem, predict, prediction_hardware
from memo.fit.search import Candidate, LayoutResult, layout_label, layouts, longest, seq_grid_step
from memo.hardware import GiB
from memo.model import torch_dtype
from memo.model.gpt import padded_vocab_size
from memo.model.tiles import auto_tile_tokens
from memo.policy import policy_of
from memo.profile.template import MIN_TRACED_TILE

log = logging.getLogger("memo")

# The columns of a chosen run's row beside its settings (Choice.row).
ROW_FIELDS = ("choice.candidates", "choice.seconds", "predicted_device_bytes", "predicted_activation_peak_bytes",
              "predicted_peak_phase", "predicted_device_capacity_bytes", "margin_bytes",
              "predicted_host_bytes_per_device", "predicted_iter_time_s")
# The refusal's search for the longest length that fits: multiples of the largest power of two
# at most the run's length over this.
_LENGTH_STEPS = 64


def problem_of(run: Run, hw: hardware.Hardware) -> Problem:
    """The fixed part of ``run``'s prediction (workload, hardware, assumptions)."""
    return Problem(
        workload=run.workload,
        hardware=hardware.with_measured_peak(prediction_hardware(hw), torch_dtype(run.workload)),
        fit=run.fit,
        micro_batches=run.train.micro_batches,
        # a CPU's optimizer (memo.execute.optimizer.HostOptimizer) shards nothing
        distributed_optimizer=run.train.distributed_optimizer if run.device_type == "cuda" else False,
        plan=run.plan,
        optimizer_offload=offload_share(run, run.train.optimizer_offload),
        plan_time_limit_s=run.planner.time_limit_s,
        pytorch_adam=USING_PYTORCH_OPTIMIZER if run.fit.pytorch_adam is None else run.fit.pytorch_adam,
    )


def offload_share(run: Run, placement: str) -> float:
    """The share of the parameters whose Adam states live on the host for ``placement``
    (``train.optimizer_offload``'s values; auto is predicted as none)."""
    return run.train.optimizer_offload_fraction if placement == "host" else 0.0


def evaluate(problem: Problem, candidate: Candidate, seq: int, search: Optional[SeqSearch]) -> LayoutResult:
    """One candidate at ``seq`` tokens, or at the longest length ``search`` allows (if given)."""
    problem = _of_candidate(problem, candidate)
    if search is None:
        prediction = predict(problem, candidate.parallel, seq)
        found = (prediction, None) if prediction.fits else (None, prediction)
        return LayoutResult(candidate, *found)
    grid, limit = seq_grid_step(search.step, candidate.parallel, candidate.tile_tokens), search.limit
    if grid > limit:
        raise ConfigError(
            f"fit.seq_limit={limit} is below the first length this layout can split ({grid}); "
            "raise fit.seq_limit"
        )
    best, failed = longest(lambda s: predict(problem, candidate.parallel, s), grid, limit)
    return LayoutResult(candidate, best, failed)


def _of_candidate(problem: Problem, candidate: Candidate) -> Problem:
    workload = problem.workload.in_layer_tiles(candidate.tile_tokens)
    if candidate.keeps_all:
        workload = workload.keeping_all()
    if candidate.tile_tokens is not None and problem.workload.loss == "tiled" and candidate.loss_tile_tokens:
        workload = dataclasses.replace(workload, loss_tile_tokens=candidate.loss_tile_tokens)
    return dataclasses.replace(problem, workload=workload, optimizer_offload=candidate.optimizer_offload)


def candidates(run: Run, problem: Problem) -> list[Candidate]:
    """The candidates to predict, each with why training cannot run it, first the one nothing
    beats where it fits (whole layers, Adam on the device): under ``parallel=search`` every
    layout with every tile (for a method that walks tiles) and every placement of Adam's states
    of ``fit.tile_tokens`` and ``fit.optimizer_offload``, the run's own among them (a training
    run's ``parallel=auto``: its own settings, or every choice of those it leaves to choose), each
    layout as the candidate's activation policy tries it
    (:meth:`memo.policy.ActivationPolicy.candidate_layout`); otherwise the run's layout with its
    own settings, or for those it leaves to choose (``auto``), every choice."""
    workload, parallel = run.workload, run.workload.parallel
    policy = policy_of(workload)
    fixed_seq = None if run.seq_search is not None else workload.seq
    if not parallel.search:
        tiles = _tiles_to_choose(run) if run.choices.layer_tiles else (workload.layer_tile_tokens,)
        shares = (0.0, offload_share(run, "host")) if run.choices.optimizer_offload else (problem.optimizer_offload,)
        found = []
        for share in shares:
            found += _keeping_all(run, parallel, share)
            for tile in tiles:
                tiled = workload.in_layer_tiles(tile)
                if tile is not None and not _runs_as_laid_out(tiled, fixed_seq):
                    continue
                found.append(Candidate(parallel, policy_of(tiled).training_refusal(parallel) or _unrunnable(run, share),
                                       tile, share, _loss_tile(run, tile, parallel)))
        if not found:
            raise ConfigError(f"no tile of {_tiles_to_choose(run)} splits seq={workload.seq} for "
                              f"method={workload.method.name}; set method.tile_tokens")
        return found
    if run.choices.layout:  # a training run's: its own choices, at every layout
        tiles = _tiles_to_choose(run) if run.choices.layer_tiles else (workload.layer_tile_tokens,)
        shares = [0.0, offload_share(run, "host")] if run.choices.optimizer_offload else [problem.optimizer_offload]
    else:
        tiles = policy.layer_tiles_tried(run.fit_layer_tiles, workload.layer_tile_tokens)
        shares = list(dict.fromkeys([*(offload_share(run, placement) for placement in run.fit.optimizer_offload),
                                     problem.optimizer_offload]))
    found = []
    for p in _layouts(run, problem, policy):
        found += [c for share in shares for c in _keeping_all(run, p, share)]
        for tile in tiles:
            tiled = workload.in_layer_tiles(tile)
            candidate = policy_of(tiled)
            layout = candidate.candidate_layout(tiled, p, fixed_seq)
            if layout is None:
                continue
            refusal = candidate.training_refusal(layout) or _with_documents(run, layout, tile)
            found += [Candidate(layout, refusal or _unrunnable(run, share), tile, share, _loss_tile(run, tile, layout))
                      for share in shares]
    if not found:
        raise ConfigError(
            f"no valid layout of cluster.gpus={run.cluster.gpus} for model={workload.model.name}"
        )
    return found


def _keeping_all(run: Run, parallel, share: float) -> list[Candidate]:
    """The candidate of whole layers keeping every activation under ``parallel`` with ``share`` of
    Adam's states on the host, where the run may choose it (``method.keep_all=auto``)."""
    if not run.choices.keep_all:
        return []
    kept = run.workload.keeping_all()
    refusal = policy_of(kept).training_refusal(parallel) or _unrunnable(run, share)
    return [Candidate(parallel, refusal, None, share, run.workload.loss_tile_tokens, keeps_all=True)]


def _runs_as_laid_out(tiled, seq: Optional[int]) -> bool:
    """Whether the run's own layout walks tiles of ``tiled`` as it is: the tiles' policy tries a
    layout under its own exchange's name (the walk gathers into its stores whatever the name) and
    without sequence parallelism under context parallelism, which training does not turn off."""
    policy, parallel = policy_of(tiled), tiled.parallel
    named = dataclasses.replace(parallel, cp_comm_type=policy.exchanges[0]) if parallel.cp > 1 else parallel
    layout = policy.candidate_layout(tiled, named, seq)
    return layout is not None and layout.sequence_parallel == parallel.sequence_parallel


def _layouts(run: Run, problem: Problem, policy) -> list:
    parallel = run.workload.parallel
    return layouts(run.workload.model, run.cluster.gpus, problem.hardware.devices_per_node or 1,
                   parallel.sequence_parallel, policy.exchanges)


def _tiles_to_choose(run: Run) -> tuple[Optional[int], ...]:
    """Whole layers, then the powers of two from half the sequence down to the least the fit
    models (``seq=max``: ``fit.tile_tokens``); whole layers only where a tile cannot run with the
    run's other settings (packed documents under context parallelism). A validation pass walks
    the tiles without a graph, within what a training step holds."""
    train, parallel, seq = run.train, run.workload.parallel, run.workload.seq
    if train.document_mask and parallel.cp > 1:
        return (None,)
    if run.seq_search is not None:  # mode=fit seq=max: the tiles a layout search tries
        return (None, *(t for t in run.fit_layer_tiles if t is not None))
    chunk = parallel.tp if parallel.sequence_parallel else 1
    tiles, tile = [], 1 << ((seq // 2).bit_length() - 1)
    while tile >= MIN_TRACED_TILE * chunk:
        if seq % tile == 0:
            tiles.append(tile)
        tile //= 2
    return (None, *tiles)


def _loss_tile(run: Run, layer_tile: Optional[int], parallel) -> Optional[int]:
    """The tiled loss's tokens per tile in a walk of ``layer_tile``-token tiles under ``parallel``,
    where the run leaves it and the layers' tiles to choose: the rule of
    :func:`memo.model.tiles.auto_tile_tokens` with a tile's FC1 output (not the sequence's) as its
    bound, so that the loss's transients, and the tiled embedding's (which takes the loss's tile),
    stay below a tile's. None (the rule over the sequence, as the model applies it) for whole layers."""
    if not (run.choices.loss_tile and run.choices.layer_tiles) or layer_tile is None:
        return run.workload.loss_tile_tokens
    w = run.workload
    tp, chunks = parallel.tp, (parallel.tp if parallel.sequence_parallel else 1)
    element = 2 if w.dtype in ("bf16", "fp16") else w.dtype_bytes
    return auto_tile_tokens(layer_tile // chunks, chunks, w.micro_batch_size,
                            padded_vocab_size(w.model, tp) // tp, w.model.ffn_hidden_size // tp, element)


def _with_documents(run: Run, parallel, tile: Optional[int]) -> Optional[str]:
    """Why training cannot keep the run's documents apart in tiles of ``tile`` under ``parallel``
    (None: it can, or there are none)."""
    if run.workload.document_mask and parallel.cp > 1 and tile is not None:
        return "train.document_mask: memo's sequence tiles keep documents apart without context parallelism so far"
    return None


def _unrunnable(run: Run, offload: float) -> Optional[str]:
    """Why training cannot run with ``offload`` of Adam's states on the host (None: it can)."""
    if offload and run.workload.dtype not in ("bf16", "fp16"):
        return f"train.optimizer_offload=host needs 16-bit weights, not train.dtype={run.workload.dtype}"
    return None


@dataclass(frozen=True)
class Choice:
    """How a run trains, as chosen: the candidate and its prediction at the run's length."""

    candidate: Candidate
    prediction: Prediction
    tried: int  # candidates predicted
    seconds: float  # spent choosing

    def apply(self, run: Run) -> Run:
        """``run`` with the choice written into its settings."""
        c = self.candidate
        workload = run.workload.keeping_all() if c.keeps_all else run.workload.in_layer_tiles(c.tile_tokens)
        workload = dataclasses.replace(workload, loss_tile_tokens=c.loss_tile_tokens, parallel=c.parallel)
        train = dataclasses.replace(run.train, loss_tile_tokens=c.loss_tile_tokens,
                                    optimizer_offload="host" if c.optimizer_offload else "none")
        return dataclasses.replace(run, workload=workload, train=train)

    def row(self) -> dict:
        """The choice and what the fit predicts of it (bytes per device, seconds), as row columns;
        the settings under their own keys, as a run given them explicitly records them."""
        c, p = self.candidate, self.prediction
        return {
            **({"method.layer_activations": "keep"} if c.keeps_all else {}),
            "method.tile_tokens": c.tile_tokens or WHOLE_LAYERS,
            "train.optimizer_offload": "host" if c.optimizer_offload else "none",
            "train.loss_tile_tokens": c.loss_tile_tokens,
            **{f"parallel.{key}": value for key, value in dataclasses.asdict(c.parallel).items()},
            **dict(zip(ROW_FIELDS, (
                self.tried, self.seconds, p.device_total, p.acts.allocated_peak if p.acts else None,
                p.acts.peak_phase if p.acts else None, p.device_capacity, p.margin, p.host_per_device,
                p.time.iteration_s), strict=True)),
        }

    @property
    def described(self) -> str:
        """The choice in words: the layers' tiles and where Adam's states are."""
        return _described(self.candidate)

    def summary(self) -> str:
        """The log's line."""
        c, p = self.candidate, self.prediction
        loss = f", loss tiles of {c.loss_tile_tokens}" if c.loss_tile_tokens else ""
        return (f"plan: {self.described}{loss}: {p.device_total / GiB:.2f} GiB of "
                f"{p.device_capacity / GiB:.2f} GiB per device predicted (margin {p.margin / GiB:.2f} GiB), "
                f"{p.host_per_device / GiB:.2f} GiB on the host, {p.time.iteration_s:.3g} s a step "
                f"({self.tried} candidate(s) in {self.seconds:.1f} s)")


def choose(run: Run, hw: hardware.Hardware) -> Choice:
    """The fastest candidate of ``run`` (:func:`candidates`) that fits ``hw``, predicted at the
    run's length.

    Raises:
        DoesNotFit: in one line, where no candidate that training can run fits: the term that
            binds and the longest length that fits.
        ConfigError: where training can run no candidate (the first one's reason).
    """
    start = time.perf_counter()
    problem = problem_of(run, hw)
    tried = candidates(run, problem)
    runnable = [c for c in tried if not c.unrunnable]
    if not runnable:
        raise ConfigError(tried[0].unrunnable)
    results = []
    for candidate in runnable:
        results.append(evaluate(problem, candidate, run.workload.seq, None))
        if candidate is runnable[0] and results[0].best is not None and not run.choices.layout:
            break
    fitting = [r for r in results if r.best is not None]
    if not fitting:
        raise DoesNotFit(_refusal(run, problem, results))
    # the fastest: across layouts by tokens a device a second (data parallelism makes the global
    # batch larger, not the step shorter), within one by the step's time; a tie to the larger tile
    best = min(fitting, key=lambda r: (-r.best.time.tgs if run.choices.layout else r.best.time.iteration_s,
                                       -(r.candidate.tile_tokens or math.inf)))
    return Choice(best.candidate, best.best, len(results), time.perf_counter() - start)


def _refusal(run: Run, problem: Problem, results: list[LayoutResult]) -> str:
    """Why no candidate fits, in one line: the least demanding one's binding term and the longest
    length any fits."""
    w, hw = run.workload, problem.hardware
    closest = min(results, key=lambda r: (r.failed.status != "oom", r.failed.device_total))
    p = closest.failed
    # (a power of two: the grid of a length in tiles is their least common multiple)
    step = 1 << (max(w.seq // _LENGTH_STEPS, 1).bit_length() - 1)
    longest_fit = 0
    for r in results:
        grid = seq_grid_step(step, r.parallel, r.candidate.tile_tokens)
        if grid >= w.seq:
            continue
        fits, _ = longest(lambda s: predict(_of_candidate(problem, r.candidate), r.parallel, s), grid, w.seq - 1)
        longest_fit = max(longest_fit, fits.seq if fits else 0)
    where = (f"the longest that fits is seq={_tokens(longest_fit)}" if longest_fit
             else "no length down to a 64th of it fits either")
    return (f"{w.model.name} at {_tokens(w.seq)} does not fit this {hw.name} "
            f"({hw.device_memory_bytes / GiB:.2f} GiB a device, {hw.host_memory_bytes / GiB:.1f} GiB of host): "
            f"{_binding(p)} in {_described(closest.candidate)}, the least that any choice needs; {where}")


def _binding(p: Prediction) -> str:
    """The term of ``p`` that binds, and what it needs."""
    if p.status == "oohm":
        return (f"the host needs {p.host_per_node / GiB:.2f} GiB of its {p.host_capacity_per_node / GiB:.2f} GiB "
                f"usable ({p.reason})")
    a, s = p.acts, p.states
    terms = {
        "the model's weights, gradients and Adam states": s.total,
        "the activations kept for the backward pass": (a.skeletal if a else 0) + p.rounding_buffers,
        "the transient activations": a.transient if a else 0,
        "the embedding, logits and loss": a.head if a else 0,
        "the persistent buffers (the tiles' stores, RoPE tables)": a.persistent if a else 0,
        "the context-parallel buffers": p.cp_buffers,
        "the memory outside PyTorch": p.reserved,
    }
    name, size = max(terms.items(), key=lambda item: item[1])
    return (f"{name} need {size / GiB:.2f} GiB of the {p.device_total / GiB:.2f} GiB predicted against "
            f"{(p.device_capacity - p.margin) / GiB:.2f} GiB usable")


def _described(c: Candidate) -> str:
    p = c.parallel
    layout = f"{layout_label(p)}, " if p.tp * p.cp * p.pp * p.dp > 1 else ""
    layers = ("whole layers keeping every activation" if c.keeps_all
              else f"tiles of {c.tile_tokens} tokens" if c.tile_tokens else "whole layers")
    return f"{layout}{layers}, Adam on the {'host' if c.optimizer_offload else 'device'}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
