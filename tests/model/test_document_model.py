"""A packed sequence of documents kept apart trains as its documents one by one: the loss of
every token that does not end a document, and every gradient, of a Llama-shaped model (grouped
heads, rotary positions) with Megatron's own layers and with MEMO's swapping."""

import pytest
import torch

from conftest import resolve_config
from memo.model.documents import DocumentParams, Documents
from packed_documents import EOD, LENGTHS, built, loss_and_grads, one_by_one, sequence


@pytest.mark.parametrize("method, overrides", [
    ("none", ()), ("memo", ("alpha=0.5",)), ("memo", ("method.tile_tokens=16",)),
    ("full_recompute", ("method.tile_tokens=16",))], ids=["none", "memo", "memo-tiles", "full_recompute-tiles"])
def test_packed_documents_train_as_the_documents_one_by_one(single_process, method, overrides):
    whole = sequence()
    tokens, labels = whole[:-1], whole[1:]
    documents = Documents.of(tokens, EOD)
    assert [end - start for start, end in documents.spans()] == list(LENGTHS)

    reference, _ = built("none")
    alone_losses, alone_grads = one_by_one(reference, tokens, labels, documents)

    model, runtime = built(method, *overrides)
    packed_losses, packed_grads = loss_and_grads(model, tokens, labels,
                                                 packed_seq_params=DocumentParams.of(documents, "cpu"))
    if method == "memo" and not overrides[0].startswith("method.tile_tokens"):
        assert runtime.swapped_units > 0  # swapping ran
    elif method != "none":
        assert runtime.tile_tokens == 16  # the layers walked in tiles of 16 tokens, across documents
    kept = tokens != EOD
    torch.testing.assert_close(packed_losses[kept], alone_losses[kept], atol=1e-9, rtol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=1e-9, rtol=0, msg=name)
    # and not what the same sequence gives when its documents see each other
    across, _ = loss_and_grads(reference, tokens, labels)
    assert (across - packed_losses)[LENGTHS[0]:][kept[LENGTHS[0]:]].abs().max() > 1e-3


@pytest.mark.parametrize("overrides, message", [
    ([], "train.document_mask needs documents, which train.data=synthetic does not mark"),
    (["train.data=megatron:x", "train.micro_batch_size=2"], "set train.micro_batch_size=1 \\(not 2\\)"),
    (["train.data=megatron:x", "parallel.cp=2", "method=memo", "method.tile_tokens=16"],
     "set parallel.cp=1 or method.tile_tokens=whole \\(not 16\\)"),
    (["train.data=megatron:x", "train.attention_backend=te"], "set train.attention_backend to flash, cudnn or efficient"),
    (["train.data=megatron:x", "mode=profile"], "mode=profile traces attention over whole sequences"),
    (["fit.document_tokens=4k", "mode=fit", "train.document_mask=false"], "set train.document_mask=true as well"),
    (["train.data=megatron:x", "fit.document_tokens=4k"], "mode=train reads its documents from train.data"),
    (["train.data=megatron:x", "method=deepspeed_ulysses"], "not in method=deepspeed_ulysses's"),
])
def test_documents_where_they_cannot_be_kept_apart_are_one_line(overrides, message):
    from memo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve_config("train.document_mask=true", *overrides)


@pytest.mark.torchrun(2, "documents_worker.check")
def test_packed_documents_under_context_parallelism_train_as_the_documents_one_by_one(torchrun_results):
    (result,) = torchrun_results  # in the session's launch of two processes
    assert result.passed() == ("6 exchanges and methods train as the documents one by one",) * 2


def test_mode_fit_predicts_documents_of_the_length_it_is_given():
    run = resolve_config("train.document_mask=true", "mode=fit", "fit.document_tokens=4k", "seq=16k")
    assert (run.workload.document_tokens, run.workload.attended_tokens) == (4096, 4096)
    # without a length, one document of the whole sequence: attention's work as without documents
    assert resolve_config("train.document_mask=true", "mode=fit", "seq=16k").workload.attended_tokens == 16384
