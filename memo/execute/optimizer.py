"""Adam with gradient reduction and clipping over Megatron's process groups.

On a GPU this is Megatron-core's own stack, as Megatron-LM trains: ``DistributedDataParallel``
(contiguous fp32 gradient buffers) and ``get_megatron_optimizer`` (fp32 main weights for 16-bit
models, optional distributed optimizer, loss scaling for fp16). Those allocate on CUDA, so on the
CPU :class:`HostOptimizer` does the same arithmetic with ``torch.optim.AdamW``: gradients
averaged over data parallel, one global norm over tensor-parallel shards, clipped, then Adam
with decoupled weight decay on matrices only (not on biases and norm weights).

``train.optimizer_offload=host`` keeps Adam's states and the fp32 main weights of a GPU run in
host memory (:mod:`memo.execute.optimizer_offload`).
"""

import logging
import math
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, \
    optim_state_to_sharding_state
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from memo.config import ParallelConfig, TrainConfig, shards_optimizer
from memo.config.resolve import check_optimizer_offload
from memo.execute.optimizer_offload import NO_OFFLOAD, OffloadBytes, build_offloaded, built_offload_bytes, \
    offload_config, optimizer_parts, release_build_copies, settle_loaded_state


log = logging.getLogger("memo")

# megatron-core's checkpoint format of the optimizer's state that any parallel layout loads
_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}

# train.dtype's names of the weights' dtypes
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


class StepOptimizer(Protocol):
    """What the training loop needs from an optimizer."""

    name: str
    # the modules to run forward on, the rank's model chunks (DDP wrappers of them on GPUs)
    chunks: list[torch.nn.Module]
    offload: OffloadBytes  # what it keeps in host memory for a GPU (train.optimizer_offload=host)

    def zero_grad(self) -> None: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def step(self, lr: float) -> float:
        """Reduce and clip gradients, update weights; returns the gradient norm before clipping."""
        ...

    def sharded_state_dict(self, model_state: dict, is_loading: bool = False) -> dict:
        """The optimizer's state for megatron-core's distributed checkpointing: each parameter's
        states as sharded tensors of ``model_state``'s (the model's ``sharded_state_dict``)
        coordinates, loadable at any parallel layout; made to load into where ``is_loading``."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Take the state :meth:`sharded_state_dict` described, as loaded."""
        ...


def single_chunk(optimizer: StepOptimizer) -> torch.nn.Module:
    """The one model chunk ``optimizer`` trains (a rank of every layout but an interleaved pipeline)."""
    if len(optimizer.chunks) != 1:
        raise ValueError(f"the optimizer trains {len(optimizer.chunks)} model chunks (parallel.vpp)")
    return optimizer.chunks[0]


def _param_groups(chunks: list[torch.nn.Module], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in (p for chunk in chunks for p in chunk.parameters()):
        if param.requires_grad:
            (decay if param.dim() > 1 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _all_reduce(tensors: list[torch.Tensor], group, average: bool = False) -> None:
    """Sum (or average) ``tensors`` over ``group`` in place, a tensor at a time: a flat buffer of
    them all would be a copy of every gradient at the optimizer's step (Megatron's buffer on a GPU
    is reduced where it lies)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for tensor in tensors:
        dist.all_reduce(tensor, group=group)
        if average:
            tensor /= size


_NORM_CHUNK = 1 << 16  # elements of a gradient squared in float64 at a time (512 KiB)


class HostOptimizer:
    """``torch.optim.AdamW`` with Megatron's data-parallel averaging and global-norm clipping."""

    name = "torch_adamw"
    offload = NO_OFFLOAD  # its states are on the host, as the whole run is

    def __init__(self, chunks: list[torch.nn.Module], train: TrainConfig):
        self.chunks = chunks
        self.clip_grad = train.clip_grad
        self.optimizer = torch.optim.AdamW(
            _param_groups(chunks, train.weight_decay),
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=1e-8,
            # one kernel per tensor, in place: the single-tensor loop makes two temporaries the size
            # of each parameter (the second moment's root, then its quotient), a step's peak on a
            # CPU whose activations are small beside its vocabulary's weights
            fused=True,
        )

    def zero_grad(self) -> None:
        # zeroed in place: the gradients live from step to step, as in Megatron's gradient buffer on
        # a GPU (and as the fit counts them), not made again by every backward
        self.optimizer.zero_grad(set_to_none=False)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, lr: float) -> float:
        params = reduce_gradients(self.chunks)
        grads = [p.grad for p in params]
        norm = self.grad_norm(params)
        if self.clip_grad > 0 and norm > self.clip_grad:
            torch._foreach_mul_(grads, self.clip_grad / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return norm

    def sharded_state_dict(self, model_state: dict, is_loading: bool = False) -> dict:
        # As megatron-core's FP32Optimizer does it for a torch optimizer: the moments sharded as
        # their parameters are, Adam's step (the same for every parameter) saved once.
        if is_loading:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if not self.optimizer.state[p]:
                        self.optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state = self.optimizer.state_dict()
        step = MegatronOptimizer._extract_common_per_param_step(state)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, params),
                                      exclude_keys=("step",))
        if step is not None:
            state["state"]["common_step"] = step
        return state

    def load_state_dict(self, state: dict) -> None:
        step = state["state"].pop("common_step", None)
        if step is not None:
            MegatronOptimizer._restore_common_per_param_step(state, step)
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:  # a state saved before steps were fused says otherwise
            group["fused"] = True

    @staticmethod
    def grad_norm(params: list[torch.nn.Parameter]) -> float:
        """L2 norm of the whole model's gradient: shards summed over tensor and pipeline
        parallel, weights replicated over tensor parallel counted once, a tied embedding's copy
        on the last pipeline stage left out."""
        local = torch.zeros((), dtype=torch.float64)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                # in float64, a chunk at a time: no float64 copy of a whole gradient
                for chunk in p.grad.detach().reshape(-1).split(_NORM_CHUNK):
                    local += chunk.double().square().sum()
        dist.all_reduce(local, group=parallel_state.get_model_parallel_group())
        return math.sqrt(local.item())


