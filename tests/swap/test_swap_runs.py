"""Jobs with MEMO's methods, end to end: result rows, host-memory limits, long training on
text, and tensor plus sequence parallelism in two processes."""

import json

import pytest

from conftest import run_in_process
from tiny_corpus import make_corpus

SHORT = ["seq=256", "train.steps=2", "train.warmup_steps=1", "model.vocab_size=1000"]  # (GPT-2's 50257: a step of its output layer)


def test_a_row_of_memo_records_alpha_and_why(tmp_path):
    row = run_in_process(tmp_path, "method=memo", *SHORT)
    assert row["status"] == "ok", row["error"]
    assert row["swap.alpha_binding"] in ("bandwidth", "host", "none")
    assert 0 <= row["swap.alpha"] <= 1 and row["swap.keep_tokens"] == round(row["swap.alpha"] * 256)
    assert row["swap.layer_time_s"] > 0 and row["swap.host_bandwidth_bytes_per_s"] > 0
    assert row["swap.host_bytes"] == 2 * (
        row["swap.skeletal_input_bytes"] + row["swap.skeletal_attention_bytes"]
        + row["swap.keep_tokens"] * row["swap.skeletal_other_bytes"] // 256
    )
    layers = [json.loads(line) for line in (tmp_path / "layers.jsonl").read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in layers] == [(s, i) for s in (1, 2) for i in range(4)]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["skeletal_host_bytes"] == row["swap.host_bytes"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["hardware.host_memory_gib=0.0001"], "alpha=0 swaps"),
        (["alpha=1", "hardware.host_memory_gib=0.005"], "alpha=1 swaps"),
    ],
)
def test_activations_that_do_not_fit_the_host_are_oohm_before_training(tmp_path, overrides, fragment):
    row = run_in_process(tmp_path, "method=memo", *SHORT, *overrides)
    assert row["status"] == "oohm" and fragment in row["error"], row["error"]
    assert row["iter_time_s"] is None and not (tmp_path / "metrics.jsonl").exists()



