"""The step's after-work, one hook at a time: each against hand-computed figures or fakes of what it
acts on, without a training run."""

import json
import logging

import pytest

from memo.execute.hooks import (ActivationAccounting, Checkpointing, MemoryReadings, Progress, StepLog, Throughput,
                                Validation, on_schedule)
from memo.model.placement import Accounting, NullRuntime
from memo.results import ResultWriter


def _record(step: int = 1, **extra) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "iter_time_s": 2.0, "timed": True, **extra}


def test_schedules_are_every_interval_and_the_last_step():
    assert [s for s in range(1, 11) if on_schedule(s, 4, 10)] == [4, 8, 10]
    assert not any(on_schedule(s, None, 10) for s in range(1, 11))


def test_throughput_is_the_papers_tgs_and_mfu_and_by_documents_where_kept_apart():
    # 4 sequences of 1024 tokens in 2 s on 2 devices of 1e12 FLOP/s; P = 1000, 2 layers, h = 8
    hook = Throughput(global_batch=4, seq=1024, devices=2, flops_per_step=8e12, flops_parameters=1000, layers=2,
                      attention_width=8, peak_flops=1e12)
    record = _record()
    hook(record)
    assert record["tgs"] == 4 * 1024 / (2.0 * 2) and record["mfu"] == 8e12 / (2.0 * 2 * 1e12)
    assert "mfu_documents" not in record
    documents = _record(document_squared_tokens=3 * 512**2)
    hook(documents)
    flops = 6.0 * 4 * 1024 * 1000 + 6.0 * 2 * 8 * 3 * 512**2
    assert documents["flops_documents"] == flops and documents["mfu_documents"] == flops / (2.0 * 2 * 1e12)


def test_memory_readings_are_the_trackers():
    class Tracker:
        def read(self):
            return {"peak_allocated_bytes": 7}

    record = _record()
    MemoryReadings(Tracker())(record)
    assert record["peak_allocated_bytes"] == 7


def test_accounting_writes_each_layer_and_totals_the_step(tmp_path):
    class Swapping:
        def accounting(self):
            return Accounting(({"layer": 0, "device": 0, "host": 10, "recomputed": 3},
                               {"layer": 1, "device": 5, "host": 0, "recomputed": 0}), device_bytes=64)

    writer = ResultWriter(tmp_path)
    record = _record(step=3)
    ActivationAccounting(Swapping(), writer)(record)
    assert (record["skeletal_device_bytes"], record["skeletal_host_bytes"], record["recomputed_bytes"]) == (64, 10, 3)
    lines = [json.loads(line) for line in (tmp_path / "layers.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, "layer": 0, "device_bytes": 0, "host_bytes": 10, "recomputed_bytes": 3},
                     {"step": 3, "layer": 1, "device_bytes": 5, "host_bytes": 0, "recomputed_bytes": 0}]
    nothing = _record()
    ActivationAccounting(NullRuntime(), writer)(nothing)
    assert nothing == _record()  # a runtime that keeps nothing adds nothing


def test_validation_runs_on_its_schedule_into_the_record_and_the_row(caplog):
    passes, row = [], {}

    def evaluate():
        passes.append(1)
        return {"valid_loss": 1.5, "valid_loss_by_position": [2.0, None]}

    hook = Validation(interval=2, last_step=5, evaluate=evaluate, row=row)
    with caplog.at_level(logging.INFO, logger="memo"):
        records = [_record(step) for step in range(1, 6)]
        for record in records:
            hook(record)
    assert len(passes) == 3 and [("valid_loss" in r) for r in records] == [False, True, False, True, True]
    assert row == {"valid_loss": 1.5, "valid_loss_by_position": [2.0, None]}
    assert "step 5 validation loss 1.5000, by position: 2.0000 -" in caplog.text
    silent = Validation(interval=None, last_step=5, evaluate=evaluate, row=row)
    silent(_record(5))
    assert len(passes) == 3


def test_the_step_log_keeps_and_writes_every_record(tmp_path):
    hook = StepLog(ResultWriter(tmp_path))
    hook(_record(1))
    hook(_record(2))
    assert [r["step"] for r in hook.records] == [1, 2]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_checkpoints_are_saved_on_schedule_with_the_samples_consumed(monkeypatch, tmp_path):
    saved = []

    class Saved:
        def __init__(self, path):
            self.path = path

    def save(save_dir, step, consumed, module, optimizer, facts):
        saved.append((step, consumed))
        return Saved(save_dir / f"step_{step}")

    monkeypatch.setattr("memo.execute.checkpoint.save", save)
    row = {}
    # resumed at step 4 with 32 samples consumed, 8 a step: saves at 6 and the last, 7
    hook = Checkpointing(interval=3, last_step=7, save_dir=tmp_path, chunks=None, optimizer=None, facts=None,
                         consumed=32, start_step=4, global_batch=8, row=row)
    for step in (5, 6, 7):
        hook(_record(step))
    assert saved == [(6, 48), (7, 56)] and row["checkpoint_last"] == str(tmp_path / "step_7")


def test_progress_stops_on_a_signal_and_logs_the_step(caplog):
    class Bar:
        def step(self, seconds, loss):
            return 30.0

    def stop():
        raise KeyboardInterrupt

    record = _record(2, tgs=100.0, mfu=0.25, timed=False)
    with caplog.at_level(logging.INFO, logger="memo"):
        Progress(Bar(), lambda: None, last_step=4)(record)
    assert "step 2/4  loss 2.5000  2.000 s/it  TGS 100.0  MFU 25.00%  30s left  (warm-up)" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        Progress(Bar(), stop, last_step=4)(record)
