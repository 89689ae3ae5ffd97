"""Predictions against measured runs: how far ``mode=fit`` is from what a device did.

For every training row that ended ``ok``, the configuration it ran is predicted again and the
relative errors ``predicted / measured − 1`` are given for the time per iteration and, where the
run measured a device (``peak_reserved_bytes``), for the peak memory the caching allocator held
(the prediction without ``fit.device_reserved_gib``, which the allocator does not see). Tune
``fit.*`` until the time errors of your cluster's rows are small; the memory error needs no tuning.
``python -m analysis.calibration DIR...`` prints the table; the GPU pack writes it beside its rows.
"""

import dataclasses
import math
import typing
from typing import Iterable, Mapping, Optional

from memo.config import FitConfig, MethodConfig, ModelConfig, ParallelConfig, Workload
from memo.config.method import method_of, training_loss
from memo.fit.predict import Problem, predict, prediction_hardware
from memo.fit.rates import Rates, with_rates
from memo.hardware import Hardware
from memo.model.gpt import DTYPES, dtype_label

# flattened to comma-separated strings in rows
_LISTS = {"method.recompute_modules", "method.offload_modules", "fit.tile_tokens", "fit.optimizer_offload"}


def _value(value):
    """A row's value, None where it has none (a table's missing cell is NaN)."""
    return None if isinstance(value, float) and math.isnan(value) else value


def _section(row: Mapping, prefix: str, cls):
    """The dataclass ``cls`` from the row's ``prefix``-ed columns; an empty one keeps the field's
    default, or is None where the field has none (a CPU has no host-link figure)."""
    values = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = _value(row.get(prefix + f.name))
        if value is not None:
            integer = int in (hints[f.name], *typing.get_args(hints[f.name]))
            if integer and isinstance(value, float) and value.is_integer():
                value = int(value)  # a column with gaps reads as floats
            values[f.name] = value.split(",") if prefix + f.name in _LISTS else value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = None
    return cls(**values)


@dataclasses.dataclass
class _Train:
    """The training fields a prediction reads."""

    micro_batch_size: int = 1
    micro_batches: int = 1
    distributed_optimizer: Optional[bool] = None
    loss_tile_tokens: Optional[int] = None
    optimizer_offload: str = "none"
    optimizer_offload_fraction: float = 1.0


def problem_of_row(row: Mapping) -> tuple[Problem, ParallelConfig, int]:
    """The prediction problem, layout and length (tokens) of one training row."""
    dtype = next(name for name, d in DTYPES.items() if dtype_label(d) == row["dtype"])
    config = _section(row, "method.", MethodConfig)
    train = _section(row, "train.", _Train)
    parallel, seq = _section(row, "parallel.", ParallelConfig), int(row["seq"])
    alpha = _value(row.get("alpha"))
    method, tiles, _ = method_of(config, "auto" if alpha is None else alpha)  # rows record what was chosen
    workload = Workload(
        model=_section(row, "model.", ModelConfig),
        method=method,
        parallel=parallel,
        seq=seq,
        micro_batch_size=int(train.micro_batch_size),
        dtype=dtype,
        # the loss the run used (rows record it resolved)
        loss=training_loss(config, _value(row.get("train.loss")) or "auto"),
        loss_tile_tokens=train.loss_tile_tokens,
        layer_tile_tokens=tiles,
    )
    fit, hw = _section(row, "fit.", FitConfig), _section(row, "hardware.", Hardware)
    measured = rates_of_row(row)
    if measured is not None:  # the run's choice was predicted at its device's measured rates
        fit, hw = with_rates(fit, hw, measured)
    problem = Problem(
        workload=workload,
        hardware=prediction_hardware(hw),
        fit=fit,
        micro_batches=int(train.micro_batches),
        distributed_optimizer=train.distributed_optimizer,
        optimizer_offload=train.optimizer_offload_fraction if train.optimizer_offload == "host" else 0.0,
        # as the row's Megatron ran it; rows that do not say were made without Transformer Engine or Apex
        pytorch_adam=bool(_value(row.get("optimizer_pytorch_adam", True))),
    )
    return problem, parallel, seq


def rates_of_row(row: Mapping, section: str = "rates.") -> Optional[Rates]:
    """The measured rates a row's run was predicted with (its ``rates.*``; or those of another
    ``section``, :data:`memo.fit.rates.KERNEL_RATES`), or None where it has none."""
    measured = _section(row, section, Rates)
    return None if measured.gemm_flops is None else measured


def compare(rows: Iterable[Mapping]) -> list[dict]:
    """One line per ``ok`` training row of ``rows``: measured and predicted time and peak memory,
    and their relative errors."""
    lines = []
    for row in rows:
        if _value(row.get("mode")) not in (None, "train") or row.get("status") != "ok":
            continue
        problem, parallel, seq = problem_of_row(row)
        prediction = predict(problem, parallel, seq)
        measured_peak = _value(row.get("peak_reserved_bytes"))
        held = prediction.device_total - prediction.reserved
        lines.append({
            "result_path": row.get("result_path"),
            "model.name": problem.workload.model.name,
            "method.name": problem.workload.method.name,
            "seq": seq,
            "measured_iter_time_s": row["iter_time_s"],
            "predicted_iter_time_s": prediction.time.iteration_s,
            "time_error": prediction.time.iteration_s / row["iter_time_s"] - 1,
            "measured_peak_bytes": measured_peak,
            "predicted_peak_bytes": held,
            "memory_error": held / measured_peak - 1 if measured_peak else None,
        })
    return lines
