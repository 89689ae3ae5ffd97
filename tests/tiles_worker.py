"""Under torchrun: layers walked in tiles against keeping everything, with tensor parallelism
(``tp2``), tensor and sequence parallelism (``tp2-sp``, the tokens in tile order) or context
parallelism (``cp2``, tiles of each rank's two chunks), for both layer types, both tiled methods
(memo's tiles swapped, with α per tile and checkpoint layers) and three tile sizes: losses and every gradient over two steps in
float64 (tests/swap/test_tiled_layer.py says why). Under sequence parallelism a rank's tokens are
others than keeping everything's, so the gradients of weights applied per token are compared summed
over both ranks. A check of ``tests/checks_worker.py``."""

import torch

from memo.execute import distributed

from conftest import compose_config
from swap_training import STEPS, train_gradients

SEQ = 256
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "cp2": ["parallel.cp=2"]}
MODELS = {"tiny": [], "tiny_llama": ["model=tiny_llama"]}
RAMP = [0.0, 0.25, 0.5, 1.0]
# (model, method, tokens per tile, memo's α of each tile and checkpoint interval k, or None for
# the solved ones) of each layout: both layer types and methods, several tiles under sequence
# parallelism (whose tile order is the identity for one tile of the sequence)
RUNS = {
    "tp2": [("tiny_llama", "memo", SEQ // 4, (RAMP, 2)), ("tiny", "full_recompute", SEQ // 8, None)],
    "tp2-sp": [("tiny", "memo", SEQ // 8, ([0.5] * 8, 1)), ("tiny_llama", "memo", SEQ // 4, (RAMP[::-1], 4)),
               ("tiny", "full_recompute", SEQ, None)],
    # a rank's two chunks of 64 tokens: two tiles each, or one
    "cp2": [("tiny_llama", "memo", SEQ // 8, (RAMP, 2)), ("tiny", "memo", SEQ // 4, ([0.5, 1.0], 4)),
            ("tiny", "full_recompute", SEQ // 4, None)],
}


def check_tiles(info: distributed.ProcessInfo, out, layout: str) -> str:
    """Raises at the first loss or gradient that differs from ``none``'s."""
    distributed.initialize(compose_config(*LAYOUTS[layout]).parallel, "cpu", info)
    references = {}
    try:
        for model, method, tile, swapped in RUNS[layout]:
            common = [*LAYOUTS[layout], *MODELS[model], "model.num_layers=4", "model.vocab_size=1000",
                      "train.loss=tiled", "train.dtype=fp64"]
            if model not in references:
                references[model] = train_gradients("none", *common, seq=SEQ, whole_sequence_grads=True)
            expected_losses, expected, _ = references[model]
            alphas, k = swapped or (None, 1)
            losses, grads, _ = train_gradients(method, *common, f"method.tile_tokens={tile}", seq=SEQ,
                                               whole_sequence_grads=True, tile_alphas=alphas, checkpoint_every=k)
            what = f"rank {info.rank}: {model} {method} tiles of {tile}, alpha {alphas}, k {k}"
            torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: losses: {m}")
            for step, (got, want) in enumerate(zip(grads, expected, strict=True)):
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                               msg=lambda m, n=name, s=step: f"{what} step {s + 1} {n}: {m}")
    finally:
        distributed.shutdown()
    return f"{len(RUNS[layout])} tiled runs match over {STEPS} steps ({layout})"
