"""The block kernels of context-parallel attention: which one a run uses (the decision table), and
every call of PyTorch's private attention entry points as PyTorch 2.11 (the GPU machine's build)
takes it, checked on the meta device (the CUDA branch, run by the ops' meta kernels) against the
2.11 schemas in ``tests/data/torch-2.11-aten-schemas.txt``."""

import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memo.model import attention_blocks as blocks
from varlen_flash import use_varlen_flash

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "data" / "torch-2.11-aten-schemas.txt"
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
H100, A100, V100, BLACKWELL = (9, 0), (8, 0), (7, 0), (10, 0)


def schemas_2_11() -> dict[str, torch._C.FunctionSchema]:
    """Operator name (``name`` or ``name.overload``) -> its 2.11 schema."""
    found = {}
    for line in SCHEMAS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            schema = torch._C.parse_schema(f"aten::{line}")
            overload = f".{schema.overload_name}" if schema.overload_name else ""
            key = schema.name.removeprefix("aten::") + overload
            found[key] = schema
    return found


@pytest.mark.parametrize("whole, device, capability, dtype, head_dim, expected", [
    # Hopper in bf16 with Llama's and GPT's heads: cuDNN where the run's attention chose it
    ("cudnn", "cuda", H100, BF16, 128, "cudnn"),
    ("cudnn", "cuda", H100, FP16, 64, "cudnn"),
    ("flash", "cuda", H100, BF16, 128, "flash"),  # a run that chose flash keeps it
    ("efficient", "cuda", H100, BF16, 128, "efficient"),
    ("cudnn", "cuda", BLACKWELL, BF16, 128, "cudnn"),
    ("cudnn", "cuda", A100, BF16, 128, "cudnn"),
    # heads cuDNN's blocks do not take: flash to 256, then the memory-efficient kernel
    ("cudnn", "cuda", H100, BF16, 256, "flash"),
    ("cudnn", "cuda", H100, BF16, 264, "efficient"),
    ("cudnn", "cuda", H100, BF16, 12, "math"),  # no fused kernel takes heads not a multiple of 8
    # fp32 on a GPU: only the memory-efficient kernel
    ("efficient", "cuda", H100, FP32, 128, "efficient"),
    ("cudnn", "cuda", H100, FP32, 128, "efficient"),
    ("cudnn", "cuda", H100, FP64, 128, "math"),
    # before Ampere: no cuDNN or flash blocks; bf16 needs sm80 for the memory-efficient kernel
    ("efficient", "cuda", V100, FP16, 128, "efficient"),
    ("efficient", "cuda", V100, BF16, 128, "math"),
    # the CPU: ATen's fused CPU kernel, in any floating dtype
    ("flash", "cpu", None, FP32, 64, "flash"),
    ("flash", "cpu", None, FP64, 16, "flash"),
    ("flash", "cpu", None, BF16, 128, "flash"),
    ("math", "cpu", None, FP32, 64, "math"),
    ("math", "cuda", H100, BF16, 128, "math"),  # a run that asked for math
])
def test_the_block_kernel_follows_the_runs_attention_where_it_takes_the_block(
        whole, device, capability, dtype, head_dim, expected):
    assert blocks.choose(whole, device, capability, dtype, head_dim) == expected


