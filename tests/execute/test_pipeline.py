"""Pipeline parallelism: Megatron-core's schedules over our model's stages give one stage's loss
and gradients (transformers' own, which one stage equals: tests/model/test_hf_models.py), with
every method, tied and untied, 1F1B and interleaved, with tensor and context parallelism; a
pipelined run trains, validates, saves and exports as one stage does."""

import dataclasses
import json

import pytest
import safetensors.torch

from conftest import run_in_process
from memo.config import ConfigError, FitConfig
from memo.fit.predict import Problem, predict, prediction_hardware
from memo.hardware import HARDWARE, GiB
from memo.execute.pipeline import in_flight
from memo.modes.export import export
from pipeline_worker import make_checkpoint
from tiny_corpus import make_corpus

from conftest import resolve_config

METHODS = (("none",), ("megatron_full_recompute",), ("memo", "alpha=0.5"), ("memo", "alpha=0.5", "method.tile_tokens=16"))


def _gradients(tied: str, method: tuple[str, ...], *layout: str) -> str:
    return " ".join(["pipeline_worker.check_gradients", tied, *method, *layout])


TWO_STAGES = [_gradients(tied, method, "parallel.pp=2") for method in METHODS for tied in ("untied", "tied")]
INTERLEAVED = [_gradients("tied", method, "parallel.pp=2", "parallel.vpp=2") for method in METHODS[2:]]


def _answered(results) -> list[str]:
    return [message for result in results for message in result.passed()[:1]]


@pytest.mark.torchrun(2, *TWO_STAGES, *INTERLEAVED)
def test_two_stages_give_the_losses_and_gradients_of_one_with_every_method(torchrun_results):
    """A step of four micro-batches through two stages (1F1B: the first stage holds two in flight,
    each in MEMO's buffers of its own), and through two interleaved chunks on each: the loss and
    every gradient (a tied embedding's two ends summed) of transformers' model on the batch."""
    for message in _answered(torchrun_results):
        assert "gradients equal transformers'" in message


FOUR = [_gradients("tied", method, "parallel.pp=2", *layout) for method in METHODS[2:]
        for layout in (("parallel.tp=2", "parallel.sequence_parallel=true"), ("parallel.cp=2",))]
# four stages of one layer each: the middle ones hold neither the embedding nor the loss
DEEP = [_gradients("tied", ("memo", "alpha=0.5"), "parallel.pp=4"),
        "pipeline_worker.check_stages_draw_their_own_layers model=tiny model.vocab_size=1000 parallel.pp=4"]


@pytest.mark.slow
@pytest.mark.torchrun(4, *FOUR, *DEEP)
def test_two_stages_with_tensor_or_context_parallelism_and_four_stages_give_the_gradients_of_one(
        torchrun_results):
    *gradients, drawn = _answered(torchrun_results)
    for message in gradients:
        assert "gradients equal transformers'" in message
    assert drawn == "4 stages drew 4 different first layers"


def test_micro_batches_in_flight_follow_the_schedules():
    # 1F1B: pipeline rank r of pp holds pp − r (its warm-up and one more), fewer if the step has fewer
    assert [in_flight(4, r, 8) for r in range(4)] == [[4], [3], [2], [1]]
    assert in_flight(4, 0, 2) == [2] and in_flight(1, 0, 8) == [1]
    # interleaved, pp = vpp = 2, four micro-batches in groups of two: rank 0 forwards four chunk
    # passes before its first backward (chunk 0 of micro-batches 0, 1, then chunk 1 of them), then
    # chunk 0 of 2 and 3 while chunk 1 drains: all four of chunk 0 at once; rank 1's last chunk
    # (the loss) goes backward as soon as it goes forward
    assert in_flight(2, 0, 4, vpp=2) == [4, 2]
    assert in_flight(2, 1, 4, vpp=2) == [3, 1]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.vpp=2"], "parallel.vpp=2 interleaves pipeline stages, and parallel.pp=1"),
    (["parallel.pp=2", "parallel.vpp=4"], r"parallel.pp·vpp = 2·4 does not divide model.num_layers=4"),
    (["parallel.pp=2", "parallel.vpp=2", "train.micro_batches=3"], "set train.micro_batches to a multiple of 2"),
    (["parallel.pp=2", "plan=true", "train.micro_batches=1"], "set parallel.pp=1 or plan=false"),
    (["parallel.pp=2", "method=megatron_full_recompute", "method.recompute_num_layers=3"],
     "groups larger than a model chunk's 2 .* set it to at most 2"),
    (["parallel=search", "parallel.vpp=2", "mode=fit"], "set parallel.vpp=1"),
])
def test_pipeline_settings_that_cannot_run_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config("model=tiny", *overrides)