def reduce_gradients(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Make each gradient of this rank's model ``chunks`` the whole batch's, as Megatron's
    ``finalize_model_grads`` does, and return the parameters that have one: sums over the
    tensor-parallel ranks where each saw part of the work, the tied embedding's two ends summed
    across the pipeline, then the mean over the data-parallel (and context-parallel) replicas."""
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if p.grad is not None]
    # Under sequence parallelism each tensor-parallel rank saw only its slice of the sequence, so
    # the weights applied to slices (norms, row-parallel biases) hold partial sums; the query and
    # key norms (qk_layernorm) saw only the rank's heads, with or without it (summed by name)
    _all_reduce([p.grad for n, p in named if getattr(p, "sequence_parallel", False)
                 or "q_layernorm" in n or "k_layernorm" in n],
                parallel_state.get_tensor_model_parallel_group())
    # a tied embedding's ends on the first and last pipeline stages (Megatron's copies) take the
    # sum of both's gradients
    ends = _tied_embedding_ends(chunks)
    if ends:  # (only the first and last stages are in the embedding group)
        _all_reduce([w.grad for w in ends], parallel_state.get_embedding_group())
    params = [p for _, p in named]
    _all_reduce([p.grad for p in params], parallel_state.get_data_parallel_group(with_context_parallel=True),
                average=True)
    return params


def _tied_embedding_ends(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """This rank's ends of a word embedding tied to the output layer across pipeline stages: the
    first stage's embedding, the last stage's copy (none without pipeline parallelism)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return []
    ends = [chunk for chunk in (chunks[0], chunks[-1]) if chunk.share_embeddings_and_output_weights]
    ends = [chunk for chunk in dict.fromkeys(ends) if chunk.pre_process or chunk.post_process]
    return [chunk.shared_embedding_or_output_weight() for chunk in ends]


class MegatronStepOptimizer:
    """Megatron-core's DDP and optimizer, stepped as Megatron-LM's ``train_step`` does: the
    learning rate and weight decay of each parameter group set every step as its scheduler sets
    them (no decay where Megatron's groups say ``wd_mult`` 0: biases and norm weights).

    With ``train.optimizer_offload=host`` the optimizer is Megatron's ``HybridDeviceOptimizer``
    inside its distributed optimizer, turned on for it (:mod:`memo.execute.optimizer_offload`);
    :attr:`offload` gives its host bytes."""

    name = "megatron"

    def __init__(self, chunks: list[torch.nn.Module], train: TrainConfig, sharded: bool):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = chunks[0].config
        offload = train.optimizer_offload == "host"
        sharded = sharded or offload
        self.weight_decay = train.weight_decay
        self._finalize = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=sharded)
        # as Megatron-LM wraps a model's chunks: the first's buckets alone take the data-parallel
        # reduction's bucket size, the others' all their parameters in one
        self.chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=index > 0)
                       for index, chunk in enumerate(chunks)]
        fields = dict(
            optimizer="adam",
            lr=train.lr,
            weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1,
            adam_beta2=train.adam_beta2,
            clip_grad=train.clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=sharded,
        )
        if offload:
            fraction = train.optimizer_offload_fraction
            self.optimizer = build_offloaded(offload_config(fraction, **fields), self.chunks)
            self.offload = built_offload_bytes(self.optimizer, config.params_dtype.itemsize)
            log.info("optimizer offload: Adam's states of %d parameters on the host, %.3f GiB (%.3f GiB "
                     "page-locked), %.3f GiB less on the device", self.offload.offloaded_params,
                     self.offload.host_bytes / 2**30, self.offload.pinned_bytes / 2**30,
                     self.offload.device_bytes_removed / 2**30)
        else:
            self.optimizer = get_megatron_optimizer(OptimizerConfig(**fields), self.chunks)
            self.offload = NO_OFFLOAD

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def step(self, lr: float) -> float:
        self._finalize(self.chunks)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
            group["weight_decay"] = self.weight_decay * group["wd_mult"]
        _, grad_norm, _ = self.optimizer.step()
        return float("nan") if grad_norm is None else float(grad_norm)

    def sharded_state_dict(self, model_state: dict, is_loading: bool = False) -> dict:
        if is_loading:
            self._allocate_state()
        # Megatron-LM's choice for a checkpoint any layout loads: the distributed optimizer's
        # shards gathered into each parameter's own coordinates ("fully_reshardable").
        return self.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_RESHARDABLE)

    def _allocate_state(self) -> None:
        """Give each distributed optimizer's inner optimizer its state (Adam's moments and step),
        which a load overwrites. Megatron-core's distributed optimizer reads the step from that
        state to describe what it loads, and with PyTorch's Adam (no Transformer Engine or Apex)
        cannot before the first step. One step at learning rate and weight decay 0, on zero
        gradients, makes the state without moving a weight."""
        for part in optimizer_parts(self.optimizer):
            inner = part.optimizer
            if not isinstance(part, DistributedOptimizer) or len(inner.state) > 0:
                continue  # (Megatron's other optimizers make their state when asked to load)
            settings = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
            for group in inner.param_groups:
                group["lr"] = group["weight_decay"] = 0.0
            part._init_optimizer_states_with_dummy_values()  # megatron-core's: zero gradients, one step
            for group, (lr, weight_decay) in zip(inner.param_groups, settings):
                group["lr"], group["weight_decay"] = lr, weight_decay

    def load_state_dict(self, state: dict) -> None:
        # (one state per part, read as ChainedOptimizer.load_state_dict reads them)
        parts = optimizer_parts(self.optimizer)
        states = [state] if len(parts) == 1 else [state[key] for key in sorted(state)]
        for part, part_state in zip(parts, states, strict=True):
            if isinstance(part, DistributedOptimizer) and "param_state" in part_state:
                _load_distributed(part, part_state)
            else:
                part.load_state_dict(part_state)
        if len(parts) > 1:  # (as ChainedOptimizer.load_state_dict ends: fused Adam's group steps aligned)
            self.optimizer._synchronize_steps()


