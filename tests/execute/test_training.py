"""Real CPU training of the Megatron-core GPT: every method learns, recomputation is exact,
and tensor and data parallelism (two gloo processes) reproduce the one-process run."""

import json
import math
import os
import subprocess

import pytest
import torch
from megatron.core import tensor_parallel

from memo.data.batches import SyntheticTokens, micro_batches
from memo.policy import build_model

from conftest import PYTHON, REPO, free_port, resolve_config, run_in_process
from requirements import deepspeed_missing, require

METHODS = ["none", "megatron_full_recompute", "megatron_selective"]
SHORT = ["seq=256", "train.warmup_steps=1"]


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_the_loss_falls(tmp_path, method):
    row = run_in_process(tmp_path, f"method={method}", "train.steps=8", *SHORT)
    assert row["status"] == "ok", row["error"]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(50304), abs=0.3)  # uniform over the padded vocab
    assert losses[-1] < losses[0] - 0.5
    assert row["tgs"] > 0 and 0 < row["mfu"] < 1 and row["peak_rss_bytes"] > 0
    assert row["steps_timed"] == 7 and row["params"] == 16_037_376


def _one_backward(method: str, loss: str):
    """Loss, gradients and saved-activation bytes of one forward/backward pass (seed 0)."""
    workload = resolve_config(f"method={method}", "seq=256", f"train.loss={loss}").workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    (batch,) = next(micro_batches(SyntheticTokens(50257, 0), 256, 2, 1, 0, 1, torch.device("cpu")))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("loss_name", ["megatron", "tiled"])
@pytest.mark.parametrize("method, checkpoints", [("megatron_full_recompute", 4), ("megatron_selective", 4)])
def test_megatron_recomputation_gives_the_same_gradients(single_process, monkeypatch, method, checkpoints,
                                                         loss_name):
    loss, grads, kept = _one_backward("none", loss_name)
    calls = []
    original = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *a: calls.append(1) or original(*a))
    loss_r, grads_r, kept_r = _one_backward(method, loss_name)
    assert len(calls) == checkpoints  # Megatron's own checkpointing ran, once per layer
    assert kept_r < kept  # and it kept fewer activations for the backward pass
    torch.testing.assert_close(loss_r, loss)
    assert grads_r.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], msg=name)


# The multi-process comparisons: a vocabulary of 1000 tokens (padded to 1024) keeps the output
# layer, which with GPT-2's 50304 took most of each step, small next to the layers whose split is
# compared; the one-process reference runs the same model.
SMALL = ["train.steps=3", *SHORT, "model=tiny", "model.vocab_size=1000", "train.eval_interval=3"]


def _train(*overrides: str) -> str:
    """A check of the session's shared torchrun launch (tests/training_worker.py): the job
    ``overrides`` describe, in as many processes as the launch has."""
    return " ".join(["training_worker.train", *overrides])


