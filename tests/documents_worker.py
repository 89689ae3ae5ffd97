"""Under torchrun (a check of ``tests/checks_worker.py``, two processes): documents kept apart
under context parallelism train as the documents one by one. The same packed sequence of three
documents as ``tests/model/test_document_model.py`` (four chunks of 12 tokens: the documents cut
two of the blocks a rank attends and leave others wholly to other documents), split over cp = 2
ranks, for every exchange, without and with MEMO's swapping: each rank's losses are those of its
tokens when every document runs alone, and the ranks' gradients sum to theirs; the loss that
trains (:func:`memo.execute.train.mean_loss`) averages, over the ranks, to the mean of the whole
sequence's counted tokens. Raises at the first difference.

:func:`train` runs a training job on documents kept apart, in the launch's processes, on a tiny
corpus of its own."""

import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from conftest import compose_config
from memo.execute import distributed
from memo.execute.train import mean_loss
from memo.modes.train import run_job
from memo.model.context_parallel import CP_COMM_TYPES, batch_for_rank, split_for_rank
from memo.model.documents import DocumentParams, Documents
from packed_documents import EOD, built, loss_and_grads, one_by_one, sequence
from tiny_corpus import make_corpus

METHODS = [("none", ()), ("memo", ("alpha=0.5",))]
TOLERANCE = 1e-9  # float64; the bound is 1e-6


def check(info: distributed.ProcessInfo, out=None) -> str:
    """Every exchange and method at cp = 2 against the documents run one by one (in this
    process, at cp = 1)."""
    whole = sequence()
    tokens, labels = whole[:-1], whole[1:]
    documents = Documents.of(tokens, EOD)
    distributed.initialize(compose_config("parallel.dp=2").parallel, "cpu", info)
    try:
        reference, _ = built("none")
        alone_losses, alone_grads = one_by_one(reference, tokens, labels, documents)
        del reference
        parallel_state.destroy_model_parallel()  # the same processes as two context-parallel ranks
        parallel_state.initialize_model_parallel(context_parallel_size=2)
        rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
        mine = batch_for_rank({"tokens": tokens[None], "labels": labels[None], "position_ids": documents.position_ids()[None],
                               "documents": DocumentParams.of(documents, "cpu")}, rank, 2)
        kept = mine["tokens"][0] != EOD
        expected_losses = split_for_rank(alone_losses, 0, rank, 2)
        for comm in CP_COMM_TYPES:
            for method, overrides in METHODS:
                what = f"rank {rank}: cp_comm_type={comm} method={method}"
                model, runtime = built(method, "parallel.cp=2", f"parallel.cp_comm_type={comm}", *overrides)
                assert method == "none" or runtime.swapped_units > 0, what
                losses, grads = loss_and_grads(model, mine["tokens"][0], mine["labels"][0], mine["position_ids"][0],
                                               packed_seq_params=mine["documents"])
                torch.testing.assert_close(losses[kept], expected_losses[kept], atol=TOLERANCE, rtol=0,
                                           msg=lambda m: f"{what}: losses: {m}")
                for name, grad in grads.items():
                    dist.all_reduce(grad, group=group)
                    torch.testing.assert_close(grad, alone_grads[name], atol=TOLERANCE, rtol=0,
                                               msg=lambda m, n=name: f"{what}: {n}: {m}")
        share = mean_loss(losses, kept, (tokens != EOD).sum(), 2)
        dist.all_reduce(share, group=group)
        overall = alone_losses[tokens != EOD].mean()
        torch.testing.assert_close(share / 2, overall, atol=TOLERANCE, rtol=0)
    finally:
        distributed.shutdown()
    return f"{len(CP_COMM_TYPES) * len(METHODS)} exchanges and methods train as the documents one by one"


def train(info: distributed.ProcessInfo, out: Path, *overrides: str) -> str:
    """The job ``overrides`` describe, on ``make_corpus``'s 120 documents (rank 0 prepares them,
    the others wait for them: Megatron's dataset builder shares rank 0's index cache); raises
    unless its row says ``ok``."""
    ready = out / "data" / "ready"
    if info.rank == 0:
        prefix, tokenizer, _ = make_corpus(out / "data", count=120)
        (ready.parent / "ready.part").write_text(f"{prefix}\n{tokenizer}")
        (ready.parent / "ready.part").rename(ready)  # (whole when seen)
    else:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert time.monotonic() < deadline, f"rank 0 prepared no corpus in {ready.parent}"
            time.sleep(0.1)
        prefix, tokenizer = ready.read_text().split("\n")
    data = [f"train.data=megatron:{prefix}", f"train.tokenizer={tokenizer}"]
    row = run_job(compose_config(*overrides, *data), out, overrides, info=info)
    assert row["status"] == "ok" and row["world_size"] == info.world_size, row["error"]
    return f"status ok in {out}"
