"""``mode=fit`` of layers walked in tiles and of Adam's states on the host: the three-tile template
against direct traces, the host terms against the training solver's, the model states against the
byte model of what a run allocates, and the host a job may use."""

import dataclasses
import math
import re

import pytest
import yaml
from conftest import REPO

from memo.config import FitConfig, Method, ModelConfig, ParallelConfig, Workload
from memo.execute.optimizer_offload import offload_bytes
from memo.fit import memory
from memo.fit.predict import Problem, predict
from memo.hardware import HARDWARE, GiB
from memo.model.gpt import parameter_count, parameter_numels
from memo.policy import policy_of
from memo.policy.tiles import tile_host_plan
from memo.profile.iteration import trace_iteration
from memo.profile.template import TRACED_TILES, iteration_template, traced_tile_tokens
from memo.profile.trace import Trace
from memo.swap.alpha import HostMemoryError, SkeletalBytes
from memo.swap.tile_alpha import TileShape, solve_tiles

TINY_LLAMA = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / "tiny_llama.yaml").read_text()))
MEMO = Method(name="memo", layer_activations="swap")
H200 = HARDWARE["h200"]


def tiled(seq: int, tile: int, model=TINY_LLAMA, parallel=ParallelConfig(), **kwargs) -> Workload:
    return Workload(model, MEMO, parallel, seq, dtype="bf16", loss="tiled", layer_tile_tokens=tile, **kwargs)


def without_gradients(trace: Trace) -> Trace:
    gradients = set(trace.meta["gradient_requests"])
    return Trace([e for e in trace.events if e.id not in gradients], trace.meta)


def peaks_by_part(trace: Trace) -> dict[str, int]:
    """The most bytes in use in each part of the iteration, a layer's tiles and the layers taken
    together (``layer.fwd``, ``layer.rebuild``, ...)."""
    live, peaks = 0, {}
    for e in trace.events:
        live += e.size if e.op == "malloc" else -e.size
        part = re.sub(r"layer\.\d+", "layer", re.sub(r"\.t\d+(\.d?b\d+)?$", "", e.phase))
        peaks[part] = max(peaks.get(part, 0), live)
    return peaks


def test_three_layers_of_three_tiles_stand_for_more_of_both():
    """Traced as three layers of three tiles of 512 and of 1024 tokens, the template stands for
    four layers of four tiles of 512: in every part of the iteration the same most bytes in use as
    a direct trace, but in the loss's backward (and so the embedding's after it), where the
    loss's fp32 gradient per token is sized at one tile of the loss, 4 bytes a token short (as
    whole layers have it); one tile's skeletal bytes are the ones the runtime finds."""
    work = tiled(4 * 512, 512)
    template = iteration_template(work, 4, policy_of(work).traced)
    assert (template.layers, TRACED_TILES, traced_tile_tokens(512)) == (3, 3, 512)
    real = without_gradients(trace_iteration(work, policy_of(work)))
    instance = template.instance(2048, 4, layer_tile_tokens=512)
    real_peaks, peaks = peaks_by_part(real), peaks_by_part(instance)
    short = 4 * (2048 - template.loss_tile(2048))
    assert set(peaks) == set(real_peaks)
    for part, value in real_peaks.items():
        assert peaks[part] == value - (short if part == "loss.bwd" else 0), part
    assert memory.split_peak(instance)[0] == memory.split_peak(real)[0] - short
    assert template.tile_skeletal(512) == SkeletalBytes(*real.meta["tile_skeletal_bytes"])


def test_a_tile_below_the_traced_minimum_is_refused():
    with pytest.raises(ValueError, match="tiles of at least 512 tokens"):
        traced_tile_tokens(256)
    assert [traced_tile_tokens(c) for c in (512, 4096, 16384, 12288, 1000)] == [512, 512, 512, 768, 1000]


