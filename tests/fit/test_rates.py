"""hardware=auto's rates: measured once per device and software, read back, taken by the fit."""

import dataclasses
import json

import pytest
import torch

from conftest import resolve_config
from memo.config import FitConfig
from memo.fit import rates
from memo.fit.calibration import rates_of_row
from memo.fit.rates import Rates, backward_flops, cached_rates, with_rates
from memo.hardware import HARDWARE


class _Measurements:
    def __init__(self):
        self.count = 0

    def __call__(self) -> Rates:
        self.count += 1
        return Rates(7e11 * self.count, 5e11, 4e11, None, None)


def test_rates_are_measured_once_per_key_and_read_back(tmp_path):
    cache, measure = tmp_path / "rates.json", _Measurements()
    cpu = torch.device("cpu")
    first, key, fresh = cached_rates(cpu, torch.float32, 64, cache, measure)
    assert fresh and measure.count == 1 and key.endswith("|float32|head_dim=64")
    again, _, fresh = cached_rates(cpu, torch.float32, 64, cache, measure)
    assert (again, fresh, measure.count) == (first, False, 1)
    other, other_key, fresh = cached_rates(cpu, torch.float32, 128, cache, measure)  # another head size
    assert fresh and measure.count == 2 and other.gemm_flops == 14e11 and other_key != key
    assert set(json.loads(cache.read_text())) == {key, other_key}
    cache.write_text(json.dumps({key: {"gemm": 1}, other_key: json.loads(cache.read_text())[other_key]}))
    _, _, fresh = cached_rates(cpu, torch.float32, 64, cache, measure)  # an entry that is not rates: measured
    assert fresh and measure.count == 3 and set(json.loads(cache.read_text())) == {key, other_key}
    cache.write_text("{not json")  # a corrupt cache is measured over and written whole again
    _, _, fresh = cached_rates(cpu, torch.float32, 64, cache, measure)
    assert fresh and measure.count == 4 and list(json.loads(cache.read_text())) == [key]


def test_the_backward_rate_is_its_flops_over_the_seconds_it_adds():
    # a forward of 100 FLOPs in 1 s, its backward of 250 FLOPs in 2 s: 350 FLOPs in 3 s together
    assert backward_flops(100.0, 350 / 3) == pytest.approx(125.0)


def test_a_measurement_on_this_cpu_gives_every_rate():
    measured = rates.measure(torch.device("cpu"), torch.float32, 64, small=True)
    assert min(measured.gemm_flops, measured.attention_forward_flops, measured.attention_backward_flops) > 0
    assert (measured.h2d_bytes_per_s, measured.d2h_bytes_per_s) == (None, None)  # a CPU copies nothing


def test_rates_become_the_fits_efficiencies_and_the_slower_copy_the_host_link():
    h100 = HARDWARE["h100"]
    fit, hw = with_rates(FitConfig(), h100, Rates(692.3e12, 494.5e12, 395.6e12, 52e9, 48e9))
    assert (fit.gemm_efficiency, fit.attention_forward_efficiency, fit.attention_backward_efficiency) == \
        pytest.approx((0.7, 0.5, 0.4))
    assert hw.host_link_bytes_per_s == 48e9 and hw.peak_flops == h100.peak_flops


def test_a_run_on_the_cpu_or_on_a_named_machine_keeps_its_rates(tmp_path):
    for hardware in ("auto", "h100"):
        run = resolve_config("mode=fit", f"hardware={hardware}")
        same, hw, row = rates.of_this_device(run, HARDWARE["h100"], tmp_path / "rates.json")
        assert (same, hw, row) == (run, HARDWARE["h100"], {}) and not (tmp_path / "rates.json").exists()


def test_a_run_on_a_gpu_with_hardware_auto_takes_the_devices_rates_into_its_fit_and_row(tmp_path, monkeypatch):
    run = dataclasses.replace(resolve_config("mode=fit", "hardware=auto", "model=tiny_llama"), device_type="cuda")
    asked = []

    def cached(device, dtype, head_dim, cache):
        asked.append((device, dtype, head_dim, cache))
        return Rates(494.5e12, 395.6e12, 296.7e12, 50e9, 40e9), "H100|torch|bfloat16|head_dim=64", True

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rates, "cached_rates", cached)
    h100 = HARDWARE["h100"]
    measured, hw, row = rates.of_this_device(run, h100, tmp_path / "rates.json")
    model = run.workload.model
    assert asked == [(torch.device("cuda", 0), torch.float32, model.hidden_size // model.num_attention_heads,
                      tmp_path / "rates.json")]
    f = measured.fit
    assert (f.gemm_efficiency, f.attention_forward_efficiency, f.attention_backward_efficiency) == \
        pytest.approx((0.5, 0.4, 0.3))
    assert hw.host_link_bytes_per_s == 40e9 and measured.workload == run.workload
    assert row["rates.gemm_flops"] == 494.5e12 and row["rates.measured_now"] is True


def test_a_gpu_runs_row_gets_the_devices_rates_whatever_hardware_it_names(tmp_path, monkeypatch):
    named = dataclasses.replace(resolve_config("mode=fit", "hardware=h100", "model=tiny_llama"), device_type="cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rates, "cached_rates", lambda *_: (Rates(494.5e12, 395.6e12, 296.7e12, 50e9, 40e9), "H100|…",
                                                           False))
    row = rates.row_of_this_device(named, tmp_path / "rates.json")
    assert row["kernel_rates.gemm_flops"] == 494.5e12 and row["kernel_rates.key"] == "H100|…"
    assert row["kernel_rates.measured_now"] is False
    # not what the fit was predicted with: a calibration predicts the row at its hardware's figures
    assert rates_of_row(row) is None and rates_of_row(row, rates.KERNEL_RATES) == Rates(494.5e12, 395.6e12, 296.7e12,
                                                                                          50e9, 40e9)
    assert rates.row_of_this_device(resolve_config("mode=fit"), tmp_path / "rates.json") == {}  # the CPU

    def failing(*_):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(rates, "cached_rates", failing)
    assert rates.row_of_this_device(named, tmp_path / "rates.json") == {}  # warned, no ceiling


def test_a_row_predicted_at_measured_rates_is_predicted_again_at_them():
    rates_row = Rates(494.5e12, 395.6e12, 296.7e12, 50e9, 40e9).row("H100|...")
    assert rates_of_row(rates_row) == Rates(494.5e12, 395.6e12, 296.7e12, 50e9, 40e9)
    assert rates_of_row({"rates.gemm_flops": float("nan")}) is None and rates_of_row({}) is None


def test_fit_measured_rates_false_keeps_the_fits_figures(tmp_path):
    run = resolve_config("mode=fit", "hardware=auto", "fit.measured_rates=false")
    run = dataclasses.replace(run, device_type="cuda")
    assert rates.of_this_device(run, HARDWARE["h100"], tmp_path / "rates.json") == (run, HARDWARE["h100"], {})
