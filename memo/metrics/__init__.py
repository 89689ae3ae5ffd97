"""What a run is judged by: model FLOPs, MFU, TGS and peak memory."""

from memo.metrics.flops import mfu, model_flops, model_flops_per_sample, tgs
from memo.metrics.memory import PeakMemory

__all__ = ["PeakMemory", "mfu", "model_flops", "model_flops_per_sample", "tgs"]
