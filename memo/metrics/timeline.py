"""Where a step's time goes, from its ``torch.profiler`` trace (Chrome's trace format, as
``export_chrome_trace`` writes it): device time by category.

On a GPU every kernel, copy and fill of the step is one of:

* ``attention_forward``, ``attention_backward``: the fused attention kernels (cuDNN's, FlashAttention's,
  the memory-efficient kernel's), by name;
* ``gemm_forward``, ``gemm_recompute``, ``gemm_backward``: every other GEMM, by the pass that launched
  it: a kernel launched inside an autograd node that recomputes (:data:`RECOMPUTING_NODES`: the
  walk's layer, Megatron's checkpoint, the swap runtime's backward start) but not inside a node of
  its own is a recomputation's, one inside any other node a gradient's, one outside the backward
  pass the forward's;
* ``communication``: NCCL's kernels;
* ``copy_h2d``, ``copy_d2h``, ``copy_d2d``: copies, with how much of each ran while a kernel did
  (``overlapped_s``);
* ``elementwise``: everything else (the merges of attention blocks, norms, activations, casts,
  fills, the optimizer's kernels);
* ``launch_gaps``: the device idle between two kernels for less than :data:`LAUNCH_GAP_US` (the
  next one was still being launched), and ``idle``: longer gaps (the host busy, or waiting).

On the CPU (no device events) the step's ATen operators stand in for kernels, each by its self
time, by the same rules on their names; copies are not told apart by direction there.
"""

import bisect
import math
import re
from collections import defaultdict
from typing import Iterable, Optional

LAUNCH_GAP_US = 20.0
# autograd nodes whose backward runs forward work again before its own gradients
RECOMPUTING_NODES = ("_TiledLayerBackward", "CheckpointFunctionBackward", "_BackwardStartBackward",
                     "CheckpointWithoutOutputFunctionBackward")
_ATTENTION_FORWARD = re.compile(r"flash_fwd|fmha\w*(fprop|fwd|cutlassF)|sdpa\w*fprop|fprop\w*sdpa|"
                                r"_scaled_dot_product_\w*attention(_for_cpu)?$|_(flash|efficient)_attention_forward", re.I)
_ATTENTION_BACKWARD = re.compile(r"flash_bwd|fmha\w*(bprop|bwd|cutlassB)|sdpa\w*bprop|bprop\w*sdpa|dot_do_o|"
                                 r"convert_dq|attention\w*_backward", re.I)
_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|s16816|aten::(mm|addmm|bmm|baddbmm|addmm_)$", re.I)
_COMMUNICATION = re.compile(r"nccl|gloo|c10d::", re.I)
_NODE = "autograd::engine::evaluate_function: "
CATEGORIES = ("attention_forward", "attention_backward", "gemm_forward", "gemm_recompute", "gemm_backward",
              "communication", "copy_h2d", "copy_d2h", "copy_d2d", "elementwise", "launch_gaps", "idle")


def kind_of(name: str) -> str:
    """The category of a kernel or operator by its name alone: attention's, a GEMM (``gemm``),
    communication, or ``elementwise``."""
    if _ATTENTION_BACKWARD.search(name):
        return "attention_backward"
    if _ATTENTION_FORWARD.search(name):
        return "attention_forward"
    if _COMMUNICATION.search(name):
        return "communication"
    if _GEMM.search(name):
        return "gemm"
    return "elementwise"


class _Ranges:
    """The autograd nodes' ranges of each host thread: the innermost one around an instant."""

    def __init__(self, events: Iterable[dict]):
        self._by_thread = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and str(e.get("name", "")).startswith(_NODE):
                self._by_thread[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                                                      e["name"][len(_NODE):]))
        for ranges in self._by_thread.values():
            ranges.sort()
        self._starts = {tid: [r[0] for r in ranges] for tid, ranges in self._by_thread.items()}

    def innermost(self, tid, ts: float) -> Optional[str]:
        """The node whose range around ``ts`` on thread ``tid`` starts last (ranges nest)."""
        ranges = self._by_thread.get(tid, [])
        for i in range(bisect.bisect_right(self._starts.get(tid, []), ts) - 1, -1, -1):
            start, end, name = ranges[i]
            if start <= ts <= end:
                return name
        return None


