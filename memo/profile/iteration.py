"""Trace one training iteration of the real Megatron-core GPT, on one of three back-ends.

* ``fake``: the model and its data are fake tensors (``FakeTensorMode``): shapes, dtypes and
  storage lifetimes are real, nothing is allocated, so ``model=65b seq=1408k`` traces here in
  seconds. Tensor, context and data parallelism are played by a fake process group of the
  configured size: the trace is that of rank 0, with per-rank sizes. The model is the one a GPU
  run builds (Megatron's local layers, 16-bit weights unless ``train.dtype`` says otherwise);
  operators run with their CPU meta-kernels, so attention is PyTorch's fused kernel, which keeps
  the same output and log-sum-exp for backward as FlashAttention does on a GPU.
* ``cpu``: the same iteration on real CPU tensors (one process), to cross-check the fake trace.
* ``cuda``: the same on the GPU, from the caching allocator's own request stream
  (:mod:`memo.profile.cuda`), with the allocator's peak figures for the iteration.

One iteration is: forward of one micro-batch, loss, backward, optimizer step (AdamW whose
states exist already, as in every step after the first). Weights, their gradients' previous
values and optimizer states are not requests: they exist before the iteration starts. The
requests that hold the new gradients are listed in the trace's ``gradient_requests`` (fake and
CPU back-ends); any other request alive at the end persists from one iteration to the next.
"""

import contextlib
import dataclasses
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from omegaconf import OmegaConf

from memo.config import ConfigError, ParallelConfig, Workload
from memo.model import LayerBuild, build_gpt, dtype_label, torch_dtype
from memo.model.attention import select_backend
from memo.model.gpt import transformer_config
from memo.model.placement import LayerRuntime
from memo.profile.recorder import PhaseMarker, record
from memo.profile.trace import Trace

BACKENDS = ("fake", "cpu", "cuda")


class Traced(Protocol):
    """How the traced iteration's layers are built and run: an activation policy
    (:class:`memo.policy.ActivationPolicy`) is one."""

    @property
    def layers(self) -> LayerBuild:
        """How the model builds its decoder layers."""
        ...

    def check_trace(self) -> None:
        """Refuse, in one line, a trace of these layers."""
        ...

    def trace_runtime(self, model, workload: Workload, device: torch.device) -> LayerRuntime:
        """What runs ``model``'s layers in the traced iteration."""
        ...


def _plain(config) -> dict:
    """A config section (dataclass or OmegaConf node) as a plain dict for JSON."""
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return OmegaConf.to_container(config, resolve=True)


@contextlib.contextmanager
def unchecked_rng_forks() -> Iterator[None]:
    """Megatron's RNG tracker checks, when a fork ends, that the CPU generator is untouched, by
    reading a tensor's value; fake tensors have none. Traces draw no random numbers that matter
    (no dropout), so forks are plain no-ops while tracing."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *_args, **_kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork  # back to the class's method


@contextlib.contextmanager
def process_group(parallel: ParallelConfig, backend: str) -> Iterator[None]:
    """Megatron's parallel state for rank 0 of the configured layout, torn down afterwards."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    world = parallel.tp * parallel.cp * parallel.pp * parallel.dp
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        if world != 1:
            raise ConfigError(
                f"profile.backend={backend} traces one process, but tp·cp·pp·dp = {world}; "
                "use profile.backend=fake (any layout, per-rank sizes)"
            )
        dist.init_process_group("nccl" if backend == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            create_gloo_process_groups=False,
        )
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def trace_iteration(workload: Workload, traced: Traced, backend: str = "fake", seed: int = 1234) -> Trace:
    """Allocation trace of one iteration of rank 0 (see the module docstring).

    Args:
        workload: what is traced; its ``seq`` counts the tokens of all ranks (each holds its
            share), its ``loss`` is the loss traced.
        traced: how its layers are built and run (the run's activation policy, or the one a
            prediction traces for it).
        backend: "fake", "cpu" or "cuda".
        seed: the torch seed the weights are drawn from.

    Raises:
        ConfigError: for a back-end or method that cannot be traced here.
    """
    _check_traceable(workload, traced, backend)
    device = "cuda" if backend == "cuda" else "cpu"
    figures, gradients, buffers = {}, None, None
    with built_gpt(workload, traced.layers, backend, seed) as (gpt, attention):
        run, runtime = _iteration(gpt, workload, traced, device)
        if backend == "cuda":
            from memo.profile.cuda import record_cuda_iteration

            events, figures = record_cuda_iteration(gpt, run)
        else:
            recorder = record(gpt, run)
            events = recorder.events
            # The other requests alive at the end persist across iterations (Megatron's
            # all-gather buffer, RoPE's angles and table): a run holds them, unlike gradients,
            # which live in buffers made before training.
            gradients = sorted(
                r for r in (recorder.request_of(p.grad) for p in gpt.parameters() if p.grad is not None)
                if r is not None
            )
            # a runtime's own buffers (a walk that swaps: its tile buffers), made in the first step
            buffers = sorted(recorder.request_of(b) for b in runtime.device_buffers()) or None
    skeletal = runtime.report().skeletal_bytes
    meta = {
        "backend": backend,
        "model": _plain(workload.model),
        "method": workload.method.name,
        "loss": workload.loss,
        "parallel": _plain(workload.parallel),
        "seq": workload.seq,
        "tile_tokens": workload.layer_tile_tokens,
        "micro_batch_size": workload.micro_batch_size,
        "dtype": dtype_label(torch_dtype(workload)),
        "attention": attention,
        "gradient_requests": gradients,
        # a walk in tiles that swaps: the requests of its tile buffers, and one tile's skeletal
        # bytes as its runtime found them (input share, attention's output, the rest)
        "tile_buffer_requests": buffers,
        "tile_skeletal_bytes": None if skeletal is None else list(skeletal),
        **{f"cuda.{k}": v for k, v in figures.items()},
    }
    return Trace(events, meta)


