"""Under torchrun: gradients of MEMO's methods against keeping everything, with tensor and
sequence parallelism or context parallelism (the layout: ``tp2-sp``, ``cp2``, ``cp2-p2p``,
``cp2-a2a`` or ``tp2-sp-cp2``). :func:`check_layout` is a check of ``tests/checks_worker.py``
(several layouts share one launch; ``... tests/checks_worker.py OUT "swap_worker.check_layout
LAYOUT"`` checks one alone); it raises (with the first difference) if any step differs.

The model is the tiny GPT at six layers (four swapped, the last two kept) with a vocabulary of
1000 tokens (padded to 1024, as Megatron pads GPT-2's 50257 to 50304): the swapped and recomputed
tensors are the layers', whose sizes do not depend on the vocabulary, while the output layer of
50304 tokens took most of each step's time.
"""


import torch

from memo.execute import distributed

from conftest import compose_config
from swap_training import STEPS, train_gradients

# layout -> (its overrides, the loss it is checked with)
LAYOUTS = {
    # (the loss runs after the layers, whatever they swap: Megatron's is checked under cp2-p2p and tp2-sp-cp2)
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], "tiled"),
    "cp2": (["parallel.cp=2"], "tiled"),
    "cp2-p2p": (["parallel.cp=2", "parallel.cp_comm_type=p2p"], "megatron"),
    "cp2-a2a": (["parallel.cp=2", "parallel.cp_comm_type=a2a"], "tiled"),
    "tp2-sp-cp2": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"], "megatron"),
}
VARIANTS = [("memo", 0.0), ("memo", 0.125), ("memo", 0.5), ("memo", 1.0), ("full_swap", None),
            ("full_recompute", None)]
# under context parallelism: nothing swapped or recomputed, both, and the two whole methods
CP_VARIANTS = [("memo", 0.0), ("memo", 0.5), ("full_swap", None), ("full_recompute", None)]
MODEL = ["model.num_layers=6", "model.vocab_size=1000"]
# Llama's shape (its grouped heads split by the layout) under a partial α and both whole methods
# (α's edges are the GPT's above), and under Megatron's own recomputations
LLAMA_VARIANTS = [("memo", 0.5), ("full_swap", None), ("full_recompute", None), ("megatron_selective", None),
                  ("megatron_full_recompute", None)]


def check_layout(info: distributed.ProcessInfo, out, layout: str, model: str = "tiny") -> str:
    """Every variant's gradients, step by step, equal keeping everything's; raises at the first
    difference. ``model``: tiny (the GPT) or tiny_llama (grouped keys and values, SwiGLU, RMSNorm,
    an untied output layer), which is also checked with Megatron's own recomputations."""
    overrides, loss = LAYOUTS[layout]
    if model != "tiny":
        variants = LLAMA_VARIANTS
    else:
        variants = CP_VARIANTS if "cp" in layout else VARIANTS
    parallel = [*overrides, *MODEL, f"model={model}", f"train.loss={loss}"]
    distributed.initialize(compose_config(*parallel).parallel, "cpu", info)
    try:
        _, reference, _ = train_gradients("none", *parallel)
        for method, alpha in variants:
            _, grads, _ = train_gradients(method, *parallel, alpha=alpha)
            for step, (got, expected) in enumerate(zip(grads, reference, strict=True)):
                for name in expected:
                    torch.testing.assert_close(
                        got[name], expected[name],
                        msg=lambda m, n=name, s=step: f"rank {info.rank}: {method} alpha={alpha} {loss} "
                                                      f"step {s + 1} {n}: {m}")
    finally:
        distributed.shutdown()
    shown = "" if model == "tiny" else f"{model}, "
    return f"{len(variants)} methods match over {STEPS} steps with {loss} ({shown}{layout})"