@pytest.mark.parametrize("kernel", blocks.BLOCK_KERNELS)
def test_a_causal_block_that_is_not_square_is_refused_and_a_full_one_is_not(kernel):
    q = torch.empty(1, 2, 8, 64, device="meta", dtype=BF16 if kernel != "math" else FP32)
    k = torch.empty(1, 2, 16, 64, device="meta", dtype=q.dtype)
    with pytest.raises(ValueError, match="a causal block must be square, not 8 queries by 16 keys"):
        blocks.forward(kernel, q, k, k, True, 0.125)
    out, lse = blocks.forward(kernel, q, k, k, False, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


class _Calls(TorchDispatchMode):
    """Every ATen call, with its arguments as the dispatcher bound them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _bound(func, args, kwargs) -> dict:
    """Every argument of a recorded call by name, defaults included (the dispatcher leaves out
    trailing arguments equal to their defaults)."""
    schema = func._schema.arguments
    given = dict(zip((a.name for a in schema), args)) | kwargs
    return {a.name: given[a.name] if a.name in given else a.default_value for a in schema}


def _token_major_block(b, heads, tokens, dim, dtype):
    """``[b, heads, tokens, dim]`` cut from Megatron's ``[s, b, heads, dim]``, as attention gets it."""
    whole = torch.empty(2 * tokens, b, heads, dim, device="meta", dtype=dtype)
    return whole.permute(1, 2, 0, 3)[:, :, :tokens]


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_blocks_call_the_entry_points_as_torch_2_11_declares_them(kernel, causal):
    """On the meta device the blocks take their CUDA branch; each call binds to the 2.11 schema
    and hands over what the CUDA kernels read (undefined sequence offsets and random state, the
    log-sum-exp's shape and layout, a token-major output) with results of the right shapes."""
    dtype = FP32 if kernel == "efficient" else BF16
    b, heads, tokens, dim = 2, 4, 100, 64  # 100 tokens: the efficient kernel pads to 128
    q, k, v = (_token_major_block(b, heads, tokens, dim, dtype) for _ in range(3))
    with _Calls() as recorded:
        out, lse = blocks.forward(kernel, q, k, v, causal, 0.125)
        # a merged output, not token-major, and the log-sum-exp of one query chunk of two, as
        # context parallelism hands them over: the backward must give the kernels their layouts
        merged = out.contiguous()
        chunk_lse = torch.cat([lse, lse], dim=2).narrow(2, tokens, tokens)
        dq, dk, dv = blocks.backward(kernel, merged, q, k, v, merged, chunk_lse, causal, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, heads, tokens) and lse.dtype == FP32
    assert [t.shape for t in (dq, dk, dv)] == [q.shape] * 3

    reference = schemas_2_11()
    private = [(f, a, kw) for f, a, kw in recorded.calls if f._schema.name.startswith("aten::_scaled_dot")]
    assert [f.__name__ for f, _, _ in private] == [
        f"_scaled_dot_product_{kernel}_attention.default",
        f"_scaled_dot_product_{kernel}_attention_backward.default"]
    for func, args, kwargs in private:
        name = func._schema.name.removeprefix("aten::")
        assert str(func._schema) == str(reference[name]), f"{name} differs from its 2.11 schema"
    (_, forward_args, forward_kwargs), (_, args, kwargs) = private
    called = _bound(private[1][0], args, kwargs)
    assert _bound(private[0][0], forward_args, forward_kwargs)["dropout_p"] == 0.0
    assert called["dropout_p"] == 0.0 and called["is_causal"] is causal and called["scale"] == 0.125
    if kernel in ("cudnn", "flash"):
        # a defined tensor (even an empty one) selects the variable-length (nested) path
        assert called["cum_seq_q"] is None and called["cum_seq_k"] is None
        assert (called["max_q"], called["max_k"]) == (tokens, tokens)
    # not read without dropout; cuDNN's backward checks the device of any defined one
    assert called["philox_seed"] is None and called["philox_offset"] is None
    lse_in = called["logsumexp"]
    assert lse_in.dtype == FP32 and lse_in.is_contiguous()
    assert lse_in.shape == {"cudnn": (b, heads, tokens, 1), "flash": (b, heads, tokens),
                            "efficient": (b, heads, 128)}[kernel]
    if kernel in ("cudnn", "efficient"):
        # the efficient kernel reads the output with a token-major row stride whatever its
        # strides; cuDNN caches its backward graph by q, k and v's layouts only
        assert called["out"].transpose(1, 2).is_contiguous()
    if kernel == "cudnn":
        assert called["grad_out"].transpose(1, 2).is_contiguous()
        assert called["attn_bias"] is None


def test_every_aten_operator_the_project_calls_has_its_2_11_schema_in_the_fixture():
    """A new call of an ATen operator needs its 2.11 schema here, so it is checked against the
    lent GPU machine's build before it reaches one."""
    pattern = re.compile(r"(?:torch\.ops\.aten|_aten)\.(\w+)(?:\.(out|default|\w+)\b)?\(")
    called = set()
    for path in (REPO / "memo").rglob("*.py"):
        for name, overload in pattern.findall(path.read_text()):
            called.add(name if overload in ("", "default") else f"{name}.{overload}")
    reference = schemas_2_11()
    assert called and called <= set(reference), f"no 2.11 schema for {sorted(called - set(reference))}"
    for key, schema in reference.items():
        name, _, overload = key.partition(".")
        ours = getattr(torch.ops.aten, name)
        ours = getattr(ours, overload or "default")._schema
        # this PyTorch may add keyword arguments with defaults (2.13's _flash_attention_forward:
        # block_table, num_splits), which calls made as 2.11 takes them leave out
        (our_arguments, our_returns), (arguments, returns) = (str(x).split(") -> ") for x in (ours, schema))
        same = our_returns == returns and our_arguments.startswith(arguments) and all(
            a.kwarg_only and a.has_default_value() for a in ours.arguments[len(schema.arguments):])
        assert same, f"this PyTorch's {key} differs from 2.11's: check the calls"


def test_a_row_names_the_kernel_of_whole_attention_and_of_its_blocks(tmp_path):
    from conftest import run_in_process

    row = run_in_process(tmp_path, "seq=128", "model.vocab_size=1000", "train.steps=2", "train.warmup_steps=1")
    assert row["status"] == "ok", row["error"]
    # one rank holds the whole sequence: no blocks run (tests/execute/test_training.py: with cp = 2)
    assert (row["attention_backend"], row["attention_block_kernel"]) == ("flash", "none")


def test_cudnn_hands_a_block_of_one_key_to_flash():
    q = torch.empty(1, 2, 4, 64, device="meta", dtype=BF16)
    k = torch.empty(1, 2, 1, 64, device="meta", dtype=BF16)
    with _Calls() as recorded:
        out, lse = blocks.forward("cudnn", q, k, k, False, 0.125)
        blocks.backward("cudnn", out, q, k, k, out, lse, False, 0.125)
    private = [f.__name__ for f, _, _ in recorded.calls if f.__name__.startswith("_scaled_dot")]
    assert private == ["_scaled_dot_product_flash_attention.default",
                       "_scaled_dot_product_flash_attention_backward.default"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merging_in_place_gives_the_bits_of_merging_anew(dtype):
    """A tile merges its blocks into one output in place: the same bits as a new output per merge."""
    generator = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 4, 16, 8, generator=generator).to(dtype) for _ in range(3)]
    lses = [torch.randn(2, 4, 16, generator=generator) for _ in range(3)]
    out, lse = outs[0], lses[0]
    acc_out = outs[0].to(blocks.wide(dtype))
    acc_lse = lses[0].clone()
    for block_out, block_lse in zip(outs[1:], lses[1:]):
        out, lse = blocks.merge(out, lse, block_out, block_lse)
        blocks.merge_into(acc_out, acc_lse, block_out, block_lse)
    assert torch.equal(acc_out, out) and torch.equal(acc_lse, lse)


