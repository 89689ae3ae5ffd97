"""``train.optimizer_offload=host``: Megatron-core's HybridDeviceOptimizer inside its distributed
optimizer, run by Megatron's own code on the CPU with CUDA stood in for (``cuda_standin``): where
each state lives, its bytes against the byte model, the losses against Adam on the device, and
the checks of the configuration."""

import dataclasses
import itertools

import pytest
import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from memo.config import ConfigError, resolve, validate
from memo.data.batches import SyntheticTokens, micro_batches
from memo.execute.optimizer import MegatronStepOptimizer, build_optimizer
from memo.execute.optimizer_offload import (
    hybrid_optimizers,
    offload_bytes,
    offloaded,
    pinned_block_bytes,
)
from memo.execute.train import TrainingStep, run_steps
from memo.policy import build_model

from conftest import compose_config, resolve_config
from cuda_standin import cuda_stand_in

# One layer of width 64 over 256 tokens of vocabulary: 66,496 parameters. bf16: Megatron's offloaded
# optimizer takes 16-bit weights only.
SMALL = ("seq=64", "model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=256",
         "model.num_attention_heads=4", "model.vocab_size=256", "train.dtype=bf16")


def _model(run) -> torch.nn.Module:
    """The model, built for the CPU (seed 0). Build it before CUDA is stood in for: building for
    the CPU points ``torch.cuda.current_device`` at the host, which the stand-in must answer."""
    torch.manual_seed(0)
    return build_model(run.workload, "cpu").module


def _train(run, offload: str, fraction: float = 1.0, steps: int = 10):
    return dataclasses.replace(run.train, steps=steps, warmup_steps=0, optimizer_offload=offload,
                               optimizer_offload_fraction=fraction)


def _losses(optimizer, train, run) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step of ``train.steps``, all on one batch of synthetic tokens
    (which the model learns by heart: the loss falls as the optimizer steps)."""
    tokens = SyntheticTokens(run.workload.model.vocab_size, 0)
    (batch,) = next(micro_batches(tokens, run.workload.seq, 1, 1, 0, 1, torch.device("cpu")))
    records = []
    run_steps(TrainingStep(optimizer, "cpu"), itertools.repeat([batch]), train, [records.append])
    return [(r["loss"], r["grad_norm"]) for r in records]


def _adams(optimizer: MegatronStepOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers that step: the hybrid optimizer's parts, or the distributed one's Adam."""
    adams = []
    for part in optimizer.optimizer.chained_optimizers:
        inner = part.optimizer
        adams += inner.sub_optimizers if isinstance(inner, HybridDeviceOptimizer) else [inner]
    return adams


