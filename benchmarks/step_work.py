"""The work one step of memo in sequence tiles does beyond what its α and tiles make unavoidable.

    python benchmarks/step_work.py                              # Llama-3.1-8B and Qwen2.5-7B at 256K (15 min)
    python benchmarks/step_work.py --only llama3_8b --csv results/cpu/step_work.csv

Per case (bf16, fake tensors, rank 0, α fixed per tile, the layer count cut to a few), one training
step is counted operator by operator (:func:`memo.profile.work.count_step`): GEMM FLOPs by weight and
pass, attention's query–key pairs, key and value bytes handed to the attention kernels, bytes
copied each way, and ATen operators that launch a kernel. Beside the count, the **minimum** for
the same α and tiles, written out here by hand from the model's shapes (:func:`minimum`, not the
fit's code), and the ratio of the two for what is recomputed and what is copied.

The minimum, per step, with ``s`` tokens in ``T`` tiles of ``c``, ``L`` layers, ``R`` = 2 tile
buffers (the walk's last ``R`` tiles stay in them: never sent out, brought back or recomputed),
every layer's input a checkpoint, ``k_t = ⌊α·c⌋`` tokens kept of each other tile:

* recomputed GEMM FLOPs: the keys and values of every layer but the last (one store serves all
  layers; the last layer's backward follows its forward with its keys still there),
  ``(L − 1)·2·s·h·2·g·d``; each dropped token's query, attention projection and FC1
  (``2·h·n·d + 2·n·d·h + 2·h·2f``: its saved tensors up to FC2's input, keys and values being in
  the store); the output layer's logits once more (the tiled loss keeps none);
* bytes copied each way: every layer's input (``s·h·e``); per tile sent out, attention's output
  and log-sum-exp (``c·n·d·e + c·n·4``) and its ``k_t`` kept tokens of the other tensors a
  Llama-shaped layer saves (``2·4`` bytes of norm statistics, and ``e`` bytes of each of the first
  norm's output ``h``, the rotated query ``n·d``, the residual ``h``, the second norm's output
  ``h``, FC1's output ``2f`` and SwiGLU's ``f``).
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas  # noqa: E402

from memo.config import resolve  # noqa: E402
from memo.gpucheck.common import compose  # noqa: E402
from memo.model import padded_vocab_size  # noqa: E402
from memo.policy import policy_of  # noqa: E402
from memo.profile.work import count_step  # noqa: E402
from memo.results import create_file_atomic  # noqa: E402

K = 1024
# model, tokens, tile tokens, layers, α
CASES = [("llama3_8b", 256 * K, 16 * K, 4, 0.0), ("llama3_8b", 256 * K, 16 * K, 4, 0.5),
         ("llama3_8b", 256 * K, 16 * K, 4, 1.0), ("qwen2.5_7b", 256 * K, 16 * K, 4, 0.5),
         ("llama3_8b", 256 * K, 16 * K, 32, 0.5)]  # (the whole model: the output layer's share as in training)
BUFFERS = 2
STAT_BYTES = 4  # a norm's statistic per token, float32


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model (RMSNorm, SwiGLU, grouped keys and values) as the minimum needs it."""

    hidden: int  # h
    heads: int  # n
    groups: int  # g
    head_dim: int  # d
    ffn: int  # f
    vocab: int  # V, padded as the output layer holds it
    layers: int  # L
    dtype_bytes: int  # e


def minimum(shape: Shape, seq: int, tile: int, alpha: float) -> dict:
    """What one step must recompute and copy for ``alpha`` and ``tile`` (see the module docstring)."""
    h, n, g, d, f, e, layers = (shape.hidden, shape.heads, shape.groups, shape.head_dim, shape.ffn,
                                shape.dtype_bytes, shape.layers)
    tiles = seq // tile
    sent = layers * tiles - BUFFERS  # tiles sent out: all but the walk's last R
    keep = int(alpha * tile)
    keys_values = (layers - 1) * 2 * seq * h * 2 * g * d
    dropped = sent * (tile - keep) * (2 * h * n * d + 2 * n * d * h + 2 * h * 2 * f)
    logits = 2 * seq * h * shape.vocab
    other_per_token = 2 * STAT_BYTES + e * (h + n * d + h + h + 2 * f + f)
    inputs = layers * seq * h * e
    per_tile = tile * n * d * e + tile * n * 4 + keep * other_per_token
    return {"recomputed_flops": keys_values + dropped + logits, "copied_bytes": inputs + sent * per_tile}


def shape_of(workload) -> Shape:
    m = workload.model
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    return Shape(m.hidden_size, m.num_attention_heads, m.num_query_groups or m.num_attention_heads, d,
                 m.ffn_hidden_size, padded_vocab_size(m, 1), m.num_layers, workload.dtype_bytes)


def run(model: str, seq: int, tile: int, layers: int, alpha: float) -> dict:
    workload = resolve(compose(f"model={model}", f"model.num_layers={layers}", "method=memo", f"alpha={alpha}",
                               f"seq={seq}", f"method.tile_tokens={tile}", "train.dtype=bf16"),
                       gpu_visible=False).workload
    start = time.perf_counter()
    step = count_step(workload, policy_of(workload), fake=True)
    seconds = time.perf_counter() - start
    least = minimum(shape_of(workload), seq, tile, alpha)
    recomputed = step.work.recomputed_flops
    copied = step.copied["d2h"]
    return {"model": model, "seq": seq, "tile_tokens": tile, "layers": layers, "alpha": alpha,
            "recomputed_flops": recomputed, "minimum_recomputed_flops": least["recomputed_flops"],
            "recomputed_ratio": recomputed / least["recomputed_flops"],
            "d2h_bytes": copied, "h2d_bytes": step.copied["h2d"], "minimum_copied_bytes": least["copied_bytes"],
            "copied_ratio": max(copied, step.copied["h2d"]) / least["copied_bytes"],
            "attention_forward_pairs": step.work.attention_pairs(False),
            "attention_backward_pairs": step.work.attention_pairs(True),
            "minimum_attention_pairs": layers * seq * (seq + 1) // 2,
            "key_value_bytes_read": step.work.key_value_bytes_read,
            "kernels": step.work.kernels_launched, "count_seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="models to count (default: every case)")
    parser.add_argument("--csv", type=Path, help="also write the rows here (refuses to overwrite)")
    args = parser.parse_args()
    if args.csv is not None and args.csv.exists():
        sys.exit(f"error: {args.csv} exists; pass another --csv")
    rows = []
    for model, seq, tile, layers, alpha in CASES:
        if args.only and model not in args.only:
            continue
        rows.append(run(model, seq, tile, layers, alpha))
        r = rows[-1]
        print(f"{model} {seq // K}K tiles {tile // K}K {layers} layers alpha {alpha}: recomputed "
              f"{r['recomputed_flops'] / 1e12:.2f} TFLOP ({r['recomputed_ratio']:.3f} of the minimum), copied "
              f"{r['d2h_bytes'] / 2**30:.2f}/{r['h2d_bytes'] / 2**30:.2f} GiB out/back ({r['copied_ratio']:.3f}), "
              f"{r['kernels']} kernels, counted in {r['count_seconds']} s", flush=True)
    table = pandas.DataFrame(rows)
    print(table.to_string(index=False))
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        create_file_atomic(args.csv, f"# python {' '.join(sys.argv)}\n" + table.to_csv(index=False))


if __name__ == "__main__":
    main()
