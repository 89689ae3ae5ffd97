"""Pack step ``documents``: a packed sequence of documents kept apart against the same documents
run one by one.

A Llama-shaped model (grouped keys and values, rotary positions) takes one sequence of documents
(one of a single token, others of lengths around the kernels' tiles) with ``train.document_mask``'s
attention (one causal block per document, on each block kernel documents run on the device:
FlashAttention's, which stands in for cuDNN's, and the memory-efficient one), rotary positions
restarting at each document, and no loss on a token whose label begins the next document; its
layers kept (``none``), swapped (``memo``, α 0.5) and walked in four sequence tiles (``memo``, α
per tile). The reference runs each document alone through whole-sequence causal attention
(``none``). A row per kernel and method: the summed loss's relative error and the largest
normwise relative gradient error (:func:`memo.gpucheck.numerics.relative_errors`), within
:data:`memo.gpucheck.numerics.TOLERANCE` (bf16 on a GPU; fp32 on the CPU, where the suite
asserts agreement to 1e-9 in fp64).

    python -m memo.gpucheck.documents --out DIR [--cpu]
"""

import dataclasses
import sys

import torch

from memo.config import resolve
from memo.execute import distributed
from memo.data.batches import SyntheticTokens
from memo.execute.distributed import ProcessInfo
from memo.gpucheck.common import arguments, compose, placed_model, step_device, write_rows
from memo.gpucheck.numerics import LLAMA_GPU, judged, kernels, relative_errors, say
from memo.model import dtype_setting, head_size
from memo.model.documents import DocumentParams, Documents

# method, α (memo's), tokens per sequence tile as a share of the sequence (None: whole layers)
METHODS = [("none", None, None), ("memo", 0.5, None), ("memo", None, 4)]


def sequence(vocab_size: int, lengths: list[int]) -> tuple[torch.Tensor, int]:
    """``sum(lengths) + 1`` synthetic tokens in documents of ``lengths``, each but the last ending
    with the end-of-document id, and that id (one the synthetic alphabet never draws)."""
    source = SyntheticTokens(vocab_size, 0)
    eod = next(i for i in range(vocab_size) if i not in set(source.alphabet.tolist()))
    tokens = source.sample(0, sum(lengths) + 1)
    for end in torch.tensor(lengths).cumsum(0)[:-1]:
        tokens[end - 1] = eod
    return tokens, eod


def losses_and_grads(model, tokens: torch.Tensor, eod: int, documents=None) -> tuple[float, dict]:
    """The summed loss of the tokens that are not ``eod`` and its gradients (fp32, by name)."""
    inputs, labels = tokens[:-1][None], tokens[1:][None]
    positions = torch.arange(inputs.shape[1], device=tokens.device)[None]
    extra = {} if documents is None else {"packed_seq_params": documents}
    per_token = model(inputs, positions, None, labels=labels, **extra)
    loss = (per_token.float() * (inputs != eod)).sum()
    model.zero_grad()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model_overrides: list[str], lengths: list[int], device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (kernel, method): the packed documents against the documents one by one."""
    seq = sum(lengths)
    settings = [*model_overrides, f"seq={seq}", f"train.dtype={dtype_setting(dtype)}", "train.loss=megatron"]
    rows = []
    distributed.initialize(compose(*settings).parallel, device.type, ProcessInfo(0, 1, 0))
    try:
        run = resolve(compose("method=none", *settings), gpu_visible=device.type == "cuda")
        tokens, eod = sequence(run.workload.model.vocab_size, lengths)
        documents = Documents.of(tokens[:-1], eod)
        tokens = tokens.to(device)
        head_dim = head_size(run.workload.model)
        # (math keeps whole s×s probabilities, which swapping refuses; where cuDNN's kernel runs,
        # documents' blocks run FlashAttention's: memo.model.documents.block_kernel)
        for kernel in [k for k in kernels(device, dtype, head_dim) if k not in ("math", "cudnn")]:
            torch.manual_seed(run.train.seed)
            reference_model, _ = placed_model(run.workload, device, kernel)
            loss, grads = 0.0, None
            for start, end in documents.spans():  # each document alone, its positions from 0
                part_loss, part = losses_and_grads(reference_model, tokens[start:end + 1], eod)
                loss += part_loss
                grads = part if grads is None else {n: grads[n] + g for n, g in part.items()}
            del reference_model
            for method, alpha, tiles in METHODS:
                given = ([] if alpha is None else [f"alpha={alpha}"]) + \
                    ([] if tiles is None else [f"method.tile_tokens={seq // tiles}"])
                packed_run = resolve(compose(f"method={method}", *given, *settings), gpu_visible=device.type == "cuda")
                workload = dataclasses.replace(packed_run.workload, document_mask=True)
                torch.manual_seed(packed_run.train.seed)
                model, placement = placed_model(workload, device, kernel)
                got = losses_and_grads(model, tokens, eod, DocumentParams.of(documents, device))
                placement.release()
                rows.append(judged(relative_errors(*got, (loss, grads)), dtype, model=run.workload.model.name,
                                   kernel=kernel, method=method, alpha=alpha,
                                   tile_tokens=None if tiles is None else seq // tiles, seq=seq,
                                   documents=" ".join(map(str, lengths))))
                say("documents", f"{kernel} {method} alpha={alpha} tiles={tiles}", rows[-1])
                del model, placement
    finally:
        distributed.shutdown()
    return rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device, dtype = step_device(args.cpu)
    overrides = ["model=tiny_llama"]
    # documents of one token and of lengths around the kernels' tile sizes among long ones
    if args.cpu:
        lengths = [100, 1, 39, 116]
    else:
        torch.cuda.set_device(0)
        overrides += LLAMA_GPU
        lengths = [3000, 1, 63, 65, 127, 129, 4807]
    rows = compare(overrides, lengths, device, dtype)
    write_rows(args.out, "documents", rows)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