def gemm_pass(node: Optional[str]) -> str:
    """``gemm_forward``, ``gemm_recompute`` or ``gemm_backward`` for a GEMM launched inside
    autograd node ``node`` (innermost; None: outside the backward pass)."""
    if node is None:
        return "gemm_forward"
    return "gemm_recompute" if node in RECOMPUTING_NODES else "gemm_backward"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` (``(start, end)``) merged where they overlap, in order."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    """How much of ``interval`` the intervals of ``merged`` (:func:`union`'s) cover."""
    start, end = interval
    total = 0.0
    for a, b in merged[max(bisect.bisect_right(merged, (start, math.inf)) - 1, 0):]:
        if a >= end:
            break
        total += max(0.0, min(b, end) - max(a, start))
    return total


def table(trace: dict) -> list[dict]:
    """The step's time by category (:data:`CATEGORIES`): rows of ``category``, ``seconds``,
    ``share`` (of the step's span on the device, or the host's busy time on the CPU), ``count`` and,
    for copies, ``overlapped_s``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ranges = _Ranges(events)
    return _device_table(device, events, ranges) if device else _host_table(events, ranges)


def _device_table(device: list[dict], events: list[dict], ranges: _Ranges) -> list[dict]:
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    seconds, counts, overlapped = defaultdict(float), defaultdict(int), defaultdict(float)
    kernels, copies = [], []
    for e in device:
        start, dur, name = float(e["ts"]), float(e["dur"]), str(e["name"])
        if e["cat"] == "gpu_memcpy":
            direction = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "d2d"
            category = f"copy_{direction}"
            copies.append((category, (start, start + dur)))
        else:
            category = kind_of(name)
            if category == "gemm":
                launch = launches.get(e.get("args", {}).get("correlation"))
                node = None if launch is None else ranges.innermost(launch.get("tid"), float(launch["ts"]))
                category = gemm_pass(node)
            kernels.append((start, start + dur))
        seconds[category] += dur / 1e6
        counts[category] += 1
    busy = union(kernels)
    for category, interval in copies:
        overlapped[category] += covered(interval, busy) / 1e6
    span = (max(float(e["ts"]) + float(e["dur"]) for e in device) - min(float(e["ts"]) for e in device)) / 1e6
    for (_, end), (start, _) in zip(busy, busy[1:]):
        gap = start - end
        category = "launch_gaps" if gap < LAUNCH_GAP_US else "idle"
        seconds[category] += gap / 1e6
        counts[category] += 1
    return _rows(seconds, counts, overlapped, span)


def _host_table(events: list[dict], ranges: _Ranges) -> list[dict]:
    """The CPU's ATen operators, each by its self time (without the operators inside it)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and str(e["name"]).startswith("aten::")),
                 key=lambda e: (e.get("tid"), float(e["ts"]), -float(e["dur"])))
    own = [float(e["dur"]) for e in ops]
    stack: list[int] = []  # the operators open around the current one, on its thread
    for i, e in enumerate(ops):
        start = float(e["ts"])
        while stack and (ops[stack[-1]].get("tid") != e.get("tid")
                         or float(ops[stack[-1]]["ts"]) + float(ops[stack[-1]]["dur"]) <= start):
            stack.pop()
        if stack:
            own[stack[-1]] -= float(e["dur"])
        stack.append(i)
    seconds, counts = defaultdict(float), defaultdict(int)
    for e, self_us in zip(ops, own):
        name = str(e["name"])
        category = kind_of(name)
        if category == "gemm":
            category = gemm_pass(ranges.innermost(e.get("tid"), float(e["ts"])))
        elif category == "elementwise" and name in ("aten::copy_", "aten::_to_copy"):
            category = "copy_d2d"
        seconds[category] += max(self_us, 0.0) / 1e6
        counts[category] += 1
    return _rows(seconds, counts, {}, sum(seconds.values()))


def top_kernels(trace: dict, count: int = 25) -> list[dict]:
    """The ``count`` kernels (on the CPU: operators, inner and outer) that took the most time, by
    name: ``name``, ``category`` (:func:`kind_of`), ``calls``, ``seconds``; what the
    categories are made of, to check their rules against the names a device's libraries use."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    chosen = device or [e for e in events if e.get("cat") == "cpu_op"]
    seconds, calls = defaultdict(float), defaultdict(int)
    for e in chosen:
        seconds[e["name"]] += float(e["dur"]) / 1e6
        calls[e["name"]] += 1
    ranked = sorted(seconds, key=seconds.get, reverse=True)[:count]
    return [{"name": n, "category": kind_of(n), "calls": calls[n], "seconds": seconds[n]} for n in ranked]


def _rows(seconds: dict, counts: dict, overlapped: dict, span: float) -> list[dict]:
    return [{"category": c, "seconds": seconds[c], "share": seconds[c] / span if span else None, "count": counts[c],
             "overlapped_s": overlapped.get(c) if c.startswith("copy_") else None}
            for c in CATEGORIES if counts[c]]