def test_the_fits_alpha_and_k_are_the_training_solvers():
    """α per tile, k and the host bytes are those :func:`solve_tiles` gives training; the copies'
    exposed time is zero at the bandwidth bound and what α = 1 leaves over the next tile."""
    sizes = SkeletalBytes(1000, 2000, 8000)
    times = [1e-6 * (t + 1) for t in range(4)]
    plan = tile_host_plan(sizes, 6, times, None, 5e9, 4e5)
    expected = solve_tiles(TileShape(sizes, 6, 4, 2), times, 5e9, 4e5)
    assert plan.solution == expected and plan.per_device == math.ceil(expected.host_bytes)
    assert plan.exposed_copy_s == pytest.approx(0.0, abs=1e-12)
    full = tile_host_plan(sizes, 6, times, 1.0, 5e9, 1e9)
    copy = (1000 + 2000 + 8000) / 5e9
    assert full.exposed_copy_s == pytest.approx(sum(max(0.0, copy - times[(t + 1) % 4]) for t in range(4)))
    with pytest.raises(HostMemoryError, match="layer inputs"):
        tile_host_plan(sizes, 6, times, None, 5e9, 1e3)


def test_tiled_memo_is_predicted_ok_oom_and_oohm():
    """The device holds the whole-sequence stores (growing with s) and one tile's work; the host
    every other tile's attention output and the checkpoint inputs. Longer sequences need more of
    both; too small a host is ``oohm`` naming the layer inputs."""
    model = dataclasses.replace(TINY_LLAMA, num_layers=8)
    problem = Problem(tiled(8192, 1024, model), dataclasses.replace(H200, device_memory_bytes=GiB),
                      FitConfig(device_reserved_gib=0.0))
    short, long = (predict(problem, ParallelConfig(), s) for s in (8192, 32768))
    assert short.status == long.status == "ok" and short.tile_tokens == 1024
    assert long.device_total > short.device_total and long.host_per_device > short.host_per_device
    assert long.tiles.shape.tiles == 32 and long.acts.peak_phase
    small = dataclasses.replace(problem, hardware=dataclasses.replace(problem.hardware, host_memory_bytes=2**20))
    starved = predict(small, ParallelConfig(), 32768)
    assert starved.status == "oohm" and "layer inputs" in starved.reason


def test_the_host_a_job_has_is_its_nodes_for_the_devices_it_holds():
    """One device of an 8-device node has the node's host memory; eight share it."""
    model = dataclasses.replace(TINY_LLAMA, num_layers=8)
    hw = dataclasses.replace(H200, host_memory_bytes=400 * 2**20)
    one = predict(Problem(tiled(32768, 1024, model), hw, FitConfig()), ParallelConfig(), 32768)
    eight = predict(Problem(tiled(32768, 1024, model), hw, FitConfig()), ParallelConfig(dp=8), 32768)
    assert one.status == "ok" and eight.status == "oohm"
    assert one.host_per_node <= hw.host_memory_bytes * 0.9 < 8 * one.host_per_device


@pytest.mark.parametrize("name", ["tiny", "tiny_llama"])
def test_parameter_tensors_are_the_models(name, tiny_models):
    """The tensors the fit counts, element by element, are the built model's, in its order."""
    model, built = tiny_models[name]
    assert parameter_numels(model) == [p.numel() for p in built.parameters()]
    assert sum(parameter_numels(model, tp=2)) == parameter_count(model, tp=2)


@pytest.fixture(scope="module")
def tiny_models():
    from memo.policy import build_model
    from memo.profile.iteration import process_group

    models = {}
    for name in ("tiny", "tiny_llama"):
        model = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text()))
        with process_group(ParallelConfig(), "cpu"):
            models[name] = (model, build_model(Workload(model, Method(name="none"), ParallelConfig(), 256),
                                               "cpu", "math").module)
    return models


