"""A packed sequence of three documents and the tiny Llama model they train, for the checks that
documents kept apart train as the documents one by one (``tests/model/test_document_model.py``
in one process, ``tests/documents_worker.py`` under context parallelism)."""

import dataclasses

import torch

from conftest import resolve_config
from memo.policy import build_model, policy_of
from memo.swap.streams import InlineStreams

EOD = 0
LENGTHS = (13, 6, 29)  # three documents, the last one cut by the sequence's end
SEQ = sum(LENGTHS)  # 48: four chunks of 12 tokens under cp = 2, which the documents cut and skip


def sequence() -> torch.Tensor:
    """``SEQ + 1`` tokens: three documents, each but the last ending with EOD."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for i, n in enumerate(LENGTHS):
        body = torch.randint(1, 64, (n,), generator=g)
        if i < len(LENGTHS) - 1:
            body[-1] = EOD
        parts.append(body)
    return torch.cat([*parts, torch.randint(1, 64, (1,), generator=g)])


def built(method: str, *overrides: str):
    """The tiny Llama model (float64) of ``method``, its weights drawn from the run's seed, and
    its layer runtime (a ``NullRuntime`` where it places nothing); Megatron's parallel state must match
    ``overrides``' ``parallel.*``."""
    run = resolve_config("model=tiny_llama", "model.vocab_size=64", f"seq={SEQ}", "train.dtype=fp64",
                         f"method={method}", "train.loss=megatron", *overrides)
    # (train.document_mask asks for Megatron data, which these tokens are not)
    workload = dataclasses.replace(run.workload, document_mask=True)
    torch.manual_seed(run.train.seed)
    model = build_model(workload, "cpu").module
    runtime = policy_of(workload).prepare(model, workload, torch.device("cpu"), 2**40, InlineStreams())
    return model, runtime


def loss_and_grads(model, tokens, labels, positions=None, **kwargs):
    """Per-token losses and the gradients of their sum over tokens that are not an EOD (whose
    label is the next document's first token)."""
    positions = torch.arange(tokens.shape[0])[None] if positions is None else positions[None]
    per_token = model(tokens[None], positions, None, labels=labels[None], **kwargs)[0]
    kept = tokens != EOD
    model.zero_grad()
    (per_token * kept).sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def one_by_one(model, tokens, labels, documents):
    """The per-token losses and summed gradients of ``documents``' documents, each run alone."""
    losses, summed = [], None
    for start, end in documents.spans():
        part, grads = loss_and_grads(model, tokens[start:end], labels[start:end])
        losses.append(part)
        summed = grads if summed is None else {n: summed[n] + g for n, g in grads.items()}
    return torch.cat(losses), summed
