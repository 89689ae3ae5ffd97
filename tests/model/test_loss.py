"""The sequence-tiled output layer and cross entropy (train.loss=tiled) against Megatron's."""

import pytest
import torch

from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, validate, Workload
from memo.model.loss import tiled_cross_entropy
from memo.model.tiles import auto_tile_tokens

from conftest import compose_config, resolve_config, run_in_process, trace_of
from loss_worker import gradients


def test_tiles_give_textbook_cross_entropy_and_its_gradients():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 2, 16, generator=generator, requires_grad=True)
    weight = torch.randn(101, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 101, (37, 2), generator=generator)
    scale = torch.rand(37, 2, generator=generator)
    logits = hidden @ weight.t()
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    (expected * scale.flatten()).sum().backward()
    want = hidden.grad.clone(), weight.grad.clone()
    for tile in (1, 5, 37, 64):
        hidden.grad = weight.grad = None
        loss = tiled_cross_entropy(hidden, weight, labels, tile)
        torch.testing.assert_close(loss, expected.view(37, 2))
        (loss * scale).sum().backward()
        torch.testing.assert_close(hidden.grad, want[0], msg=f"tile {tile}")
        torch.testing.assert_close(weight.grad, want[1], msg=f"tile {tile}")
    with pytest.raises(ValueError, match="tile_tokens=0"):
        tiled_cross_entropy(hidden, weight, labels, 0)