def _load_distributed(optimizer: DistributedOptimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` for PyTorch's Adam as well as for Transformer
    Engine's. Megatron-core writes the loaded tensors into every entry of the Adam state of each
    parameter, which for PyTorch's Adam includes the step, which the checkpoint holds apart (a
    KeyError), and gives every parameter the same step tensor, which each step then advances once
    per parameter. So the tensors are loaded with the steps set aside, and each parameter gets a
    step of its own (with Adam offloaded to the host, :func:`settle_loaded_state` places it)."""
    if state["param_state_sharding_type"] != _RESHARDABLE["distrib_optim_sharding_type"]:
        raise ValueError(f"the distributed optimizer's state is {state['param_state_sharding_type']}, this version "
                         f"loads {_RESHARDABLE['distrib_optim_sharding_type']}")
    optimizer.load_state_dict({k: v for k, v in state.items() if k != "param_state"})  # groups, step
    steps = {param: param_state.pop("step") for param, param_state in optimizer.optimizer.state.items()
             if "step" in param_state}
    optimizer.load_parameter_state_from_fully_reshardable(state["param_state"])
    if isinstance(optimizer.optimizer, HybridDeviceOptimizer):
        if steps:
            settle_loaded_state(optimizer.optimizer, next(iter(steps.values())))
        release_build_copies()  # the 16-bit page-locked copies the load's rebuilds of it made
        return
    for param, step in steps.items():
        optimizer.optimizer.state[param]["step"] = step.clone()


def checkpoint_format(train: TrainConfig, device_type: str, parallel: ParallelConfig) -> str:
    """The format of the state :func:`build_optimizer` builds, in a checkpoint (one optimizer cannot
    load another's, and Adam on the host steps fused where the device's does not): known before
    it is built, so that a resume it cannot serve is refused first."""
    if device_type != "cuda":
        return HostOptimizer.name
    if train.optimizer_offload == "host":
        return "megatron_host_offload"
    return "megatron_distributed" if shards_optimizer(train.distributed_optimizer, parallel) else "megatron"


def build_optimizer(chunks: list[torch.nn.Module], train: TrainConfig, device_type: str,
                    parallel: ParallelConfig) -> StepOptimizer:
    """Megatron's optimizer on a GPU (distributed where :func:`memo.config.shards_optimizer`
    says, or where ``train.optimizer_offload=host``), :class:`HostOptimizer` on the CPU.

    Raises:
        ConfigError: for ``train.optimizer_offload=host`` on the CPU or with fp32 weights.
    """
    check_optimizer_offload(train.optimizer_offload, device_type, _DTYPE_NAMES[chunks[0].config.params_dtype])
    if device_type == "cuda":
        return MegatronStepOptimizer(chunks, train, shards_optimizer(train.distributed_optimizer, parallel))
    return HostOptimizer(chunks, train)