@contextlib.contextmanager
def built_gpt(workload: Workload, layers: LayerBuild, backend: str = "fake",
              seed: int = 1234) -> Iterator[tuple[torch.nn.Module, str]]:
    """``workload``'s GPT for rank 0 of its layout, its layers built as ``layers`` says, on a
    back-end of :data:`BACKENDS` (fake tensors, real CPU ones, the GPU), inside that back-end's
    process group (and fake mode) until the block ends; with the SDPA kernel its attention runs."""
    device = "cuda" if backend == "cuda" else "cpu"
    config = transformer_config(workload, device)
    grouped = config.num_query_groups not in (None, config.num_attention_heads)
    # a real probe, outside fake mode
    attention = select_backend(device, torch_dtype(workload), config.kv_channels, "auto", grouped)
    mode = contextlib.nullcontext()
    if backend == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with process_group(workload.parallel, backend), mode:
        torch.manual_seed(seed)
        yield build_gpt(workload, device, attention, layers=layers).module, attention


def step_tokens(workload: Workload, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (zeros, also the labels) and positions ``[b, s]`` of one micro-batch of
    ``workload`` on ``device``."""
    b, seq = workload.micro_batch_size, workload.seq
    return (torch.zeros(b, seq, dtype=torch.long, device=device),
            torch.arange(seq, device=device).unsqueeze(0).expand(b, seq))


def _check_traceable(workload: Workload, traced: Traced, backend: str) -> None:
    """Refuse, in one line, a trace this function cannot make."""
    if backend not in BACKENDS:
        raise ConfigError(f"profile.backend={backend} is not a back-end; "
                          f"choose one of: {', '.join(BACKENDS)}")
    if backend == "cuda" and not torch.cuda.is_available():
        raise ConfigError("profile.backend=cuda needs a GPU and none is visible here; "
                          "use profile.backend=fake")
    traced.check_trace()
    parallel = workload.parallel
    if parallel.pp > 1:
        raise ConfigError(f"parallel.pp={parallel.pp}: traces cover one pipeline stage only; "
                          "use parallel.pp=1")
    if parallel.cp > 1:
        raise ConfigError(f"parallel.cp={parallel.cp}: a trace follows one process and context "
                          "parallelism exchanges keys and values with the others; use parallel.cp=1 "
                          "(mode=fit adds the exchange's buffers to one rank's tokens)")


def _iteration(gpt, workload: Workload, traced: Traced, device: str) -> tuple[Callable, LayerRuntime]:
    """The traced iteration of ``gpt``, and the runtime of its layers (``traced``'s): Adam's states
    made first, as after the first step; then forward, loss, backward and the optimizer's step,
    each phase told to the marker the recorder gives it."""
    # One implementation on every back-end (the CUDA default, foreach, allocates otherwise).
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4, foreach=False)
    for p in gpt.parameters():  # states exist before the traced step, as after step 1
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens, positions = step_tokens(workload, device)
    runtime = traced.trace_runtime(gpt, workload, torch.device(device))

    def run(marker: PhaseMarker) -> None:
        runtime.name_phases(marker.enter_layer)
        with unchecked_rng_forks():
            per_token = gpt(tokens, positions, None, labels=tokens)
            loss = per_token.float().mean()
            marker.backward()
            loss.backward()
            del per_token, loss
            marker.optimizer()
            optimizer.step()

    return run, runtime