def test_adam_on_the_host_moves_the_optimizer_off_the_device():
    """All of Adam's states on the host: none left on the device, the host bytes those of the byte
    model of what a run allocates over the model's tensors; sharded over two ranks, each tensor's
    half."""
    work = Workload(TINY_LLAMA, Method(name="none"), ParallelConfig(), 1024, dtype="bf16")
    states = memory.model_states(work, None, 1.0)
    assert states.optimizer == 0 and states.weights == 2 * states.params and states.gradients == 4 * states.params
    assert states.offload == offload_bytes(parameter_numels(TINY_LLAMA), 2, 1.0)
    assert states.offload.host_bytes > 12 * states.params
    half = memory.model_states(dataclasses.replace(work, parallel=ParallelConfig(dp=2)), None, 0.5)
    pieces = [-(-n // 2) for n in parameter_numels(TINY_LLAMA)]
    assert half.offload == offload_bytes(pieces, 2, 0.5)
    assert half.optimizer == math.ceil(12 * states.params / 2) - half.offload.device_bytes_removed > 0


def test_adam_on_the_host_takes_its_share_of_the_host_first():
    """With the optimizer on the host the activations have what is left; a host smaller than the
    optimizer's states is ``oohm`` naming them."""
    model = dataclasses.replace(TINY_LLAMA, num_layers=8)
    problem = Problem(tiled(8192, 1024, model), H200, FitConfig(), optimizer_offload=1.0)
    ok = predict(problem, ParallelConfig(), 8192)
    states = memory.model_states(problem.workload, None, 1.0)
    assert ok.status == "ok" and ok.host_per_device == states.offload.host_bytes + ok.tiles.per_device
    assert ok.time.optimizer_offload_s > 0
    small = dataclasses.replace(problem, hardware=dataclasses.replace(H200, host_memory_bytes=states.offload.host_bytes))
    starved = predict(small, ParallelConfig(), 8192)
    assert starved.status == "oohm" and "Adam's states on the host" in starved.reason


def test_megatrons_offloading_takes_its_layers_tensors_to_the_host():
    """``method=megatron_offload``: the iteration of method=none with every offloading layer's
    freed bytes off the device but the one brought back ahead, and their copies on the host."""
    from memo.policy.megatron_offload import offloaded_bytes

    model = dataclasses.replace(TINY_LLAMA, num_layers=6)
    offloading = Method(name="megatron_offload", offload_modules=("core_attn", "attn_proj"))
    work = Workload(model, offloading, ParallelConfig(), 16384, dtype="bf16", loss="tiled")
    hw, fit = HARDWARE["h100"], FitConfig()
    got = predict(Problem(work, hw, fit), ParallelConfig(), 16384)
    none = predict(Problem(dataclasses.replace(work, method=Method(name="none")), hw, fit),
                   ParallelConfig(), 16384)
    layer = offloaded_bytes(work)
    assert layer.per_layer_device_freed > 0 and got.status == "ok"
    assert got.host_per_device == 5 * layer.per_layer_host
    assert got.acts.allocated_peak == none.acts.allocated_peak - 4 * layer.per_layer_device_freed
    assert got.acts.skeletal == none.acts.skeletal - 4 * layer.per_layer_device_freed


def test_the_search_tries_tiles_and_picks_them_where_they_reach_further(tmp_path):
    """``parallel=search`` tries whole layers and each of ``fit.tile_tokens``: on a small device
    tiles fit a longer sequence, and the row says how to train the one chosen."""
    import pandas as pd
    from conftest import run_in_process

    row = run_in_process(tmp_path, "mode=fit", "model=tiny_llama", "model.num_layers=6", "seq=max", "method=memo",
                         "parallel=search", "cluster.gpus=1", "hardware=h100", "hardware.device_memory_gib=0.5",
                         "fit.device_reserved_gib=0", "fit.seq_step=8k", "fit.seq_limit=256k",
                         "fit.tile_tokens=[whole,1k]", "fit.optimizer_offload=[none,host]", "train.dtype=bf16")
    tried = pd.read_csv(tmp_path / "layouts.csv")
    assert len(tried) == 4 and set(tried["optimizer_offload"]) == {0.0, 1.0}
    whole = tried.loc[tried["tile_tokens"].isna(), "seq"].max()
    tiles = tried.loc[tried["tile_tokens"] == 1024, "seq"].max()
    assert tiles > whole and row["seq"] == tiles == tried["seq"].iloc[0]
    assert row["method.tile_tokens"] == 1024 and row["predicted_tile_tokens"] == 1024
    # Adam off the device leaves room for at least as many tokens, at the host's pace: chosen where
    # it reaches further, else the faster one is
    at_tiles = tried[tried["tile_tokens"] == 1024].set_index("optimizer_offload")["seq"]
    assert at_tiles[1.0] >= at_tiles[0.0]
    assert row["train.optimizer_offload"] == ("host" if at_tiles[1.0] > at_tiles[0.0] else "none")
    # the row says how to run it: predicted again from the row (as calibration does), the same
    from memo.fit.calibration import problem_of_row

    problem, parallel, seq = problem_of_row(pd.Series(row))
    again = predict(problem, parallel, seq)
    assert (again.tile_tokens, again.seq, again.device_total) == (1024, row["seq"], row["predicted_device_bytes"])
