"""What a run is judged by: model FLOPs, MFU, TGS and peak memory."""

from memo.metrics.flops import ATTENTION_BACKWARD_FLOPS, mfu, mfu_ceiling, model_flops, model_flops_per_sample, tgs
from memo.metrics.memory import PeakMemory

__all__ = ["ATTENTION_BACKWARD_FLOPS", "PeakMemory", "mfu", "mfu_ceiling", "model_flops", "model_flops_per_sample", "tgs"]
