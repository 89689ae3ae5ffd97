"""Validation: the loss by position bucket equals the per-token losses of a forward pass
bucketed by hand; a run logs it at its interval and in its row; bad settings are one line."""

import json

import pytest
import torch

from conftest import resolve_config, run_in_process
from memo.data.batches import SyntheticTokens, micro_batches
from memo.execute.evaluate import ValidationSamples, bucket_bounds, validation_loss
from memo.policy import build_model


def test_bucket_bounds_cover_the_sequence_in_equal_spans():
    assert bucket_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert bucket_bounds(64, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]


def _tiny_model_and_source(seq: int):
    """The tiny model for ``seq`` tokens (seed 0) and a synthetic source of its vocabulary."""
    torch.manual_seed(0)
    model = build_model(resolve_config("model=tiny", "model.vocab_size=1000", f"seq={seq}").workload, "cpu").module
    return model, SyntheticTokens(1000, seed=3)


def test_the_loss_by_position_is_the_mean_of_each_spans_token_losses(single_process):
    model, source = _tiny_model_and_source(64)
    got = validation_loss([model], source, 64, 2, 2, 4, torch.device("cpu"), lambda mb: mb)
    # by hand: the same two micro-batches of two validation samples, every token's loss kept
    (batch,) = [next(micro_batches(ValidationSamples(source), 64, 2, 2, 0, 1, torch.device("cpu")))]
    with torch.no_grad():
        losses = torch.cat([model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"]).double()
                            for mb in batch])  # [4 sequences, 64 positions]
    assert losses.shape == (4, 64)
    expected = [losses[:, start:end].mean().item() for start, end in bucket_bounds(64, 4)]
    assert got["valid_loss_by_position"] == pytest.approx(expected, rel=1e-12)
    assert got["valid_loss"] == pytest.approx(losses.mean().item(), rel=1e-12)
    assert model.training  # left as it was found
    # held out: none of the validation sequences is a training sequence of the run
    train = {tuple(source.sample(i, 65).tolist()) for i in range(16)}
    assert not train & {tuple(source.valid_sample(i, 65).tolist()) for i in range(4)}


def test_the_buckets_are_the_spans_of_bucket_bounds_where_they_differ_in_length(single_process):
    model, source = _tiny_model_and_source(30)
    got = validation_loss([model], source, 30, 1, 1, 4, torch.device("cpu"), lambda mb: mb)
    (mb,) = next(micro_batches(ValidationSamples(source), 30, 1, 1, 0, 1, torch.device("cpu")))
    with torch.no_grad():
        losses = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"]).double()[0]
    assert bucket_bounds(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    expected = [losses[start:end].mean().item() for start, end in bucket_bounds(30, 4)]
    assert got["valid_loss_by_position"] == pytest.approx(expected, rel=1e-12)


def test_validation_walks_layers_in_tiles_and_gives_their_whole_losses(single_process):
    from memo.policy import policy_of
    from memo.swap.streams import InlineStreams

    run = resolve_config("model=tiny_llama", "model.vocab_size=1000", "seq=64", "method=memo", "method.tile_tokens=16",
                         "train.loss=tiled")
    torch.manual_seed(0)
    model = build_model(run.workload, "cpu").module
    walk = policy_of(run.workload).prepare(model, run.workload, torch.device("cpu"), 2**40, InlineStreams())
    source, phases = SyntheticTokens(1000, seed=3), []
    walk.name_phases(lambda layer, part: phases.append((layer, part)))
    tiled = validation_loss([model], source, 64, 1, 2, 4, torch.device("cpu"), walk.token_order)
    walk.name_phases(None)
    # every layer walked tile by tile, each tile's queries over the store's blocks so far, twice
    # every layer of both micro-batches walked tile by tile, each tile's queries over the store's
    # blocks up to its own, and no layer run whole
    one_layer = [part for t in range(4) for part in (f"fwd.t{t}", *(f"fwd.t{t}.b{j}" for j in range(t + 1)),
                                                       f"fwd.t{t}")] + ["fwd"]
    assert phases == 2 * [(layer, part) for layer in range(run.workload.model.num_layers) for part in one_layer]
    walk.detach()  # the same weights, each layer run whole
    whole = validation_loss([model], source, 64, 1, 2, 4, torch.device("cpu"), lambda mb: mb)
    assert tiled["valid_loss_by_position"] == pytest.approx(whole["valid_loss_by_position"], abs=1e-6)
    assert tiled["valid_loss"] == pytest.approx(whole["valid_loss"], abs=1e-6)


@pytest.mark.parametrize("method", [["method=none"], ["method=memo", "alpha=0.5"]], ids=["none", "memo"])
def test_a_run_validates_at_its_interval_and_after_its_last_step(tmp_path, method):
    row = run_in_process(tmp_path, "model.vocab_size=1000", "seq=128", "train.steps=5", "train.warmup_steps=1",
                         "train.eval_interval=2", "train.eval_buckets=4", *method)
    assert row["status"] == "ok", row["error"]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validated = [s["step"] for s in steps if "valid_loss" in s]
    assert validated == [2, 4, 5]
    last = steps[-1]
    assert len(last["valid_loss_by_position"]) == 4
    # equal spans: the whole is the mean of the buckets
    assert last["valid_loss"] == pytest.approx(sum(last["valid_loss_by_position"]) / 4, rel=1e-12)
    assert (row["valid_loss"], row["valid_loss_by_position"]) == (last["valid_loss"], last["valid_loss_by_position"])


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_interval=0"], "train.eval_interval=0 must be"),
    (["train.eval_interval=2", "train.eval_buckets=300", "seq=256"], "train.eval_buckets=300 is more than the seq=256"),
])
def test_bad_validation_settings_are_one_line(overrides, message):
    from memo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve_config(*overrides)


def test_validation_with_the_plan_is_refused_on_a_gpu_where_the_arena_holds_a_steps_bytes():
    from conftest import compose_config
    from memo.config import ConfigError, resolve
    from memo.modes.train import _check_runtime_support
    from memo.policy import policy_of

    for gpu in (False, True):
        run = resolve(compose_config("plan=true", "train.eval_interval=2", "method=memo"), gpu_visible=gpu)
        if gpu:
            with pytest.raises(ConfigError, match="with plan=true on a GPU: a validation pass runs between"):
                _check_runtime_support(run, policy_of(run.workload))
        else:  # (the CPU validates the plan: nothing is reserved beside it)
            _check_runtime_support(run, policy_of(run.workload))
