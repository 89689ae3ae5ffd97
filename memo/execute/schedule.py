"""The learning rate of every step, by the schedules Megatron-LM users set
(``--lr-decay-style``, ``--lr-warmup-iters``, ``--min-lr``, ``--lr-wsd-decay-iters``).

The formulas are Megatron-core's own (:class:`megatron.core.optimizer_param_scheduler.
OptimizerParamScheduler`): a linear warm-up from 0 to ``train.lr`` over ``lr_warmup_steps``, then
``train.lr_schedule`` down to ``train.min_lr`` at ``lr_decay_steps`` (``train.steps`` unless set)
and ``min_lr`` after it:

* ``constant``: ``lr`` after the warm-up;
* ``linear`` and ``cosine``: from ``lr`` to ``min_lr`` over the steps after the warm-up;
* ``wsd`` (warmup-stable-decay): ``lr`` until the last ``lr_wsd_decay_steps`` of the decay steps,
  then down to ``min_lr`` in ``lr_wsd_decay_style`` (linear, cosine, exponential or minus_sqrt);
* ``inverse_sqrt``: ``lr·√(warm-up / step)``, at least ``min_lr``.

Step ``k`` (0-based) is Megatron's ``num_steps = k + 1``: the first warm-up step runs at
``lr / lr_warmup_steps`` and the last at ``lr`` (Megatron-LM's loop runs step ``k`` at ``num_steps =
k``, its first step at rate 0), and a decay reaches ``min_lr`` at the last of ``lr_decay_steps``.
Only the rate is taken from the scheduler; our optimizers are handed it each step (so that the
host and distributed optimizers take it alike), and weight decay stays ``train.weight_decay``.
"""

from types import SimpleNamespace

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from memo.config import TrainConfig
from memo.config.validate import DECAYING_SCHEDULES, lr_decay_steps, lr_wsd_decay_steps

# train.lr_schedule -> Megatron's lr_decay_style, where the names differ
_DECAY_STYLES = {"wsd": "WSD", "inverse_sqrt": "inverse-square-root"}


class LearningRateSchedule:
    """``schedule(step)``: the learning rate of 0-based ``step`` of a run configured by ``train``."""

    def __init__(self, train: TrainConfig):
        self._scheduler = OptimizerParamScheduler(
            SimpleNamespace(param_groups=[]),  # (it is asked for the rate only: no parameters to set)
            init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr,
            # (a constant or inverse-square-root rate never reaches its decay steps, which Megatron
            # asks to be after the warm-up all the same)
            lr_warmup_steps=train.lr_warmup_steps,
            lr_decay_steps=max(lr_decay_steps(train), train.lr_warmup_steps + 1),
            lr_decay_style=_DECAY_STYLES.get(train.lr_schedule, train.lr_schedule), start_wd=train.weight_decay, end_wd=train.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
            wsd_decay_steps=lr_wsd_decay_steps(train) if train.lr_schedule == "wsd" else None,
            lr_wsd_decay_style=train.lr_wsd_decay_style)

    def __call__(self, step: int) -> float:
        self._scheduler.num_steps = step + 1
        return self._scheduler.get_lr({})


def schedule_settings(train: TrainConfig) -> dict:
    """What fixes the rate of every step: the schedule's settings with its defaults resolved (a
    checkpoint keeps them, and a run resumed from it must have the same)."""
    settings = {"train.lr_schedule": train.lr_schedule, "train.lr": train.lr, "train.min_lr": train.min_lr,
                "train.lr_warmup_steps": train.lr_warmup_steps}
    if train.lr_schedule in DECAYING_SCHEDULES:  # (a constant rate does not depend on train.steps)
        settings["train.lr_decay_steps"] = lr_decay_steps(train)
    if train.lr_schedule == "wsd":
        settings.update({"train.lr_wsd_decay_steps": lr_wsd_decay_steps(train),
                         "train.lr_wsd_decay_style": train.lr_wsd_decay_style})
    return settings