def _torchrun(tmp_path, name: str, *overrides: str, processes: int = 2) -> list[dict]:
    out = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
         str(free_port()), str(REPO / "run.py"), f"hydra.run.dir={out}", *overrides],
        check=True, cwd=tmp_path, env=env, timeout=600, capture_output=True,
    )
    row = json.loads((out / "result.json").read_text())
    assert row["status"] == "ok" and row["world_size"] == processes, row["error"]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _launched(result) -> list[dict]:
    """The step log of a job of the shared torchrun launch, once every rank has passed it."""
    result.passed()
    row = json.loads((result.out_dir / "result.json").read_text())
    assert row["status"] == "ok" and row["world_size"] == result.processes, row["error"]
    return [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(tmp_path, name: str, *overrides: str) -> list[dict]:
    row = run_in_process(tmp_path / name, *overrides)
    assert row["status"] == "ok", row["error"]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(got: list[dict], expected: list[dict]) -> None:
    """Step by step, the same loss (1e-4) and gradient norm (1e-4 relative), and where the
    reference validated, the same validation loss by position (the tokens of every rank counted
    at their place in the whole sequence)."""
    for a, b in zip(got, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        if "valid_loss" in b:
            assert a["valid_loss_by_position"] == pytest.approx(b["valid_loss_by_position"], abs=1e-4)
            assert a["valid_loss"] == pytest.approx(b["valid_loss"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.torchrun(2, _train("parallel.tp=2", *SMALL),
                      _train("parallel.tp=2", "parallel.sequence_parallel=true", *SMALL))
def test_tensor_and_sequence_parallel_two_processes_match_one(tmp_path, torchrun_results):
    tp2, sp2 = (_launched(result) for result in torchrun_results)
    tp1 = _steps(tmp_path, "tp1", *SMALL)
    _assert_same_steps(tp2, tp1)
    _assert_same_steps(sp2, tp1)


CP_EXCHANGES = (("all_gather", "megatron"), ("p2p", "tiled"), ("a2a", "tiled"))


@pytest.mark.slow
@pytest.mark.torchrun(2, *(_train("method=memo", *SMALL, f"train.loss={loss}", "parallel.cp=2",
                                  f"parallel.cp_comm_type={comm}") for comm, loss in CP_EXCHANGES))
def test_context_parallel_two_processes_match_one_with_every_exchange(tmp_path, torchrun_results):
    """MEMO (α solved per rank) with the sequence split over two ranks (keys and values
    gathered, passed around a ring, or Ulysses' all-to-all): the losses and gradient norms of the
    one-process run. Megatron's layers under the same split give MEMO's gradients
    (tests/swap/test_swap_runs.py), and the four-process test below runs them against one process."""
    method = "memo"
    one = {loss: _steps(tmp_path, f"cp1-{loss}", f"method={method}", *SMALL, f"train.loss={loss}")
           for loss in ("megatron", "tiled")}
    for (comm, loss), result in zip(CP_EXCHANGES, torchrun_results, strict=True):
        cp2 = _launched(result)
        assert len(cp2) == 3
        _assert_same_steps(cp2, one[loss])
        # the row names the kernels that ran: the CPU's fused one, whole and in blocks
        row = json.loads((result.out_dir / "result.json").read_text())
        assert (row["attention_backend"], row["attention_block_kernel"]) == ("flash", "flash"), comm


ULYSSES = [*(o for o in SMALL if not o.startswith("model=")), "train.loss=megatron"]  # each model below


ULYSSES_MODELS = ("tiny", "tiny_llama")  # the GPT, and grouped keys and values


@pytest.mark.slow
@pytest.mark.torchrun(2, *(_train("method=deepspeed_ulysses", "parallel.cp=2", "parallel.cp_comm_type=a2a",
                                  *ULYSSES, f"model={model}") for model in ULYSSES_MODELS), last=True)
def test_deepspeed_ulysses_two_processes_match_one(tmp_path, request):
    """DeepSpeed's DistributedAttention over two ranks, each one contiguous half of the sequence,
    with full recomputation: the losses and gradient norms of keeping everything in one process."""
    require(deepspeed_missing())
    results = request.getfixturevalue("torchrun_results")
    for model, result in zip(ULYSSES_MODELS, results, strict=True):
        ulysses = _launched(result)
        one = _steps(tmp_path, f"one-{model}", "method=none", *ULYSSES, f"model={model}")
        assert len(ulysses) == 3
        _assert_same_steps(ulysses, one)


@pytest.mark.slow
@pytest.mark.torchrun(4, _train("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                                *SMALL))
def test_tensor_sequence_and_context_parallel_four_processes_match_one(tmp_path, torchrun_results):
    """tp = 2 with sequence parallelism and cp = 2, as the paper's layouts combine them."""
    (result,) = torchrun_results
    four = _launched(result)
    one = _steps(tmp_path, "one", *SMALL)
    assert len(four) == 3
    _assert_same_steps(four, one)


@pytest.mark.slow
def test_data_parallel_two_processes_match_gradient_accumulation(tmp_path):
    """``torchrun run.py`` itself (the other multi-process jobs share one launch of
    tests/training_worker.py): rank 0 writes the row and the step log."""
    dp2 = _torchrun(tmp_path, "dp2", "parallel.dp=2", *SMALL)
    accumulated = _steps(tmp_path, "acc2", "train.micro_batches=2", *SMALL)
    _assert_same_steps(dp2, accumulated)
