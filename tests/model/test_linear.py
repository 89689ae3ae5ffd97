"""The sequence-tiled column- and row-parallel linear layers of MEMO's layers (memo.model.linear)."""

import pytest

from memo.config import Method, ModelConfig, ParallelConfig, Workload
from memo.model.tiles import eighth_tile_tokens

from conftest import trace_of


@pytest.mark.slow
@pytest.mark.torchrun(2, "linear_worker.check")  # in the session's two-process launch
def test_tiled_linear_layers_match_megatron_under_sequence_parallelism(torchrun_results):
    (result,) = torchrun_results
    assert result.passed() == ("8 tiled linear layers match Megatron's",) * 2


def test_the_default_tile_is_an_eighth_of_the_tokens_and_at_least_64():
    assert eighth_tile_tokens(2**17) == 2**14
    assert eighth_tile_tokens(3000) == 256  # 375, rounded down to a power of two
    assert eighth_tile_tokens(100) == 64


def _traced(layer_activations: str, seq: int):
    """One fake-traced iteration of a small model, tp = 2 with sequence parallelism, fp32."""
    model = ModelConfig(name="small", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                        num_attention_heads=4, vocab_size=1024)
    # the tiled loss: Megatron's output layer would gather into the buffer too
    method = Method(name=layer_activations, layer_activations=layer_activations)
    layout = ParallelConfig(tp=2, sequence_parallel=True)
    return trace_of(Workload(model, method, layout, seq, dtype="fp32", loss="tiled"), "fake")


def _persistent_bytes(layer_activations: str, seq: int) -> int:
    """Bytes of the requests of one traced iteration still alive at its end that are not
    gradients: what persists from one iteration to the next."""
    trace = _traced(layer_activations, seq)
    gradients = set(trace.meta["gradient_requests"])
    return sum(r.size for r in trace.requests() if r.free_phase is None and r.id not in gradients)


def test_memos_layers_keep_no_all_gather_buffer_between_iterations():
    seq, h, head_dim = 8192, 256, 64
    gathered = seq * h * 4  # Megatron's all-gather buffer: the whole sequence's layer input
    rope = seq * head_dim * 4 * 3  # RoPE's angles and one cos/sin table
    megatron, ours = _persistent_bytes("megatron", seq), _persistent_bytes("keep", seq)
    assert megatron >= gathered
    assert ours <= rope < gathered, (ours, megatron)


def test_memos_layers_make_no_whole_sequence_partial_product_or_gathered_gradient():
    seq, h = 8192, 256
    whole = seq * h * 4  # [s, b, h] in fp32: every token, every feature
    counts = {}
    for activations in ("megatron", "keep"):
        trace = _traced(activations, seq)
        counts[activations] = [r.malloc_phase.split(".")[-1] for r in trace.requests()
                               if r.malloc_phase.startswith("layer.") and r.size == whole]
    # Megatron's row-parallel layers (attention's projection, FC2): the partial product before
    # its reduce-scatter in each forward, the gathered output gradient in each backward
    assert counts["megatron"].count("fwd") >= 2 * 2 and counts["megatron"].count("bwd") >= 2 * 2
    assert counts["keep"] == []


def test_a_product_of_some_channels_makes_those_and_has_no_backward(single_process):
    import torch
    import torch.distributed as dist

    from memo.model.linear import GroupChannels, column_parallel_tiled

    # a fused QKV projection of 2 groups, each 4 query rows, a key and a value row of 2: [2·8, 16]
    x = torch.randn(6, 1, 16)
    weight, bias = torch.randn(16, 16, requires_grad=True), torch.randn(16)
    whole = column_parallel_tiled(x, weight, bias, dist.group.WORLD, 4)
    for channels in (GroupChannels(2, 0, 4), GroupChannels(2, 4, 8)):  # the queries; the keys and values
        part = column_parallel_tiled(x, weight, bias, dist.group.WORLD, 4, channels=channels)
        # (the same sums, by GEMMs of other widths: equal up to their order)
        torch.testing.assert_close(channels.of(part), channels.of(whole), rtol=1e-6, atol=1e-6)
        with pytest.raises(RuntimeError, match="has no backward pass"):
            part.sum().backward()