def _losses(path):
    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_gradient_accumulation_swaps_each_micro_batch(tmp_path):
    common = [*SHORT, "train.micro_batches=2", "model.num_layers=5"]
    steps = {}
    for name, overrides in [("none", []), ("memo", ["method=memo", "alpha=0.25"])]:
        row = run_in_process(tmp_path / name, *common, *overrides)
        assert row["status"] == "ok", row["error"]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        steps[name] = [json.loads(line) for line in lines]
    for a, b in zip(steps["memo"], steps["none"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # three swapped layers, two micro-batches a step: every one was sent out and brought back
    assert steps["memo"][0]["skeletal_host_bytes"] == 2 * row["swap.host_bytes"]


@pytest.mark.slow
def test_fifty_steps_on_a_prepared_corpus_follow_the_loss_of_keeping_everything(tmp_path):
    # a corpus of its own, prepared into Megatron's format and packed by megatron-core's dataset
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=300)
    # the same loss for both (memo's default); the losses are compared, not their implementations.
    # A vocabulary of 64 (GPT-2's 50257 would spend each step on the output layer).
    common = ["seq=128", "train.steps=50", "train.warmup_steps=1", f"train.data=megatron:{prefix}",
              f"train.tokenizer={tokenizer}", "train.loss=tiled", "model.vocab_size=64"]
    reference = run_in_process(tmp_path / "none", *common)
    assert reference["status"] == "ok", reference["error"]
    expected = _losses(tmp_path / "none")
    assert expected[-1] < expected[0] - 2  # it learns the grammar
    # half the tokens swapped and half recomputed: both paths, over many steps (α's edges are checked step
    # for step, gradient for gradient, in test_swap_runtime.py)
    row = run_in_process(tmp_path / "memo", *common, "method=memo", "alpha=0.5")
    assert row["status"] == "ok", row["error"]
    assert _losses(tmp_path / "memo") == pytest.approx(expected, abs=1e-5)


# One torchrun launch of two processes checks every two-process layout (with the other
# two-process checks of the session: tests/checks_worker.py), one of four the four-process one.
@pytest.mark.slow
@pytest.mark.torchrun(2, "swap_worker.check_layout tp2-sp")
def test_tensor_and_sequence_parallel_gradients_match_in_two_processes(torchrun_results):
    (result,) = torchrun_results
    assert result.passed() == ("6 methods match over 2 steps with tiled (tp2-sp)",) * 2


@pytest.mark.slow
@pytest.mark.parametrize("layout, processes, loss", [
    pytest.param(layout, processes, loss, id=f"{layout}-{processes}-{loss}",
                 marks=pytest.mark.torchrun(processes, f"swap_worker.check_layout {layout}"))
    for layout, processes, loss in [("cp2", 2, "tiled"), ("cp2-p2p", 2, "megatron"), ("cp2-a2a", 2, "tiled"),
                                    ("tp2-sp-cp2", 4, "megatron")]])
def test_context_parallel_gradients_match_keeping_everything(torchrun_results, layout, processes, loss):
    """MEMO's swapping and recomputation of each rank's own tokens (α per load-balanced chunk),
    full swapping and full recomputation: the gradients of keeping everything, with the sequence
    split over ranks by every exchange."""
    (result,) = torchrun_results
    assert result.passed() == (f"4 methods match over 2 steps with {loss} ({layout})",) * processes


# Grouped keys and values split over tp, and over cp by Ulysses' heads (the other exchanges pass
# keys and values whole, and a rank swaps only its own tokens' tensors: the GPT's checks above)
LLAMA_LAYOUTS = [("tp2-sp", "tiled"), ("cp2-a2a", "tiled")]


@pytest.mark.slow
@pytest.mark.torchrun(2, *(f"swap_worker.check_layout {layout} tiny_llama" for layout, _ in LLAMA_LAYOUTS))
def test_llama_shaped_gradients_of_every_method_match_keeping_everything_in_two_processes(torchrun_results):
    """Grouped keys and values, SwiGLU, RMSNorm and an untied output layer under tensor and
    sequence parallelism and under Ulysses' exchange of heads: MEMO's variants and Megatron's own
    recomputations give keeping everything's gradients (which equal transformers',
    tests/model/test_hf_models.py)."""
    for (layout, loss), result in zip(LLAMA_LAYOUTS, torchrun_results, strict=True):
        assert result.passed() == (f"5 methods match over 2 steps with {loss} (tiny_llama, {layout})",) * 2


DOCUMENTS = ["seq=128", "train.steps=4", "train.warmup_steps=1", "train.loss=tiled", "model.vocab_size=64",
             "train.eval_interval=2", "train.eval_buckets=4", "train.data_split='80,20,0'"]
# two context-parallel ranks (whose tokens end documents unevenly) passing keys and values on a ring
DOCUMENTS_CP2 = [*DOCUMENTS, "train.document_mask=true", "parallel.cp=2", "parallel.cp_comm_type=p2p", "method=memo",
                 "alpha=0.5"]
# the frontier's recipe at tiny size: memo in tiles under tensor and sequence parallelism, with the
# memory plan, documents kept apart and validation walked in tiles
TILES = ["method=memo", "method.tile_tokens=32", "plan=true"]
DOCUMENTS_TP2 = [*DOCUMENTS, "train.document_mask=true", "parallel.tp=2", "parallel.sequence_parallel=true", *TILES]


@pytest.mark.torchrun(2, " ".join(["documents_worker.train", *DOCUMENTS_CP2]),
                      " ".join(["documents_worker.train", *DOCUMENTS_TP2]))
def test_documents_kept_apart_train_alike_with_memo_and_keeping_everything(tmp_path, torchrun_results):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=120)
    common = [*DOCUMENTS, f"train.data=megatron:{prefix}", f"train.tokenizer={tokenizer}"]
    rows = {name: run_in_process(tmp_path / name, *common, *overrides) for name, overrides in [
        ("none", ["train.document_mask=true"]), ("memo", ["train.document_mask=true", "method=memo", "alpha=0.5"]),
        ("tiles", ["train.document_mask=true", *TILES]), ("across", [])]}
    launched = dict(zip(("cp2", "tp2"), torchrun_results, strict=True))
    for name, result in launched.items():
        result.passed()
        rows[name] = json.loads((result.out_dir / "result.json").read_text())
    assert {name: row["status"] for name, row in rows.items()} == dict.fromkeys(rows, "ok"), rows
    losses = {name: _losses(launched[name].out_dir if name in launched else tmp_path / name) for name in rows}
    assert losses["memo"] == pytest.approx(losses["none"], abs=1e-5)
    assert losses["tiles"] == pytest.approx(losses["none"], abs=1e-5)
    # (float32 sums in another order, which Adam's first steps amplify, as the other multi-process
    # comparisons allow; tests/documents_worker.py checks cp = 2 in float64 to 1e-9)
    assert losses["cp2"] == pytest.approx(losses["none"], abs=1e-4)
    assert losses["tp2"] == pytest.approx(losses["none"], abs=1e-4)
    assert losses["none"] != pytest.approx(losses["across"], abs=1e-3)  # the documents did not see each other
    # the tiles walked, and the plan served the steps after the one it recorded (on the CPU: it
    # matched the run's requests, all but the blocks that documents cut into parts of their own)
    assert rows["tiles"]["tiles.tile_tokens"] == 32 and rows["tiles"]["plan.served"] > 0
    assert rows["tp2"]["tiles.tile_tokens"] == 32
    for name, tolerance in (("memo", 1e-5), ("tiles", 1e-5), ("cp2", 1e-4), ("tp2", 1e-4)):
        assert rows[name]["valid_loss"] == pytest.approx(rows["none"]["valid_loss"], abs=tolerance)
        assert rows[name]["valid_loss_by_position"][:3] == pytest.approx(rows["none"]["valid_loss_by_position"][:3],
                                                                         abs=tolerance)
    # positions count within documents (of 6 to 40 tokens here): the last half of 128 has none
    assert len(rows["none"]["valid_loss_by_position"]) == 4 and rows["none"]["valid_loss_by_position"][3] is None
    assert rows["across"]["valid_loss_by_position"][3] is not None
    # MFU of the attention computed, each step's documents' squares, beside the paper's
    steps = [json.loads(line) for line in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < s["document_squared_tokens"] < 128**2 for s in steps)
    cp2_steps = [json.loads(line) for line in (launched["cp2"].out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["document_squared_tokens"] for s in cp2_steps] == [s["document_squared_tokens"] for s in steps]
    assert 0 < rows["none"]["mfu_documents"] < rows["none"]["mfu"] and rows["across"]["mfu_documents"] is None
