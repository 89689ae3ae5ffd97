"""A step's device time by category, from a profiler trace: a hand-made GPU trace whose every
figure is known, and a CPU run that writes its timeline."""

import gzip
import json

import pandas as pd
import pytest

from memo.config import ConfigError
from memo.metrics.timeline import table

from conftest import resolve_config, run_in_process


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _kernel(name, ts, dur, correlation, stream=7):
    return _x("kernel", name, ts, dur, tid=stream, correlation=correlation, stream=stream)


def _launch(ts, correlation):
    return _x("cuda_runtime", "cudaLaunchKernel", ts, 2, correlation=correlation)


def test_a_gpu_trace_is_cut_into_its_categories():
    node = "autograd::engine::evaluate_function: "
    events = [
        # the forward: a GEMM (launched at 0), cuDNN's attention (at 5)
        _launch(0, 1), _kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", 100, 50, 1),
        _launch(5, 2), _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 160, 200, 2),
        # the backward: the walk's layer node recomputes (a GEMM at 20), a linear's node inside it
        # takes its gradient (a GEMM at 32), then attention's backward (at 45)
        _x("cpu_op", node + "_TiledLayerBackward", 15, 40),
        _launch(20, 3), _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 365, 30, 3),
        _x("cpu_op", node + "_PlacedLinearBackward", 30, 10),
        _launch(32, 4), _kernel("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 400, 60, 4),
        _launch(45, 5), _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", 470, 400, 5),
        # an element-wise kernel after a long gap, and a copy to the host on its own stream, half
        # of it under attention's backward
        _launch(60, 6), _kernel("void at::native::vectorized_elementwise_kernel<4>", 1000, 20, 6),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 770, 200, tid=9, correlation=7, stream=9),
    ]
    rows = {r["category"]: r for r in table({"traceEvents": events})}
    seconds = {c: round(r["seconds"] * 1e6, 6) for c, r in rows.items()}
    assert seconds == {"attention_forward": 200, "attention_backward": 400, "gemm_forward": 50, "gemm_recompute": 30,
                       "gemm_backward": 60, "copy_d2h": 200, "elementwise": 20,
                       # kernel to kernel: 150 → 160 and 395 → 400 are launch gaps, 360 → 365 too;
                       # 870 → 1000 is idle (the copy ran on another stream)
                       "launch_gaps": 10 + 5 + 5 + 10, "idle": 130}
    assert rows["copy_d2h"]["overlapped_s"] == pytest.approx(100e-6)  # 770..870 under attention's backward
    assert rows["elementwise"]["share"] == pytest.approx(20 / (1020 - 100))


def test_a_run_writes_the_timeline_of_the_step_it_names(tmp_path):
    row = run_in_process(tmp_path, "method=memo", "method.tile_tokens=64", "seq=256", "model.num_layers=2",
                         "model.vocab_size=1000", "train.steps=2", "train.warmup_steps=1", "train.timeline_step=1")
    assert row["status"] == "ok", row["error"]
    times = pd.read_csv(tmp_path / "timeline.csv").set_index("category")
    # on the CPU the operators stand in for kernels: the tiles' attention, the GEMMs of every pass
    assert {"attention_forward", "attention_backward", "gemm_forward", "gemm_recompute", "gemm_backward"} <= set(times.index)
    trace = json.loads(gzip.decompress((tmp_path / "timeline.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert len(pd.read_csv(tmp_path / "timeline_kernels.csv")) > 0


def test_a_timeline_step_that_is_not_a_warm_up_step_is_refused():
    for step in (3, 5):  # a timed step, and none of the run's
        with pytest.raises(ConfigError, match=f"train.timeline_step={step} is not one of the run's warm-up steps 1..2"):
            resolve_config("train.steps=3", "train.warmup_steps=2", f"train.timeline_step={step}")
