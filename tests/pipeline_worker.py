"""Pipeline parallelism under torchrun: our model's pipeline stages, run by Megatron-core's
schedule over a step of several micro-batches, next to ``transformers``' model of the same
checkpoint on the whole batch (a check of ``tests/checks_worker.py``'s shared launches)."""

import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo.execute import distributed
from memo.execute.optimizer import HostOptimizer, reduce_gradients
from memo.execute.pipeline import PipelineSchedule, in_flight
from memo.execute.train import TrainingStep, rank_tokens
from memo.model import hf_checkpoint
from memo.policy import build_model, policy_of
from memo.swap.in_flight import InFlight
from memo.swap.tiled_layer import TiledLayers

from conftest import compose_config, resolve_config
from hf_models import LLAMA_3_1_8B, SIZES

SEQ = 64  # tokens of a sequence
MICRO_BATCHES = 4


def make_checkpoint(directory: Path, tied: bool):
    """A tiny Llama (``tiny_llama``'s sizes; its embedding tied to its output layer or not) with
    random weights, saved to ``directory``; returns it (float32, eval mode)."""
    import transformers

    from hf_models import _saved

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA_3_1_8B, "tie_word_embeddings": tied}, **SIZES["tiny_llama"])
    return _saved(transformers.LlamaForCausalLM(config), directory)


def _micro_batches(vocab: int) -> tuple[torch.Tensor, list[dict]]:
    ids = torch.randint(0, vocab, (MICRO_BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).unsqueeze(0)
    return ids, [{"tokens": ids[i:i + 1, :-1], "labels": ids[i:i + 1, 1:], "position_ids": positions}
                 for i in range(MICRO_BATCHES)]


def _theirs(hf, ids: torch.Tensor) -> dict:
    """transformers' mean loss over the batch and its gradients."""
    hf.zero_grad()
    logits = hf(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in hf.named_parameters()}}


def check_gradients(info, out, tied: str, method: str, *overrides: str) -> str:
    """Under torchrun: a step of four micro-batches through our pipeline stages (``overrides``:
    parallel.pp and what else the layout has) with ``method``'s layers, started from a checkpoint
    rank 0 makes (``tied``: "tied" or "untied"): its loss and every gradient (summed over the tied
    embedding's two ends, as the optimizer sums them) equal transformers' on the whole batch."""
    import transformers

    directory = Path(out) / "checkpoint"
    settings = ("model=hf", f"model.init_from={directory}", f"seq={SEQ}", f"method={method}",
                f"train.micro_batches={MICRO_BATCHES}", *overrides)
    distributed.initialize(compose_config(*settings).parallel, "cpu", info)
    runtime = None
    try:
        if info.rank == 0:
            make_checkpoint(directory, tied == "tied")
        dist.barrier()
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        run = resolve_config(*settings)
        built = build_model(run.workload, "cpu")
        hf_checkpoint.load(built.chunks, run.workload.model, directory)
        parallel = run.workload.parallel
        counts = in_flight(parallel.pp, parallel_state.get_pipeline_model_parallel_rank(), MICRO_BATCHES, parallel.vpp)
        runtime = policy_of(run.workload).prepare_stage(built.chunks, run.workload, torch.device("cpu"), 2**34, counts)
        pipeline = PipelineSchedule(built.chunks, "cpu", SEQ, 1, runtime)
        ranks_tokens = rank_tokens(policy_of(run.workload).layers.sequence_layout)
        step = TrainingStep(HostOptimizer(built.chunks, run.train), "cpu",
                            lambda micro_batch: runtime.token_order(ranks_tokens(micro_batch)), pipeline=pipeline)
        ids, batch = _micro_batches(hf.config.vocab_size)
        loss = step._pipelined(batch)
        # (under context parallelism each rank's loss is its tokens' mean: the mean over them the batch's)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(loss, group=group)
        loss /= dist.get_world_size(group)
        reduce_gradients(built.chunks)
        if isinstance(runtime, InFlight):  # a runtime per micro-batch in flight, a walk's stores once per chunk
            assert runtime.counts == counts
            for walks in runtime.by_chunk:
                if isinstance(walks[0], TiledLayers):
                    assert all(walk.stores is walks[0].stores is not None for walk in walks)
        ours = hf_checkpoint.gather(built.chunks, run.workload.model, grads=True)
        theirs = _theirs(hf, ids)
        torch.testing.assert_close(loss, theirs["loss"])
        assert ours.keys() == theirs["grads"].keys() - ({"lm_head.weight"} if tied == "tied" else set())
        for name, grad in ours.items():
            torch.testing.assert_close(grad, theirs["grads"][name], msg=lambda m, n=name: f"{n}: {m}")
    finally:
        if runtime is not None:
            runtime.release()
        distributed.shutdown()
    return f"{method}, {tied}, {' '.join(overrides)}: loss and {len(ours)} gradients equal transformers'"


def train(info, out, tied: str, *overrides: str) -> str:
    """Under torchrun: the training job ``overrides`` describe, started from the checkpoint
    :func:`make_checkpoint` makes (``tied``: "tied" or "untied") and reading ``make_corpus``'s 120
    documents, both made by rank 0 into ``out`` (the same files any process makes), in as many
    processes as the launch has; raises unless its row says ``ok``."""
    from memo.modes.train import run_job

    from tiny_corpus import make_corpus

    out = Path(out)
    ready = out / "ready"
    if info.rank == 0:
        make_checkpoint(out / "checkpoint", tied == "tied")
        prefix, tokenizer, _ = make_corpus(out / "data", count=120)
        (out / "ready.part").write_text(f"{prefix}\n{tokenizer}")
        (out / "ready.part").rename(ready)  # (whole when seen)
    deadline = time.monotonic() + 120
    while not ready.exists():  # (a failing rank 0 ends the launch)
        assert time.monotonic() < deadline, f"rank 0 made no checkpoint and corpus in {out} within 120 s"
        time.sleep(0.1)
    prefix, tokenizer = ready.read_text().split("\n")
    settings = ("model=hf", f"model.init_from={out / 'checkpoint'}", f"train.data=megatron:{prefix}",
                f"train.tokenizer={tokenizer}", *overrides)
    row = run_job(compose_config(*settings), out / "run", settings, info=info)
    assert row["status"] == "ok" and row["world_size"] == info.world_size, row["error"]
    return f"status ok in {out / 'run'}"


def check_stages_draw_their_own_layers(info, out, *overrides: str) -> str:
    """Under torchrun, a stage per rank (``overrides``: parallel.pp and the model): from one seed,
    each stage's first layer is drawn apart from every other's (Megatron-LM seeds stage r with
    seed + 100·r), not the same numbers again."""
    run = resolve_config(*overrides)
    distributed.initialize(run.workload.parallel, "cpu", info)
    try:
        torch.manual_seed(run.train.seed)
        weight = build_model(run.workload, "cpu").module.decoder.layers[0].self_attention.linear_qkv.weight
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, weight.detach().clone())
    finally:
        distributed.shutdown()
    for i, a in enumerate(stages):
        for b in stages[i + 1:]:
            assert not torch.equal(a, b), "two stages drew the same first layer"
    return f"{len(stages)} stages drew {len(stages)} different first layers"