# memo in whole layers, packed documents kept apart, validation, a checkpoint at step 2
RUN = ["seq=128", "train.steps=3", "train.warmup_steps=1", "train.micro_batches=4", "method=memo", "alpha=0.5",
       "train.document_mask=true", "train.eval_interval=3", "train.eval_buckets=4", "train.save_interval=2",
       "train.data_split='80,20,0'"]


def _steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.torchrun(2, " ".join(["pipeline_worker.train", "untied", "parallel.pp=2", *RUN]))
def test_a_pipelined_run_trains_validates_saves_and_exports_as_one_stage(tmp_path, torchrun_results):
    (result,) = torchrun_results
    result.passed()
    pipelined = result.out_dir / "run"
    make_checkpoint(tmp_path / "checkpoint", tied=False)
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=120)
    common = ["model=hf", f"model.init_from={tmp_path / 'checkpoint'}", f"train.data=megatron:{prefix}",
              f"train.tokenizer={tokenizer}", *RUN]
    one = run_in_process(tmp_path / "one", *common)
    two = json.loads((pipelined / "result.json").read_text())
    assert one["status"] == two["status"] == "ok", (one["error"], two["error"])
    for a, b in zip(_steps(pipelined), _steps(tmp_path / "one"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a.get("document_squared_tokens") == b.get("document_squared_tokens")
    assert two["valid_loss"] == pytest.approx(one["valid_loss"], abs=1e-4)
    assert two["valid_loss_by_position"][:2] == pytest.approx(one["valid_loss_by_position"][:2], abs=1e-4)
    assert two["params"] == one["params"] and two["pipeline.in_flight"] == 2  # (rank 0's: micro-batches 2)
    # the two stages' checkpoint of step 2, loaded by one stage, goes on as the uninterrupted run
    saved = pipelined / "checkpoints" / "step_0000002"
    went_on = run_in_process(tmp_path / "went_on", *common, f"train.load={saved}", "train.save_interval=null")
    assert went_on["status"] == "ok" and went_on["resumed_from_step"] == 2, went_on["error"]
    assert _steps(tmp_path / "went_on")[-1]["loss"] == pytest.approx(_steps(tmp_path / "one")[-1]["loss"], abs=1e-4)
    # and exports the weights one stage's step 2 has
    export(saved, tmp_path / "hf_two", tokenizer="none")
    export(tmp_path / "one" / "checkpoints" / "step_0000002", tmp_path / "hf_one", tokenizer="none")
    ours, theirs = (safetensors.torch.load_file(tmp_path / name / "model.safetensors") for name in ("hf_two", "hf_one"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].sub(tensor).abs().max() < 1e-5, name


# memo in whole layers at 2K tokens over two stages of four layers: rank 0 holds two micro-batches in flight
STAGE = ["method=memo", "alpha=0.5", "seq=2k", "train.steps=2", "train.warmup_steps=1", "train.micro_batches=4",
         "model=tiny", "model.num_layers=8", "model.vocab_size=1000", "parallel.pp=2"]


@pytest.mark.torchrun(2, " ".join(["training_worker.train", *STAGE]))
def test_the_first_stages_buffers_host_bytes_and_resident_layers_are_predicted(torchrun_results):
    """The first stage of two as training allocates it on the CPU (rank 0's row: its two runtimes,
    one per micro-batch in flight, each with its rounding buffers and host slab, each swapping two
    of its four layers), against the fit's first stage: within 10%, as one stage's prediction is
    held (tests/fit/test_fit.py)."""
    (result,) = torchrun_results
    result.passed()
    row = json.loads((result.out_dir / "result.json").read_text())
    step = json.loads((result.out_dir / "metrics.jsonl").read_text().splitlines()[-1])
    run = resolve_config(*STAGE)
    cpu = prediction_hardware(dataclasses.replace(HARDWARE["cpu"], peak_flops=1e11, device_memory_bytes=16 * GiB,
                                                  host_memory_bytes=16 * GiB, host_link_bytes_per_s=1e10))
    workload = dataclasses.replace(run.workload, dtype="fp32")
    prediction = predict(Problem(workload, hardware=cpu, fit=FitConfig(), micro_batches=4), run.workload.parallel, 2048)
    assert row["pipeline.in_flight"] == 2
    assert prediction.rounding_buffers == pytest.approx(row["swap.rounding_buffer_bytes"], rel=0.10)
    assert row["swap.swapped_layers"] == 2 and row["swap.host_bytes"] > 0
    assert prediction.host_per_device == pytest.approx(row["swap.host_bytes"], rel=0.10)
    assert prediction.rounding_buffers + prediction.acts.skeletal == pytest.approx(step["skeletal_device_bytes"],
                                                                                   rel=0.10)