def _device_state_bytes(cuda, optimizer: MegatronStepOptimizer) -> int:
    """Device bytes of the main weights and moments the optimizer's Adams hold (step counters,
    0-dimensional, aside)."""
    tensors = []
    for adam in _adams(optimizer):
        tensors += [p for group in adam.param_groups for p in group["params"]]
        tensors += [v for state in adam.state.values() for v in state.values() if v.dim() > 0]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if cuda.on_device(t)}
    return sum(storages.values())


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_states_and_main_weights_live_on_the_host_in_the_bytes_of_the_byte_model(parallel_state, fraction):
    run = resolve_config(*SMALL)
    models = _model(run), _model(run)
    with cuda_stand_in() as cuda:
        reference = MegatronStepOptimizer([models[0].cuda()], _train(run, "none", steps=1), sharded=True)
        _losses(reference, _train(run, "none", steps=1), run)
        train = _train(run, "host", fraction, steps=1)
        optimizer = MegatronStepOptimizer([models[1].cuda()], train, sharded=False)
        _losses(optimizer, train, run)  # Adam's states and the gradients' copies come at the first step

        (hybrid,) = hybrid_optimizers(optimizer.optimizer)
        shards = [p for group in hybrid.param_groups for p in group["params"]]
        on_host = offloaded([p.numel() for p in shards], fraction)
        assert all(on_host) == (fraction == 1.0) and any(on_host)
        for weight in optimizer.chunks[0].parameters():
            assert cuda.on_device(weight) and weight.dtype == torch.bfloat16
        held = dict.fromkeys(("master", "moments", "steps", "grads", "pinned"), 0)
        for shard, host in zip(shards, on_host, strict=True):
            state = hybrid.state[shard]
            main = state["master_param"]
            assert main.dtype == torch.float32 and main.shape == shard.shape
            # the step's new weights went back to the device's bf16 shard
            assert torch.equal(shard, main.to(torch.bfloat16))
            moments = (state["exp_avg"], state["exp_avg_sq"])
            if not host:
                assert cuda.on_device(main) and all(cuda.on_device(m) for m in moments)
                continue
            assert not cuda.on_device(main) and not cuda.pinned(main)  # fp32 copy of a pinned bf16 one
            assert all(not cuda.on_device(m) and not cuda.pinned(m) for m in moments)
            assert all(m.dtype == torch.float32 for m in moments)
            assert not cuda.on_device(state["step"])
            grad = main.grad
            assert not cuda.on_device(grad) and cuda.pinned(grad) and grad.dtype == torch.float32
            held["master"] += cuda.host_block_bytes(main)
            held["moments"] += sum(cuda.host_block_bytes(m) for m in moments)
            held["steps"] += cuda.host_block_bytes(state["step"])
            held["grads"] += cuda.host_block_bytes(grad)
            held["pinned"] += cuda.host_block_bytes(grad)
        removed = _device_state_bytes(cuda, reference) - _device_state_bytes(cuda, optimizer)

    model = optimizer.offload
    assert model.offloaded_params == sum(p.numel() for p, host in zip(shards, on_host) if host)
    assert model.master_bytes == held["master"] and model.moment_bytes == held["moments"]
    assert model.step_bytes == held["steps"] and model.grad_bytes == held["grads"]
    assert model.pinned_bytes == held["pinned"]
    assert model.host_bytes == held["master"] + held["moments"] + held["steps"] + held["grads"]
    assert model.device_bytes_removed == removed > 0


def test_ten_steps_give_the_losses_of_adam_on_the_device(parallel_state):
    run = resolve_config(*SMALL)
    models = {fraction: _model(run) for fraction in (None, 1.0, 0.5)}
    with cuda_stand_in():
        train = _train(run, "none")
        reference = MegatronStepOptimizer([models[None].cuda()], train, sharded=True)
        # PyTorch's fused AdamW, the kernel the host steps with: the runs then differ in where
        # Adam's states live and nothing else. (On a GPU the device's Adam is another kernel, whose
        # rounding differs: bf16 weights then part after a few steps.)
        for group in reference.optimizer.param_groups:
            group["fused"] = True
        expected = _losses(reference, train, run)
        got = {}
        for fraction in (1.0, 0.5):
            train = _train(run, "host", fraction)
            optimizer = MegatronStepOptimizer([models[fraction].cuda()], train, sharded=False)
            assert hybrid_optimizers(optimizer.optimizer)
            got[fraction] = _losses(optimizer, train, run)
    assert expected[-1][0] < expected[0][0] - 1  # it learns
    for fraction, steps in got.items():
        assert len(steps) == 10
        for (loss, norm), (loss_ref, norm_ref) in zip(steps, expected, strict=True):
            assert loss == pytest.approx(loss_ref, abs=1e-6), fraction
            assert norm == pytest.approx(norm_ref, rel=1e-6), fraction


