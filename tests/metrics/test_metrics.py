"""MFU, TGS, parameter counts and hardware figures against hand-computed values."""

import json
import mmap

import pytest
import torch

from memo import hardware
from memo.config import ConfigError
from memo.metrics import PeakMemory, mfu, mfu_ceiling, model_flops, model_flops_per_sample, tgs
from memo.model import padded_vocab_size, parameter_count
from memo.policy import build_model

from conftest import compose_config, resolve_config

# 7B of the paper: n=32, h=4096, f=16384, vocab 50257 padded to 50304.
#   per layer 4h² + 2hf + 9h + f = 67,108,864 + 134,217,728 + 36,864 + 16,384 = 201,379,840
#   P = 32 · 201,379,840 + 50,304 · 4,096 + 2 · 4,096 = 6,650,208,256
P_7B = 6_650_208_256
S_1M = 1_048_576
# 6·s·P = 6 · 1,048,576 · 6,650,208,256 and 6·n·h·s² = 6 · 32 · 4096 · 2^40 = 3 · 2^58
FLOPS_7B_1M = 41_839_492_633_460_736 + 864_691_128_455_135_232


def test_parameter_count_of_7b():
    assert padded_vocab_size(compose_config("model=7b").model, 1) == 50_304
    assert parameter_count(compose_config("model=7b").model) == P_7B


def test_model_flops_per_sample_7b_at_1m():
    assert model_flops_per_sample(S_1M, P_7B, 32, 4096) == FLOPS_7B_1M


def test_documents_kept_apart_count_the_attention_of_each_documents_square():
    # 10 tokens in documents of 4 and 6: 6·10·100 weight FLOPs, 6·2·8·(16 + 36) attention FLOPs
    assert model_flops(10, 4**2 + 6**2, 100, 2, 8) == 6000 + 4992
    assert model_flops(10, 10**2, 100, 2, 8) == model_flops_per_sample(10, 100, 2, 8) == 6000 + 9600


def test_mfu_and_tgs_7b_at_1m_on_8_a800():
    # One 1M-token sample per iteration on 8 A800 (tp=4, cp=2), 1000 s per iteration:
    # MFU = 906,530,621,088,595,968 / (1000 · 8 · 312e12) = 0.36319..., TGS = 2^20 / 8000.
    peak = hardware.HARDWARE["a800"].peak_flops
    assert peak == 312e12
    assert mfu(FLOPS_7B_1M, 1000.0, 8, peak) == pytest.approx(0.363193, abs=1e-6)
    assert tgs(S_1M, 1000.0, 8) == pytest.approx(131.072)


def test_the_mfu_ceiling_is_the_model_flops_over_the_kernels_time():
    # 10 tokens, P = 100, 2 layers of width 8, squared spans 100: GEMMs 6·10·100 = 6000 FLOPs,
    # attention's forward 2·2·8·100 = 3200, MFU counting 3·3200 = 9600 of it: 15,600 model FLOPs
    peak = 1000.0
    # every kernel at the peak: the backward's 2.5 forwards still cost more than MFU's 2
    assert mfu_ceiling(10, 100, 100, 2, 8, peak, peak, peak, peak) == pytest.approx(15_600 / (6000 + 3200 + 8000))
    # GEMMs at 80% of the peak, attention forward at 50%, backward at 40%:
    # 6000/800 + 3200/500 + 2.5·3200/400 = 7.5 + 6.4 + 20 = 33.9 s, against 15.6 s at the peak
    assert mfu_ceiling(10, 100, 100, 2, 8, 800.0, 500.0, 400.0, peak) == pytest.approx(15.6 / 33.9)


def test_flops_grow_quadratically_with_sequence_at_fixed_params():
    # Attention's share at 128k: n·h·s / (n·h·s + P) = 17,179,869,184 / 23,830,077,440.
    s = 128 * 1024
    attention = 6 * 32 * 4096 * s**2
    assert model_flops_per_sample(s, P_7B, 32, 4096) - 6 * s * P_7B == attention
    assert attention / model_flops_per_sample(s, P_7B, 32, 4096) == pytest.approx(0.72093, abs=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 3])
def test_vocab_padding_is_the_same_for_common_tp(tp):
    model = compose_config("model=tiny").model
    assert padded_vocab_size(model, tp) == 50_304  # 50304 = 131 · 384, so tp=3 too
    assert padded_vocab_size(model, tp) % tp == 0


def test_parameters_counted_from_the_model_match_the_formula(single_process):
    workload = resolve_config("model=tiny", "seq=256", "train.loss=megatron").workload
    built = build_model(workload, "cpu")
    assert built.params == parameter_count(workload.model) == 16_037_376
    assert built.params == sum(p.numel() for p in built.module.parameters())


