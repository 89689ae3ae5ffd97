"""The sequence-tiled column-parallel linear layer of MEMO's layers (memo.model.linear)."""

import pytest
import torch

from conftest import run_under_torchrun
from memo.config import MethodConfig, ModelConfig, ParallelConfig
from memo.model.tiles import eighth_tile_tokens
from memo.profile.iteration import trace_iteration


@pytest.mark.slow
def test_tiled_column_linear_matches_megatron_under_sequence_parallelism():
    result = run_under_torchrun("linear_worker.py")
    assert result.stdout.count("4 tiled linear layers match Megatron's") == 2


def test_the_default_tile_is_an_eighth_of_the_tokens_and_at_least_64():
    assert eighth_tile_tokens(2**17) == 2**14
    assert eighth_tile_tokens(3000) == 256  # 375, rounded down to a power of two
    assert eighth_tile_tokens(100) == 64


def _persistent_bytes(layer_activations: str, seq: int) -> int:
    """Bytes of the requests of one traced iteration (tp = 2 with sequence parallelism, fp32)
    still alive at its end that are not gradients: what persists from one iteration to the next."""
    model = ModelConfig(name="small", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                        num_attention_heads=4, vocab_size=1024)
    # the tiled loss: Megatron's output layer would gather into the buffer too
    method = MethodConfig(name=layer_activations, layer_activations=layer_activations, loss="tiled")
    trace = trace_iteration(model, method, ParallelConfig(tp=2, sequence_parallel=True), seq, 1,
                            torch.float32, "fake")
    gradients = set(trace.meta["gradient_requests"])
    return sum(r.size for r in trace.requests() if r.free_phase is None and r.id not in gradients)


def test_memos_layers_keep_no_all_gather_buffer_between_iterations():
    seq, h, head_dim = 8192, 256, 64
    gathered = seq * h * 4  # Megatron's all-gather buffer: the whole sequence's layer input
    rope = seq * head_dim * 4 * 3  # RoPE's angles and one cos/sin table
    megatron, ours = _persistent_bytes("megatron", seq), _persistent_bytes("keep", seq)
    assert megatron >= gathered
    assert ours <= rope < gathered, (ours, megatron)
