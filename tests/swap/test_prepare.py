"""A policy's prepare: the one way a model's layers get their runtime, and the rules it owns."""

import dataclasses

import pytest
import torch

from memo.config import ParallelConfig
from memo.hardware import HARDWARE
from memo.model.placement import NullRuntime, Placed, RuntimeReport
from memo.policy import build_model, policy_of
from memo.swap import SwapRuntime, TileReport, TiledLayers, host_budget, host_share
from memo.swap.prepare import segments, sequence_chunks

from conftest import resolve_config

CPU = torch.device("cpu")


def _placements(model) -> dict[str, object]:
    return {name: module.placement for name, module in model.named_modules() if isinstance(module, Placed)}


@pytest.mark.parametrize("method, placed", [("none", None), ("megatron_full_recompute", None),
                                            ("full_recompute", None), ("memo", SwapRuntime),
                                            ("full_swap", SwapRuntime)])
def test_each_method_gets_the_placement_it_runs_with(single_process, method, placed):
    workload = resolve_config(f"method={method}", "model.num_layers=4", "seq=128").workload
    model = build_model(workload, "cpu").module
    placement = policy_of(workload).prepare(model, workload, CPU, 2**40)
    report = placement.report()
    if placed is None:
        assert isinstance(placement, NullRuntime) and report == RuntimeReport()
        assert all(p is None for p in _placements(model).values())
        return
    assert isinstance(placement, placed) and report.row["swap.alpha"] is not None
    given = _placements(model)
    # every module of a layer that makes a saved tensor: the layer, its two norms, rotary
    # attention, core attention, QKV and FC1, the activation; the final norm is the loss's
    inside = {name for name in given if name.startswith("decoder.layers.")}
    assert len(inside) == 4 * 8 and all(given[name] is placement for name in inside)
    assert [given[name] for name in set(given) - inside] == [None]
    placement.detach()
    assert all(p is None for p in _placements(model).values())
    placement.release()


@pytest.mark.parametrize("method", ["memo", "full_recompute"])
def test_tiles_take_over_the_layer_and_its_core_attention_and_memo_swaps_the_rest(single_process, method):
    workload = resolve_config(f"method={method}", "method.tile_tokens=32", "model.num_layers=4",
                              "seq=128").workload
    model = build_model(workload, "cpu").module
    walk = policy_of(workload).prepare(model, workload, CPU, 2**40)
    assert isinstance(walk, TiledLayers) and (walk.swap is not None) == (method == "memo")
    assert isinstance(walk.tile_report, TileReport) if method == "memo" else walk.tile_report is None
    given = _placements(model)
    placed = {name for name, p in given.items() if p is walk}
    assert placed == {f"decoder.layers.{i}{part}" for i in range(4)
                      for part in ("", ".self_attention.core_attention")}
    inside = {name for name in given if name.startswith("decoder.layers.")}
    # memo: the layer's other modules make their saved tensors in the tile buffers
    assert {name for name in inside - placed if given[name] is not None} == \
        (inside - placed if method == "memo" else set())
    assert (walk.swap is not None) == (method == "memo")
    walk.release()


def test_no_model_module_carries_a_runtime_attribute(single_process):
    workload = resolve_config("method=memo", "model=tiny_llama", "model.num_layers=2", "seq=128").workload
    model = build_model(workload, "cpu").module
    policy_of(workload).prepare(model, workload, CPU, 2**40).release()
    assert [name for name, module in model.named_modules() if "runtime" in vars(module)] == []


@pytest.mark.parametrize("parallel, chunks, runs", [
    (ParallelConfig(), 1, 1),
    (ParallelConfig(tp=2, sequence_parallel=True), 2, 1),
    (ParallelConfig(tp=2), 1, 1),
    (ParallelConfig(cp=2), 1, 2),  # one input holds both of the rank's chunks
    (ParallelConfig(tp=2, cp=2, sequence_parallel=True), 2, 1),
])
def test_chunks_and_segments_follow_the_layout(parallel, chunks, runs):
    assert (sequence_chunks(parallel), segments(parallel)) == (chunks, runs)


def test_training_takes_the_hosts_share_the_fit_predicts_with():
    # 8 GPUs on a node of 2 TiB: each process may fill 256 GiB
    assert host_share(2 * 2**40, 8) == 256 * 2**30
    assert host_share(2**30, None) == 2**30  # a machine of one device
    hw = dataclasses.replace(HARDWARE["cpu"], host_memory_bytes=6 * 2**30, devices_per_node=3)
    assert host_budget(hw, CPU, job_devices=3) == host_budget(hw, CPU, job_devices=6) == 2 * 2**30
    # a job on one of the node's devices has the node's host memory for it
    assert host_budget(hw, CPU, job_devices=1) == 6 * 2**30