def test_the_default_tile_holds_at_most_one_fc1_output_and_256_mib_of_fp32_logits():
    # tiny model, 8k tokens, fp32: FC1 is 8192 · 1024 · 4 B = 32 MiB, 32 MiB / (4 B · 50304) = 166
    assert auto_tile_tokens(8192, 1, 1, 50304, 1024, 4) == 128
    # 7B at 1M tokens, tp = 8 with sequence parallelism, bf16: 256 MiB / (4 B · 6288 · 8) = 1334
    # tokens of each rank (a gathered tile of 8 · 1024 tokens); FC1 (4 GiB) is no bound
    assert auto_tile_tokens(2**17, 8, 1, 6288, 16384 // 8, 2) == 1024
    assert auto_tile_tokens(2**17, 8, 2, 6288, 16384 // 8, 2) == 512  # two sequences a micro-batch
    assert auto_tile_tokens(2**17, 1, 1, 6288, 16384 // 8, 2) == 8192  # no sequence parallelism
    # short sequences: never thinner than 64 tokens
    assert auto_tile_tokens(256, 1, 1, 50304, 1024, 4) == 64
    assert auto_tile_tokens(100, 1, 1, 2**30, 1024, 4) == 64


@pytest.mark.parametrize("tile", [None, 1000, 48, 256])
def test_the_gpt_with_tiled_loss_has_megatrons_losses_and_gradients(single_process, tile):
    vocab = ["model.vocab_size=1000"]  # padded to 1024: the tiles are of tokens, not of the vocabulary
    expected_loss, expected = gradients(vocab, "megatron", None)
    loss, got = gradients(vocab, "tiled", tile)
    assert loss.shape == (2, 256) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


@pytest.mark.slow
# In the session's two-process torchrun launch (tests/checks_worker.py). A vocabulary of 1000 tokens
# (padded to 1024: 512 a rank) splits the logits over the ranks as GPT-2's does, at a fiftieth of
# the arithmetic; the tiles are of tokens.
@pytest.mark.torchrun(2, "loss_worker.check 1000")
def test_tiled_loss_matches_megatron_with_tensor_and_sequence_parallelism(torchrun_results):
    (result,) = torchrun_results
    assert result.passed() == ("6 tiled losses match Megatron's",) * 2


def _phase_peak(trace, phases: tuple[str, ...]) -> int:
    """Bytes that ``phases`` add, at their peak, to what was live as the first of them began."""
    live, base, peak = 0, None, 0
    for event in trace.events:
        if event.phase in phases and base is None:
            base = live
        live += event.size if event.op == "malloc" else -event.size
        if event.phase in phases:
            peak = max(peak, live)
    return peak - base


def _loss_peak(loss: str) -> int:
    """Bytes the output layer and loss add, at their peak, to what the layers left live (fp32)."""
    model = ModelConfig(name="v50304", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                        num_attention_heads=4, vocab_size=50304)
    trace = trace_of(Workload(model, Method(name="none"), ParallelConfig(), 16384, dtype="fp32", loss=loss), "fake")
    return _phase_peak(trace, ("head.fwd", "loss.fwd", "loss.bwd", "head.bwd"))


def test_tiled_loss_peak_is_at_most_an_eighth_of_megatrons_at_16k_tokens():
    megatron, tiled = _loss_peak("megatron"), _loss_peak("tiled")
    logits = 16384 * 50304 * 4  # Megatron's fp32 logits of the sequence
    assert megatron > logits
    assert tiled * 8 <= megatron, (tiled, megatron)


def _embedding_peak(loss: str, parallel: ParallelConfig, seq: int, *phases: str) -> int:
    """Bytes the embedding's ``phases`` (its forward, ``embedding.fwd`` and the lookup's
    ``embedding.fwd.lookup``, or its backward) add, at their peak, to what was live as the first
    began (fp32, a vocabulary small enough that the [s, h] lookup or gradient is the largest thing
    there)."""
    model = ModelConfig(name="v1024", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                        num_attention_heads=4, vocab_size=1024)
    workload = Workload(model, Method(name="none"), parallel, seq, dtype="fp32", loss=loss)
    trace = trace_of(workload, "fake")
    return _phase_peak(trace, phases)


def test_the_tiled_embedding_forward_holds_no_lookup_of_the_whole_sequence():
    parallel, seq, h = ParallelConfig(tp=2, sequence_parallel=True), 16384, 256
    sequence = seq * h * 4  # [s, b, h] fp32: every token's lookup, as Megatron makes it before its reduce-scatter
    megatron = _embedding_peak("megatron", parallel, seq, "embedding.fwd.lookup", "embedding.fwd")
    tiled = _embedding_peak("tiled", parallel, seq, "embedding.fwd.lookup", "embedding.fwd")
    assert megatron >= sequence + sequence // parallel.tp, megatron  # the lookup, then the shard beside it
    # the rank's shard and each token's local id (8 bytes) throughout; at the peak either one tile
    # of every shard's lookup (an eighth of the tokens) and which tokens are another rank's (1 byte
    # a token), or the rotary angles the phase makes next (float32 [s, 64] three times over)
    tile, angles = sequence // 8 + seq, 3 * seq * 64 * 4
    assert tiled <= sequence // parallel.tp + 8 * seq + max(tile, angles), (tiled, megatron)


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(tp=2, sequence_parallel=True)],
                         ids=["tp1", "tp2-sp"])
def test_the_tiled_embedding_backward_holds_no_gradient_of_the_whole_sequence(parallel):
    seq, h = 16384, 256
    sequence = seq * h * 4  # [s, b, h] fp32: every token's gradient, as Megatron gathers it
    weight = 1024 // parallel.tp * h * 4  # one [v/tp, h] fp32 weight gradient
    megatron = _embedding_peak("megatron", parallel, seq, "embedding.bwd")
    tiled = _embedding_peak("tiled", parallel, seq, "embedding.bwd")
    if parallel.tp > 1:  # the gathered gradient and its masked copy at once, less the shard freed
        assert megatron >= sequence + sequence // parallel.tp, megatron
    # a tile's gradient (an eighth of the tokens) and its masked copy, next to the accumulator
    # and the tied weight's summed gradient
    assert tiled <= 2 * weight + 2 * (sequence // 8), (tiled, megatron)


def test_tiled_trace_has_the_phases_of_megatrons():
    model = ModelConfig(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=2)
    phases = {
        loss: trace_of(Workload(model, Method(name="none"), ParallelConfig(), 256, dtype="fp32", loss=loss),
                       "fake").phases
        for loss in ("megatron", "tiled")
    }
    # the tiled loss normalizes and multiplies inside its own tiles: the head asks for nothing
    assert phases["tiled"] == [p for p in phases["megatron"] if not p.startswith("head.")]
    assert phases["megatron"][4:8] == ["head.fwd", "loss.fwd", "loss.bwd", "head.bwd"]
    assert phases["tiled"][4:6] == ["loss.fwd", "loss.bwd"]


@pytest.mark.parametrize(
    "overrides, loss",
    [
        (["method=memo"], "tiled"),
        (["method=full_swap"], "tiled"),
        (["method=full_recompute"], "tiled"),
        (["method=none"], "megatron"),
        (["method=megatron_full_recompute"], "megatron"),
        (["method=megatron_selective"], "megatron"),
        (["method=megatron_full_recompute", "train.loss=tiled"], "tiled"),
        (["method=memo", "train.loss=megatron"], "megatron"),
    ],
)
def test_each_method_has_its_default_loss_and_train_loss_overrides_it(overrides, loss):
    assert resolve_config(*overrides).workload.loss == loss


@pytest.mark.parametrize(
    "override, fragment",
    [("train.loss=fused", "train.loss=fused is not allowed"),
     ("train.loss_tile_tokens=0", "train.loss_tile_tokens=0 must be at least 1"),
     ("method.loss=auto", "method.loss=auto is not allowed")],
)
def test_bad_loss_settings_are_one_line_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(compose_config(override))


def test_a_training_row_records_the_loss_used(tmp_path):
    row = run_in_process(tmp_path, "method=full_recompute", "seq=256", "train.steps=2",
                         "train.warmup_steps=1", "train.loss_tile_tokens=100", "model.vocab_size=1000")
    assert row["status"] == "ok", row["error"]
    assert row["train.loss"] == "tiled" and row["train.loss_tile_tokens"] == 100
