"""Train a few steps with one method and keep every step's gradients: the reference for
checking MEMO's swapping and recomputation (used in-process and under torchrun)."""

import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank

from memo.data.batches import SyntheticTokens, micro_batches
from memo.execute.optimizer import HostOptimizer
from memo.model.placement import NullRuntime
from memo.policy import build_model, policy_of
from memo.swap import SwapRuntime, TiledLayers
from memo.swap.prepare import ready_runtime, ready_tiles, sequence_chunks, swapping_walk
from memo.swap.streams import InlineStreams

from conftest import resolve_config


# Steps each check trains: the second is the first that meets what the first left behind (its
# buffers reused, its slab refilled, Adam's moments moved), which is what several steps are for.
STEPS = 2


@functools.lru_cache(maxsize=None)
def _resolved(overrides: tuple[str, ...]):
    """``resolve_config(*overrides)``, composed once per process: the checks train the same
    configuration with many methods and α, and Hydra takes a third of a second to compose one."""
    return resolve_config(*overrides)


def train_gradients(method: str, *overrides: str, steps: int = STEPS, seq: int = 256, streams=None,
                    alpha=None, segments=None, whole_sequence_grads: bool = False, tile_alphas=None,
                    tile_buffers: int = 2, checkpoint_every: int = 1):
    """(losses, per-step gradients by parameter name, runtime) of ``steps`` steps of ``method``
    (with the loss ``train.loss`` in ``overrides`` picks, else the method's). ``segments``: the
    swap runtime's, else as training takes them (2 for a context-parallel input of both chunks).
    ``tile_alphas``: α of each tile, for a walk in tiles that swaps (with ``tile_buffers`` tile
    buffers and every ``checkpoint_every``-th layer's input on the host; else as training makes it). ``whole_sequence_grads``: under sequence parallelism, the gradients of weights every rank
    applies to its own tokens (norms, row-parallel biases) summed over the tensor-parallel group,
    as the optimizer sums them.

    Megatron's parallel state must be initialized to match ``overrides``.
    """
    given = [] if alpha is None else [f"alpha={alpha}"]
    run = _resolved((f"method={method}", *given, *overrides, f"seq={seq}"))
    workload = run.workload
    torch.manual_seed(run.train.seed)
    model = build_model(workload, "cpu").module
    parallel = workload.parallel
    group = parallel_state.get_tensor_model_parallel_group() if dist.is_initialized() else None
    cpu = torch.device("cpu")
    if tile_alphas is not None or tile_buffers != 2 or checkpoint_every != 1:
        runtime = swapping_walk(workload, workload.layer_tile_tokens, workload.model.num_layers,
                                streams or InlineStreams(), cpu, tile_buffers)
        ready_tiles(runtime, model, workload, tile_alphas if tile_alphas is not None else workload.method.alpha,
                    2**40, group, checkpoint_every)
    elif segments is not None:
        runtime = SwapRuntime(workload.model.num_layers, streams or InlineStreams(), cpu,
                              sequence_chunks(parallel), segments)
        ready_runtime(runtime, model, workload, workload.method.alpha, 2**40, group)
    else:
        runtime = policy_of(workload).prepare(model, workload, cpu, 2**40, streams or InlineStreams(), group)
        runtime = None if isinstance(runtime, NullRuntime) else runtime  # (None: its layers run as built)
    optimizer = HostOptimizer([model], run.train)
    source = SyntheticTokens(workload.model.vocab_size, 0)
    batches = micro_batches(source, seq, 1, 1, 0, 1, torch.device("cpu"))
    losses, grads = [], []
    for _ in range(steps):
        (batch,) = next(batches)
        if parallel.cp > 1:  # this rank's two chunks of the sequence, as training takes them
            batch = get_batch_on_this_cp_rank(dict(batch))
        if runtime is not None:
            batch = runtime.token_order(batch)
        optimizer.zero_grad()
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        loss.backward()
        if isinstance(runtime, SwapRuntime):
            runtime.streams.synchronize()
        elif isinstance(runtime, TiledLayers) and runtime.swap is not None:
            runtime.swap.streams.synchronize()
        losses.append(loss.item())
        step_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if whole_sequence_grads and parallel.sequence_parallel:
            # a norm's or row-parallel bias's gradient on one rank sums over that rank's tokens,
            # which depend on the order they are in; over the tensor-parallel group they do not
            for n, p in model.named_parameters():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(step_grads[n], group=parallel_state.get_tensor_model_parallel_group())
        grads.append(step_grads)
        optimizer.step(run.train.lr)
    return losses, grads, runtime
