"""Context parallelism in our own attention: Megatron's load-balanced layout, and attention over
the whole sequence (keys and values gathered, passed around a ring, or Ulysses' all-to-all) equal
to textbook causal attention, forward and backward, in 2 and 4 processes, and the backward pass's
buffers as the fit counts them."""

import pytest
import torch

from megatron.core.utils import get_batch_on_this_cp_rank

from memo.model.context_parallel import (
    _sequence_order,
    batch_for_rank,
    part_for_rank,
    rank_chunks,
    split_for_rank,
)


def test_each_rank_holds_one_chunk_from_each_end_as_megatron_lays_it_out():
    tokens = torch.arange(8)
    assert [split_for_rank(tokens, 0, r, 2).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [rank_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # gathered as [rank 0's two, rank 1's two, ...]: chunks 0, 7, 1, 6, 2, 5, 3, 4
    assert _sequence_order(4) == [0, 2, 4, 6, 7, 5, 3, 1]


def test_a_rank_gets_its_tokens_of_a_batch_as_megatron_gives_them_or_one_contiguous_part(monkeypatch):
    batch = {"tokens": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1,
             "position_ids": torch.arange(8).repeat(2, 1)}
    for rank in range(2):
        monkeypatch.setattr("megatron.core.parallel_state.get_context_parallel_world_size", lambda: 2)
        monkeypatch.setattr("megatron.core.parallel_state.get_context_parallel_rank", lambda r=rank: r)
        megatron = get_batch_on_this_cp_rank(dict(batch))
        ours = batch_for_rank(batch, rank, 2)
        assert ours.keys() == megatron.keys()
        for key in ours:
            assert torch.equal(ours[key], megatron[key]), key
    # DeepSpeed-Ulysses: rank r holds tokens [r·s/cp, (r + 1)·s/cp)
    halves = [batch_for_rank(batch, r, 2, "contiguous")["position_ids"][0].tolist() for r in range(2)]
    assert halves == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="a sequence of 6 tokens cannot be cut into cp = 4 parts"):
        part_for_rank(torch.arange(6), 0, 0, 4, "contiguous")


def test_a_length_that_does_not_cut_into_two_chunks_a_rank_is_refused():
    with pytest.raises(ValueError, match="a sequence of 6 tokens cannot be cut into 2·cp = 4 chunks"):
        split_for_rank(torch.arange(6), 0, 0, 2)


@pytest.mark.parametrize("processes", [pytest.param(n, marks=pytest.mark.torchrun(n, "context_parallel_worker.check"))
                                       for n in (2, 4)])
def test_attention_over_context_parallel_ranks_equals_textbook_attention(processes, torchrun_results):
    (result,) = torchrun_results  # in the session's launch of that many processes
    expected = "24 cases match textbook attention; the exchange buffers are the fit's"
    assert result.passed() == (expected,) * processes
