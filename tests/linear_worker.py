"""Under torchrun (2 processes): the sequence-tiled column- and row-parallel linear layers against
Megatron's, under sequence parallelism, in fp32. :func:`check` is a check of
``tests/checks_worker.py`` (``... tests/checks_worker.py OUT linear_worker.check`` runs it alone);
it raises at the first difference."""

import itertools

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from memo.execute import distributed
from memo.model.gpt import transformer_config
from memo.model.host import run_megatron_on_host
from memo.model.linear import TiledColumnParallelLinear, TiledRowParallelLinear

from conftest import resolve_config

CASES = [(None, True), (24, True), (24, False), (7, True)]  # (tile tokens, bias)


def run(cls, config, bias: bool, x: torch.Tensor, grad: torch.Tensor, **extra):
    """Output, input gradient and weight (and bias) gradients of one forward and backward."""
    torch.manual_seed(1)
    if issubclass(cls, RowParallelLinear):
        layer = cls(96, 64, config=config, init_method=torch.nn.init.normal_, bias=bias,
                    input_is_parallel=True, skip_bias_add=False, **extra)
    else:
        layer = cls(64, 96, config=config, init_method=torch.nn.init.normal_, bias=bias,
                    gather_output=False, **extra)
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def check(info: distributed.ProcessInfo, out=None) -> str:
    """Each tiled layer's output and gradients equal Megatron's; raises at the first difference.
    A check of ``tests/checks_worker.py``."""
    workload = resolve_config("parallel.tp=2", "parallel.sequence_parallel=true").workload
    distributed.initialize(workload.parallel, "cpu", info)
    try:
        _compare(workload, info)
    finally:
        distributed.shutdown()
    return f"{2 * len(CASES)} tiled linear layers match Megatron's"


def _compare(workload, info: distributed.ProcessInfo) -> None:
    run_megatron_on_host()
    config = transformer_config(workload, "cpu")
    rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    x = torch.randn(2 * 100, 3, 64)  # 100 tokens a rank, micro-batch 3
    grad = torch.randn(2 * 100, 3, 96 // 2)
    column = (ColumnParallelLinear, TiledColumnParallelLinear, x[rank * 100:(rank + 1) * 100], grad)
    # a row-parallel layer takes every token of its share of the features, gives its own tokens
    row_x = torch.randn(2, 2 * 100, 3, 96 // 2)[rank]
    row_grad = torch.randn(2 * 100, 3, 64)[rank * 100:(rank + 1) * 100]
    row = (RowParallelLinear, TiledRowParallelLinear, row_x, row_grad)
    for (megatron, tiled, inputs, out_grad), (tile, bias) in itertools.product((column, row), CASES):
        expected = run(megatron, config, bias, inputs, out_grad)
        got = run(tiled, config, bias, inputs, out_grad, matmul_tile_tokens=tile)
        for what, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, expected):
            # the weight gradient sums 600 products of N(0, 1) values per entry, over tiles in
            # another order than one GEMM: fp32 rounding of about 1e-5 of the sum
            loose = {"rtol": 1e-4, "atol": 1e-4} if what == "weight grad" else {}
            torch.testing.assert_close(
                a, b, **loose, msg=lambda m, w=what: f"rank {info.rank}: {tiled.__name__} tile={tile} bias={bias} "
                                                     f"{w}: {m}")

