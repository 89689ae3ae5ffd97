"""A packed sequence of documents kept apart trains as its documents one by one: the loss of
every token that does not end a document, and every gradient, of a Llama-shaped model (grouped
heads, rotary positions) with Megatron's own layers and with MEMO's swapping."""

import dataclasses

import pytest
import torch

from conftest import resolve_config
from memo.model import build_gpt
from memo.model.documents import DocumentParams, Documents
from memo.swap import prepare_swap
from memo.swap.streams import InlineStreams

EOD = 0
LENGTHS = (13, 6, 29)  # three documents, the last one cut by the sequence's end
SEQ = sum(LENGTHS)


def _sequence() -> torch.Tensor:
    """``SEQ + 1`` tokens: three documents, each but the last ending with EOD."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for i, n in enumerate(LENGTHS):
        body = torch.randint(1, 64, (n,), generator=g)
        if i < len(LENGTHS) - 1:
            body[-1] = EOD
        parts.append(body)
    return torch.cat([*parts, torch.randint(1, 64, (1,), generator=g)])


def _built(method: str, *overrides: str):
    run = resolve_config("model=tiny_llama", "model.vocab_size=64", f"seq={SEQ}", "train.dtype=fp64",
                         f"method={method}", "train.loss=megatron", *overrides)
    # (train.document_mask asks for Megatron data, which these tokens are not)
    workload = dataclasses.replace(run.workload, document_mask=True)
    torch.manual_seed(run.train.seed)
    model = build_gpt(workload, "cpu").module
    runtime, _ = prepare_swap(model, workload, torch.device("cpu"), 2**40, run.alpha, InlineStreams())
    return model, runtime


def _loss_and_grads(model, tokens, labels, **kwargs):
    """Per-token losses and the gradients of their sum over tokens that are not an EOD (whose
    label is the next document's first token)."""
    positions = torch.arange(tokens.shape[0])[None]
    per_token = model(tokens[None], positions, None, labels=labels[None], **kwargs)[0]
    kept = tokens != EOD
    model.zero_grad()
    (per_token * kept).sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method, overrides", [
    ("none", ()), ("memo", ("alpha=0.5",)), ("memo", ("method.tile_tokens=16",)),
    ("full_recompute", ("method.tile_tokens=16",))], ids=["none", "memo", "memo-tiles", "full_recompute-tiles"])
def test_packed_documents_train_as_the_documents_one_by_one(single_process, method, overrides):
    sequence = _sequence()
    tokens, labels = sequence[:-1], sequence[1:]
    documents = Documents.of(tokens, EOD)
    assert [end - start for start, end in documents.spans()] == list(LENGTHS)

    reference, _ = _built("none")
    alone_losses, alone_grads = [], None
    for start, end in documents.spans():
        losses, grads = _loss_and_grads(reference, tokens[start:end], labels[start:end])
        alone_losses.append(losses)
        alone_grads = grads if alone_grads is None else {n: alone_grads[n] + g for n, g in grads.items()}

    model, runtime = _built(method, *overrides)
    packed_losses, packed_grads = _loss_and_grads(model, tokens, labels,
                                                  packed_seq_params=DocumentParams.of(documents, "cpu"))
    if method == "memo" and not overrides[0].startswith("method.tile_tokens"):
        assert runtime.swapped_units > 0  # swapping ran
    elif method != "none":
        assert runtime.tile_tokens == 16  # the layers walked in tiles of 16 tokens, across documents
    kept = tokens != EOD
    torch.testing.assert_close(packed_losses[kept], torch.cat(alone_losses)[kept], atol=1e-9, rtol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=1e-9, rtol=0, msg=name)
    # and not what the same sequence gives when its documents see each other
    across, _ = _loss_and_grads(reference, tokens, labels)
    assert (across - packed_losses)[LENGTHS[0]:][kept[LENGTHS[0]:]].abs().max() > 1e-3


@pytest.mark.parametrize("overrides, message", [
    ([], "train.document_mask needs documents, which train.data=synthetic does not mark"),
    (["train.data=megatron:x", "train.micro_batch_size=2"], "set train.micro_batch_size=1 \\(not 2\\)"),
    (["train.data=megatron:x", "plan=true"], "set plan=false or train.document_mask=false"),
    (["train.data=megatron:x", "parallel.cp=2"], "set parallel.cp=1"),
    (["train.data=megatron:x", "mode=fit"], "mode=fit traces and predicts attention over whole sequences"),
    (["train.data=megatron:x", "method=deepspeed_ulysses"], "not in method=deepspeed_ulysses's"),
    (["train.data=megatron:x", "parallel.tp=2", "parallel.sequence_parallel=true", "method=memo"],
     "set parallel.sequence_parallel=false"),
])
def test_documents_where_they_cannot_be_kept_apart_are_one_line(overrides, message):
    from memo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve_config("train.document_mask=true", *overrides)
