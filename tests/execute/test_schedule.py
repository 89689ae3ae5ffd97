"""Learning-rate schedules: the rates of their formulas at chosen steps, worked out by hand, what a
run records, and bad settings refused in one line."""

import json
import math
import re

import pytest
from conftest import compose_config, run_in_process

from memo.config import ConfigError, TrainConfig, validate
from memo.execute.schedule import LearningRateSchedule

LR, MIN = 1e-3, 1e-4


def rates(**settings) -> list[float]:
    train = TrainConfig(**{"lr": LR, "min_lr": MIN, **settings})
    schedule = LearningRateSchedule(train)
    return [schedule(step) for step in range(train.steps)]


def test_a_constant_rate_after_a_linear_warm_up_reaches_lr_at_the_last_warm_up_step():
    assert rates(steps=6, lr_warmup_steps=4) == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR], rel=1e-12)
    assert rates(steps=3) == [LR, LR, LR]


def test_cosine_falls_from_lr_to_min_lr_after_the_warm_up_and_stays_there():
    # warm-up of 2, decay until step 10 of 12: steps 3..10 (1-based) are the cosine's
    got = rates(steps=12, lr_warmup_steps=2, lr_schedule="cosine", lr_decay_steps=10)
    assert got[1] == LR  # the last warm-up step
    assert got[5] == pytest.approx(MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi * 4 / 8)), rel=1e-12)
    assert got[5] == pytest.approx((LR + MIN) / 2, rel=1e-12)  # half way: the mean of the two
    assert got[9] == pytest.approx(MIN, rel=1e-12) and got[10:] == [MIN, MIN]
    assert all(a >= b for a, b in zip(got[1:], got[2:]))


def test_warmup_stable_decay_holds_lr_then_decays_over_its_last_steps():
    got = rates(steps=20, lr_warmup_steps=2, lr_schedule="wsd", lr_wsd_decay_steps=5)
    assert got[2:15] == [LR] * 13  # stable until step 15 of 20
    assert got[17] == pytest.approx(MIN + (LR - MIN) * (1 - 3 / 5), rel=1e-12)  # step 18: 3 of the 5 decay steps
    assert got[19] == pytest.approx(MIN, rel=1e-12)
    cosine = rates(steps=20, lr_schedule="wsd", lr_wsd_decay_steps=4, lr_wsd_decay_style="cosine")
    assert cosine[17] == pytest.approx(MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi * 2 / 4)), rel=1e-12)
    # without lr_wsd_decay_steps, the last tenth of the steps after the warm-up decays
    assert rates(steps=22, lr_warmup_steps=2, lr_schedule="wsd")[19] == LR
    assert rates(steps=22, lr_warmup_steps=2, lr_schedule="wsd")[20] == pytest.approx(MIN + (LR - MIN) / 2)


def test_a_run_too_short_for_its_warm_up_keeps_warming_up_at_a_constant_rate():
    """A constant rate has nothing to decay: a run shorter than its warm-up (a preset cut short)
    is valid and warms up all the way."""
    validate(compose_config("train.steps=3", "train.lr_warmup_steps=100"))
    assert rates(steps=3, lr_warmup_steps=100) == pytest.approx([LR / 100, LR / 50, 3 * LR / 100], rel=1e-12)


def test_inverse_square_root_and_linear_decay():
    assert rates(steps=16, lr_warmup_steps=4, lr_schedule="inverse_sqrt")[15] == pytest.approx(LR / 2, rel=1e-12)
    assert rates(steps=11, lr_schedule="linear", lr_decay_steps=10)[4] == pytest.approx(MIN + (LR - MIN) / 2)


@pytest.mark.parametrize("overrides, fragment", [
    (["train.lr_schedule=step"], "train.lr_schedule=step is not allowed; choose one of: constant, linear, cosine"),
    (["train.min_lr=0.01"], "train.min_lr=0.01 must be between 0 and train.lr=0.001"),
    (["train.steps=4", "train.lr_warmup_steps=4", "train.lr_schedule=cosine"],
     "decays until step 4 (train.lr_decay_steps, else train.steps), not after its warm-up"),
    (["train.lr_decay_steps=0", "train.lr_schedule=linear"], "train.lr_decay_steps=0 must be"),
    (["train.lr_wsd_decay_steps=-3"], "train.lr_wsd_decay_steps=-3 must be"),
    (["train.steps=10", "train.lr_schedule=wsd", "train.lr_wsd_decay_steps=12"],
     "train.lr_wsd_decay_steps=12 must be between 1 and the 10 steps"),
    (["train.lr_schedule=wsd", "train.lr_wsd_decay_style=step"], "train.lr_wsd_decay_style=step is not allowed"),
])
def test_a_schedule_that_cannot_run_is_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as error:
        validate(compose_config(*overrides))
    assert "\n" not in str(error.value)


def test_a_run_trains_at_the_rates_of_its_schedule(tmp_path):
    row = run_in_process(tmp_path / "run", "seq=128", "model.vocab_size=1000", "train.steps=5", "train.warmup_steps=1",
                         "train.lr_schedule=cosine", "train.lr_warmup_steps=1", "train.min_lr=0.0001")
    assert row["status"] == "ok", row["error"]
    logged = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = rates(steps=5, lr_warmup_steps=1, lr_schedule="cosine")
    assert logged == pytest.approx(expected, rel=1e-12) and logged[0] > logged[-1] == pytest.approx(MIN)