def test_hardware_table_entries_and_overrides():
    a800 = hardware.resolve(compose_config("hardware=a800").hardware)
    assert (a800.peak_flops, a800.device_memory_bytes, a800.devices_per_node) == (312e12, 80 * 2**30, 8)
    assert a800.host_memory_bytes == 2048 * 2**30 and a800.host_link_bytes_per_s == 32e9
    assert a800.peak_flops_source == "table"
    h100 = hardware.resolve(compose_config("hardware=h100", "hardware.host_memory_gib=1024").hardware)
    assert h100.peak_flops == 989e12 and h100.host_memory_bytes == 1024 * 2**30
    given = hardware.resolve(compose_config("hardware=h200", "hardware.peak_flops=1e15").hardware)
    assert (given.peak_flops, given.peak_flops_source) == (1e15, "config")


def test_the_tables_gpu_memory_is_what_the_committed_gpu_rows_measured():
    """A device's capacity is what it reported to the jobs that ran on it (``hardware=auto``
    records it), not the figure in its name: an H100 "80 GB" reports 79.18 GiB."""
    from conftest import REPO

    reported: dict[str, set[int]] = {}
    for row in (REPO / "results" / "gpu").glob("*/runs/*/*/result.json"):
        record = json.loads(row.read_text())
        name, memory = record.get("device_name"), record.get("hardware.device_memory_bytes")
        if name and memory:
            reported.setdefault(hardware.table_entry(name).name, set()).add(memory)
    assert set(reported) >= {"h100", "h200"}
    for entry, memory in reported.items():
        assert memory == {hardware.HARDWARE[entry].device_memory_bytes}, entry


def test_unknown_hardware_needs_all_figures():
    with pytest.raises(ConfigError, match=r"hardware.name=b200 .* hardware.peak_flops"):
        hardware.resolve(compose_config("hardware.name=b200").hardware)
    b200 = hardware.resolve(compose_config(
        "hardware.name=b200", "hardware.peak_flops=2.25e15", "hardware.device_memory_gib=180",
        "hardware.host_memory_gib=2048", "hardware.devices_per_node=8",
    ).hardware)
    assert b200.peak_flops == 2.25e15 and b200.device_memory_bytes == 180 * 2**30


def test_cpu_peak_is_measured_when_not_given():
    cpu = hardware.resolve(compose_config("hardware=cpu").hardware)
    assert cpu.peak_flops is None and cpu.host_memory_bytes == hardware.host_memory_bytes()
    measured = hardware.with_measured_peak(cpu, torch.float32, cache=None)
    assert measured.peak_flops_source == "measured" and 1e8 < measured.peak_flops < 1e14
    auto = hardware.resolve(compose_config().hardware)  # this machine has no GPU
    assert auto.name == "cpu" and auto.device_type == "cpu"


def test_the_cpu_peak_is_the_best_this_machine_has_shown(tmp_path, monkeypatch):
    """A measurement taken under load is low; the best one recorded stands in for it."""
    cache = tmp_path / "cpu_peak_flops.json"
    cpu = hardware.resolve(compose_config("hardware=cpu").hardware)
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", lambda dtype: 4e10)  # a quiet machine
    assert hardware.with_measured_peak(cpu, torch.float32, cache).peak_flops == 4e10
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", lambda dtype: 1e10)  # a busy one
    assert hardware.with_measured_peak(cpu, torch.float32, cache).peak_flops == 4e10
    assert hardware.with_measured_peak(cpu, torch.bfloat16, cache).peak_flops == 1e10  # per dtype
    assert sorted(json.loads(cache.read_text()).values()) == [1e10, 4e10]
    cache.write_text("{not json")  # a damaged cache is measured over, and rewritten
    assert hardware.with_measured_peak(cpu, torch.float32, cache).peak_flops == 1e10
    assert list(json.loads(cache.read_text()).values()) == [1e10]


def test_peak_rss_tracks_a_large_allocation_and_resets():
    memory = PeakMemory("cpu")
    memory.reset()
    before = memory.read()["peak_rss_bytes"]
    # Fresh pages from the kernel, touched: an allocator could serve 64 MiB from memory an earlier
    # test freed but the process still holds, which would not raise the peak.
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\1" * len(block))
    grown = memory.read()["peak_rss_bytes"]
    assert grown - before >= 60 * 2**20
    block.close()
    memory.reset()
    assert memory.read()["peak_rss_bytes"] < grown - 32 * 2**20


def test_pinnable_memory_is_available_memory_within_the_cgroups_room(tmp_path, monkeypatch):
    import resource

    from memo import hardware

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\n"
                       "MemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    # no cgroup files: MemAvailable (the page cache counts, where MemFree would not)
    assert hardware.pinnable_memory_bytes(meminfo, cgroup) == 20000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert hardware.pinnable_memory_bytes(meminfo, cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{3 * 2**30}\n")
    assert hardware.pinnable_memory_bytes(meminfo, cgroup) == 5 * 2**30  # the cgroup's room
    # the lock limit does not bound cudaHostRegister: it is reported, not applied
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 * 2**20, resource.RLIM_INFINITY))
    assert hardware.memlock_limit_bytes() == 64 * 2**20
    assert hardware.pinnable_memory_bytes(meminfo, cgroup) == 5 * 2**30
    assert 0 < hardware.pinnable_memory_bytes() <= hardware.host_memory_bytes()  # this machine


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
])
def test_a_detected_gpu_gets_the_peak_of_its_variant(name, peak):
    assert hardware.table_entry(name).peak_flops == peak
