"""The collectives' code paths in one process: context-parallel attention and the tiled linear
layers over a process group of one rank (NCCL on a GPU, gloo on the CPU), against the same
computation without the group. A lent machine has one GPU, and NCCL refuses two ranks on one
device, so this is as far as the GPU path's collectives can be run there: the calls a group of
one still makes (``all_gather``'s gather and reduce-scatter, Ulysses' all-to-alls, the tiled
layers' reduce-scatters), on the device's streams and with its dtypes. With one rank the ring of
``p2p`` and the tiled layers' gathers make no call; two GPUs are needed for those.
"""

import contextlib
import socket

import torch
import torch.distributed as dist

from memo.model.attention import causal_attention
from memo.model.context_parallel import CP_COMM_TYPES
from memo.model.linear import column_parallel_tiled, row_parallel_tiled


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A default process group of one rank for the duration of the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # normwise, as the numerics step's


def _max_difference(got, expected) -> float:
    """The largest normwise relative difference over pairs of tensors."""
    return max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(got, expected, strict=True))


def context_parallel(device: torch.device, dtype: torch.dtype, backend: str, group) -> dict[str, float]:
    """Per exchange, the largest relative difference of output and gradients between context-parallel
    attention over ``group`` and plain attention, on 2 query heads sharing 1 key head."""
    generator = torch.Generator(device.type).manual_seed(0)
    shapes = [(256, 1, 2, 64), (256, 1, 1, 64), (256, 1, 1, 64), (256, 1, 128)]
    q, k, v, dout = (torch.randn(*shape, device=device, dtype=dtype, generator=generator) for shape in shapes)

    def run(**cp):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = causal_attention(*leaves, backend, scale=0.125, grouped=True, **cp)
        out.backward(dout)
        return [out, *(t.grad for t in leaves)]

    expected = run()
    return {comm: _max_difference(run(cp_group=group, cp_comm_type=comm), expected) for comm in CP_COMM_TYPES}


def tiled_linear(device: torch.device, dtype: torch.dtype, group) -> dict[str, float]:
    """The largest relative difference of output and gradients between the tiled column- and row-parallel
    products over ``group`` (tiles of 64 of 256 tokens) and ``torch.nn.functional.linear``."""
    generator = torch.Generator(device.type).manual_seed(0)
    x, weight, bias = (torch.randn(*shape, device=device, dtype=dtype, generator=generator) / 8
                       for shape in ((256, 1, 128), (96, 128), (96,)))
    found = {}
    for name, product in (("column", lambda x, w, b: column_parallel_tiled(x, w, b, group, 64)),
                          ("row", lambda x, w, b: row_parallel_tiled(x, w, group, 64) + b)):
        results = []
        for fn in (product, torch.nn.functional.linear):
            leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
            results.append([out, *(t.grad for t in leaves)])
        found[name] = _max_difference(*results)
    return found