BOUNDS = (0, 30, 31, 37, 100)  # documents of 30, 1, 6 and 63 tokens


def test_documents_run_in_one_call_of_flashattentions_variable_length_entry_points():
    """On the meta device FlashAttention's segments take the CUDA branch: one forward and one
    backward call, bound to the 2.11 schemas, with int32 cumulative lengths, the longest
    document's length, grouped key and value heads as they are, and results of the right shapes
    (the log-sum-exp unpadded, ``[heads, tokens]``, as 2.11's varlen kernels give it)."""
    heads, kv_heads, tokens, dim = 4, 2, 100, 64
    q = _token_major_block(1, heads, tokens, dim, BF16)
    k, v = (_token_major_block(1, kv_heads, tokens, dim, BF16) for _ in range(2))
    with _Calls() as recorded:
        out, lse = blocks.segments_forward("flash", q, k, v, BOUNDS, 0.125)
        dq, dk, dv = blocks.segments_backward("flash", out.contiguous(), q, k, v, out, lse, BOUNDS, 0.125)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous() and lse.shape == (1, heads, tokens)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    private = [(f, a, kw) for f, a, kw in recorded.calls if f._schema.name.startswith("aten::_flash")]
    assert [f.__name__ for f, _, _ in private] == ["_flash_attention_forward.default",
                                                   "_flash_attention_backward.default"]
    reference = schemas_2_11()
    for func, args, kwargs in private:
        name = func._schema.name.removeprefix("aten::")
        called = {a: value for a, value in _bound(func, args, kwargs).items()
                  if a in {arg.name for arg in reference[name].arguments}}
        assert set(called) == {arg.name for arg in reference[name].arguments}  # (nothing 2.11 lacks)
        assert [called[n].shape for n in ("query", "key", "value")] == [(tokens, heads, dim), (tokens, kv_heads, dim),
                                                                        (tokens, kv_heads, dim)]
        assert all(called[n].stride(-1) == 1 for n in ("query", "key", "value"))
        assert called["cum_seq_q"].dtype == torch.int32 and called["cum_seq_q"].shape == (len(BOUNDS),)
        assert (called["max_q"], called["max_k"]) == (63, 63)
        assert called["dropout_p"] == 0.0 and called["is_causal"] is True and called["scale"] == 0.125
    backward = _bound(*private[1])
    assert backward["logsumexp"].shape == (heads, tokens) and backward["logsumexp"].is_contiguous()
    assert backward["grad_out"].stride(-1) == 1 and backward["out"].stride(-1) == 1


def test_documents_on_the_variable_length_entry_points_equal_a_block_per_document(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(100, 1, 4, 16, generator=generator, dtype=FP64).permute(1, 2, 0, 3)
    k, v = (torch.randn(100, 1, 2, 16, generator=generator, dtype=FP64).permute(1, 2, 0, 3) for _ in range(2))
    dout = torch.randn(q.shape, generator=generator, dtype=FP64)
    expected = [*blocks.segments_forward("math", q, k, v, BOUNDS, 0.25)]
    expected += blocks.segments_backward("math", dout, q, k, v, *expected, BOUNDS, 0.25)
    use_varlen_flash(monkeypatch)
    got = [*blocks.segments_forward("flash", q, k, v, BOUNDS, 0.25)]
    got += blocks.segments_backward("flash", dout, q, k, v, *got, BOUNDS, 0.25)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
