"""Train a few steps with one method and keep every step's gradients: the reference for
checking MEMO's swapping and recomputation (used in-process and under torchrun)."""

import torch

from memo.execute.data import SyntheticTokens, micro_batches
from memo.execute.optimizer import HostOptimizer
from memo.execute.streams import InlineStreams
from memo.execute.swap import SwapRuntime
from memo.execute.swap_setup import prepare_swap
from memo.config import resolve_loss
from memo.model import build_gpt

from conftest import compose_config


def train_gradients(method: str, *overrides: str, steps: int = 3, seq: int = 256, streams=None,
                    alpha=None):
    """(losses, per-step gradients by parameter name, runtime) of ``steps`` steps of ``method``
    (with the loss ``train.loss`` in ``overrides`` picks, else the method's).

    Megatron's parallel state must be initialized to match ``overrides``.
    """
    cfg = compose_config(f"method={method}", *overrides)
    torch.manual_seed(cfg.train.seed)
    model = build_gpt(cfg.model, cfg.method, cfg.parallel, seq, torch.float32, "cpu",
                      loss=resolve_loss(cfg)).module
    runtime = None
    if cfg.method.layer_activations == "swap":
        chunks = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
        runtime = SwapRuntime(cfg.model.num_layers, streams or InlineStreams(), torch.device("cpu"), chunks)
        fixed = cfg.method.alpha if cfg.method.alpha is not None else alpha
        prepare_swap(runtime, model, seq, 1, torch.float32, fixed, 2**40)
    optimizer = HostOptimizer(model, cfg.train)
    source = SyntheticTokens(cfg.model.vocab_size, 0)
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
        optimizer.step(cfg.train.lr)
    return losses, grads, runtime
