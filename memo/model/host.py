"""What Megatron-core needs to run where PyTorch has no CUDA (CPU-only builds).

Five places of megatron-core 0.16 assume CUDA even when nothing runs on a GPU:

* ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()``, and its
  forward picks a context-parallel rank's positions with a pinned index sent to the GPU.
  :class:`HostRotaryEmbedding` keeps them where they are and picks the positions on the host.
* Activation checkpointing (``tensor_parallel.checkpoint``, used by full and selective
  recomputation) saves and restores the CUDA generator's state around every recomputed region,
  and the embedding forks the tracker's "model-parallel-rng" state under sequence parallelism.
  Without CUDA there is no such generator, and the CPU generator, which Megatron saves as well,
  is the only source of randomness; :func:`run_megatron_on_host` makes the CUDA half a placeholder.
* The sequence-parallel collectives and the tensor-parallel linear layers allocate their
  gather and reduce-scatter outputs on ``torch.cuda.current_device()``. On a build without
  CUDA that call can only fail, so :func:`run_megatron_on_host` answers it with the host device.
* The pipeline schedules make their count of tokens with ``device="cuda"``, and a tied
  embedding's copy on the last pipeline stage is moved to the GPU (``.cuda()``) to be made equal to
  the first stage's; inside :class:`HostFactories` both stay on the host.

They are installed by the run's device, not by whether this machine has CUDA: a CPU job on a GPU
machine (the gloo tests, ``hardware=cpu``) needs them too, and a GPU job built after it in the same
process gets Megatron's own functions back (:func:`run_megatron_on_device`).
"""

import torch
from torch.overrides import TorchFunctionMode
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import random as megatron_random

from memo.model.context_parallel import part_for_rank


_ANGLES_KEPT = 32  # angle tensors a model keeps, as Megatron's cache of its forward


class HostRotaryEmbedding(RotaryEmbedding):
    """Megatron's RoPE with the frequency table left on the device it was built on, and each
    context-parallel rank's positions taken in ``sequence_layout``
    (:data:`memo.model.context_parallel.SEQUENCE_LAYOUTS`)."""

    sequence_layout = "load_balanced"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._angles: dict[tuple, torch.Tensor] = {}  # a call's arguments -> its angles

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """RoPE angles ``[seq, 1, 1, dim]`` for positions ``offset .. offset + max_seq_len``."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """RoPE angles of this context-parallel rank's positions (:meth:`angles`), made once per
        call and kept by this model. Megatron's ``lru_cache`` on the method is the class's: it
        kept the last 32 models of a process alive, their angles and process groups with them.
        Calls are keyed as that cache keys them (a length passed by keyword is another entry, as
        on a GPU), so a trace holds the angles the model's own call makes."""
        key, kept = (args, tuple(kwargs.items())), self._angles
        if key in kept:
            kept[key] = kept.pop(key)  # the most recently used last
        else:
            if len(kept) == _ANGLES_KEPT:
                kept.pop(next(iter(kept)))
            kept[key] = self.angles(*args, **kwargs)
        return kept[key]

    def angles(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        """The angles ``[s, 1, 1, d]`` of this context-parallel rank's positions, made now."""
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = part_for_rank(emb, 0, group.rank(), group.size(), self.sequence_layout)
        return emb


def forget_rotary_angles() -> None:
    """Drop the angles Megatron's ``RotaryEmbedding`` cached for the class (a GPU job's model
    uses its own): the cache holds the modules of the last 32 calls and their process groups, so
    each model built in this process would keep the earlier ones' tensors."""
    RotaryEmbedding.forward.cache_clear()


def _no_cuda_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*_args, **_kwargs) -> None:
    return None


def _host_device() -> str:
    return "cpu"


_ORIGINALS = {
    "get_rng": megatron_random._get_cuda_rng_state,
    "set_rng": megatron_random._set_cuda_rng_state,
    "current_device": torch.cuda.current_device,
}


def run_megatron_on_host() -> None:
    """Let Megatron-core's checkpointing and tensor-parallel layers run on the host (idempotent),
    for a job whose device is the CPU, whether or not the machine has CUDA.

    Only the CUDA generator's bookkeeping is replaced; the CPU generator is still saved before
    and restored for every recomputation, so dropout masks (if any) are replayed exactly.
    """
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _ignore_cuda_rng_state
    tracker = megatron_random.get_cuda_rng_tracker()
    names = ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng")
    tracker.set_states({name: _no_cuda_rng_state() for name in names})
    torch.cuda.current_device = _host_device


def run_megatron_on_device() -> None:
    """Undo :func:`run_megatron_on_host` (idempotent), for a GPU job after a CPU job in one process.
    The CUDA generator's states are Megatron's to add again (``model_parallel_cuda_manual_seed``)."""
    if megatron_random._get_cuda_rng_state is _no_cuda_rng_state:
        megatron_random.get_cuda_rng_tracker().reset()
    megatron_random._get_cuda_rng_state = _ORIGINALS["get_rng"]
    megatron_random._set_cuda_rng_state = _ORIGINALS["set_rng"]
    torch.cuda.current_device = _ORIGINALS["current_device"]


class HostFactories(TorchFunctionMode):
    """While active, a tensor asked for on "cuda" is made on the host and ``Tensor.cuda()`` leaves
    a tensor where it is: for Megatron's pipeline schedules and pipeline-parallel models in a CPU
    job. Every other call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)