def test_hybrid_optimizer_keeps_fp32_main_weights_pinned_as_the_byte_model_says():
    """Megatron's HybridDeviceOptimizer alone, on fp32 parameters (which its distributed optimizer
    cannot give it): the page-locked copy is the main weight."""
    numels = [700, 600, 500, 200]  # 60 %: the first two (1300 of 2000 elements)
    with cuda_stand_in() as cuda:
        params = [torch.nn.Parameter(torch.randn(n).cuda()) for n in numels]
        adam = torch.optim.AdamW
        hybrid = HybridDeviceOptimizer([{"params": params}], offload_fraction=0.6, cpu_optimizer_cls=adam,
                                       gpu_optimizer_cls=adam, param_update_in_fp32=True,
                                       overlap_cpu_optimizer_d2h_h2d=True, lr=1e-3, fused=True)
        for p in params:
            p.grad = torch.randn_like(p)
        hybrid.step()
        on_host = [p in hybrid.gpu_params_map_cpu_copy for p in params]
        host = [hybrid.param_to_inner_param[p] for p, h in zip(params, on_host) if h]
        assert all(not cuda.on_device(t) and cuda.pinned(t) for t in host)
        assert all(cuda.on_device(hybrid.param_to_inner_param[p]) for p, h in zip(params, on_host) if not h)
        pinned = sum(cuda.host_block_bytes(t) + cuda.host_block_bytes(t.grad) for t in host)
        # the moments and step counters (the state's master_param is the main weight itself)
        states = [v for t in host for v in hybrid.state[hybrid.inner_param_to_orig_param[t]].values()
                  if v is not t]
        held = pinned + sum(cuda.host_block_bytes(v) for v in states)
    assert on_host == offloaded(numels, 0.6) == [True, True, False, False]
    model = offload_bytes(numels, 4, 0.6)
    assert (model.host_bytes, model.pinned_bytes) == (held, pinned)
    assert model.device_bytes_removed == 8 * 1300


def test_the_byte_model_by_hand():
    # 16 elements, half on the host: the first two tensors (3 + 5), the third not (8 is not below 8)
    b = offload_bytes([3, 5, 8], param_bytes=2, fraction=0.5)
    assert b.offloaded_params == 8
    assert (b.master_bytes, b.moment_bytes, b.step_bytes) == (32, 64, 8)  # fp32, pageable
    assert b.grad_bytes == b.pinned_bytes == 16 + 32  # 12 and 20 bytes page-locked as 16 and 32
    assert (b.host_bytes, b.pageable_bytes, b.device_bytes_removed) == (152, 104, 96)
    assert [pinned_block_bytes(n) for n in (0, 1, 4096, 4097)] == [0, 1, 4096, 8192]
    # a count of 2^20 parameters as one tensor: page-locked sizes are powers of two already
    one = offload_bytes([2**20], param_bytes=2)
    assert one.host_bytes == 16 * 2**20 + 4 and one.device_bytes_removed == 12 * 2**20


def test_a_cpu_run_with_host_offload_is_refused_in_one_line(parallel_state):
    with pytest.raises(ConfigError) as refused:
        resolve_config("train.optimizer_offload=host")
    message = str(refused.value)
    assert "\n" not in message and "CPU" in message and message.endswith("set train.optimizer_offload=none")
    run = resolve_config(*SMALL)  # and where a CPU job reaches the optimizer without resolving
    with pytest.raises(ConfigError, match="this run trains on the CPU"):
        build_optimizer([_model(run)], _train(run, "host"), "cpu", run.workload.parallel)


def test_a_gpu_run_offloads_16_bit_weights_only():
    run = resolve(compose_config("train.optimizer_offload=host", "train.optimizer_offload_fraction=0.25"),
                  gpu_visible=True)
    assert (run.train.optimizer_offload, run.train.optimizer_offload_fraction) == ("host", 0.25)
    assert run.workload.dtype == "bf16"
    with pytest.raises(ConfigError, match=r"needs 16-bit weights .* set train.dtype=bf16"):
        resolve(compose_config("train.optimizer_offload=host", "train.dtype=fp32"), gpu_visible=True)


HOST = "train.optimizer_offload=host"


@pytest.mark.parametrize("overrides, expected", [
    ((HOST, "train.optimizer_offload_fraction=0"), r"=0.0 must be a fraction in \(0, 1\]"),
    ((HOST, "train.optimizer_offload_fraction=1.5"), r"=1.5 must be a fraction in \(0, 1\]"),
    ((HOST, "train.optimizer_offload_fraction=-0.5"), r"=-0.5 must be a fraction in \(0, 1\]"),
    (("train.optimizer_offload_fraction=0.5",), "applies to train.optimizer_offload=host only"),
    (("train.optimizer_offload=disk",), "choose one of: auto, none, host"),
    ((HOST, "train.distributed_optimizer=false"), "train.distributed_optimizer=false; drop that setting"),
])
def test_offload_settings_are_checked_in_one_line(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as refused:
        validate(compose_config(*overrides))
    assert "\n" not in str(refused.value)
