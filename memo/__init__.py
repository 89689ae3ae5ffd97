"""MEMO: fine-grained activation memory management for ultra-long-context LLM training.

The package follows the pipeline of the method: ``profile`` (trace one iteration's allocations)
→ ``plan`` (the bi-level memory plan, on the general solvers of ``dsa``) → ``execute``
(distributed start-up, data, optimizer, the plan at run time, the training loop). ``swap`` is
what a layer keeps for its backward pass and where (MEMO's swapping and α, layers walked in
tiles), beneath the profiler and above ``model``, whose layers it is given to → ``metrics`` (FLOPs, MFU, TGS, memory) → ``results`` (the files a run leaves).
``config`` says what to run and resolves it once into a typed ``Run`` whose ``Workload`` (model,
method, layout, tokens, dtype) the rest takes; ``model`` builds the Megatron-core GPT, ``fit``
predicts without running, and ``modes`` holds the jobs ``run.py`` runs (train, profile/plan,
fit), each inside one frame.
``gpucheck`` is the validation pack that runs the GPU path end to end on a lent GPU.
"""

__version__ = "0.1.0"

import warnings as _warnings

# What the libraries announce that no user of this suite can act on, silenced for every entry point
# (run.py and each python -m memo....) before any of them imports megatron-core: its notes on the
# optional packages it did not find and on its own defaults, and torch's deprecations of the
# ShardedTensor, the load_state_dict and the collectives' old names that megatron-core still uses.
for _message in (r".*(Apex|Transformer Engine).*not installed.*", r"full scope is deprecated",
                 r".*CUDA_DEVICE_MAX_CONNECTIONS.*", r"Please use DTensor instead.*ShardedTensor",
                 r"`load_state_dict` is deprecated", r"`torch.distributed.\w+` is deprecated"):
    _warnings.filterwarnings("ignore", message=_message)
