"""Train a few steps with one method and keep every step's gradients: the reference for
checking MEMO's swapping and recomputation (used in-process and under torchrun)."""

import torch

from memo.execute.data import SyntheticTokens, micro_batches
from memo.execute.optimizer import HostOptimizer
from memo.execute.streams import InlineStreams
from memo.execute.swap import SwapRuntime
from memo.execute.swap_setup import prepare_swap
from memo.model import build_gpt

from conftest import resolve_config


def train_gradients(method: str, *overrides: str, steps: int = 3, seq: int = 256, streams=None,
                    alpha=None):
    """(losses, per-step gradients by parameter name, runtime) of ``steps`` steps of ``method``
    (with the loss ``train.loss`` in ``overrides`` picks, else the method's).

    Megatron's parallel state must be initialized to match ``overrides``.
    """
    given = [] if alpha is None else [f"alpha={alpha}"]
    run = resolve_config(f"method={method}", *given, *overrides, f"seq={seq}")
    workload = run.workload
    torch.manual_seed(run.train.seed)
    model = build_gpt(workload, "cpu").module
    runtime = None
    if run.swaps:
        chunks = workload.parallel.tp if workload.parallel.sequence_parallel else 1
        runtime = SwapRuntime(workload.model.num_layers, streams or InlineStreams(), torch.device("cpu"),
                              chunks)
        prepare_swap(runtime, model, workload, run.alpha, 2**40)
    optimizer = HostOptimizer(model, run.train)
    source = SyntheticTokens(workload.model.vocab_size, 0)
    batches = micro_batches(source, seq, 1, 1, 0, 1, torch.device("cpu"))
    losses, grads = [], []
    for _ in range(steps):
        (batch,) = next(batches)
        optimizer.zero_grad()
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        loss.backward()
        if runtime is not None:
            runtime.streams.synchronize()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step(run.train.lr)
    return losses, grads, runtime
