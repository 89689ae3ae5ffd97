"""MEMO: fine-grained activation memory management for ultra-long-context LLM training.

The package follows the life of a job: ``config`` (what to run) → ``model`` (the Megatron-core
GPT) → ``execute`` (distributed start-up, data, optimizer, training loop) → ``metrics`` (FLOPs,
MFU, TGS, memory) → ``results`` (the row each run leaves behind). ``gpucheck`` is the validation
pack that runs the GPU path end to end on a lent GPU.
"""

__version__ = "0.1.0"
