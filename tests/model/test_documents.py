"""Documents kept apart: boundaries from end-of-document tokens, blocks that cover exactly the
pairs of a document's causal attention, and attention over them equal to each document's own."""

import itertools

import pytest
import torch

from memo.model.documents import Block, Documents, document_attention

EOD = 0


def test_documents_end_with_their_end_of_document_token():
    tokens = [5, 6, EOD, 7, EOD, 8, 9, 9, EOD]  # a last EOD ends the last document, starts none
    documents = Documents.of(torch.tensor(tokens), EOD)
    assert documents == Documents((0, 3, 5), 9)
    assert documents.spans() == [(0, 3), (3, 5), (5, 9)]
    assert documents.position_ids().tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert documents.bounds() == (0, 3, 5, 9)
    assert documents.squared_lengths() == 9 + 4 + 16
    assert Documents.of([4, 4, 4], EOD) == Documents((0,), 3)


@pytest.mark.parametrize("starts", [(), (1, 3), (0, 3, 3), (0, 9)])
def test_documents_that_do_not_rise_within_the_sequence_are_refused(starts):
    with pytest.raises(ValueError, match="must rise from 0 within 9 tokens"):
        Documents(starts, 9)


def _pairs(block: Block) -> set[tuple[int, int]]:
    return {(i, j) for i in range(block.q_start, block.q_end) for j in range(block.k_start, block.k_end)
            if not block.causal or j <= i}


@pytest.mark.parametrize("starts", [(0,), (0, 1), (0, 5, 6, 13), (0, 3, 8, 9, 15)])
@pytest.mark.parametrize("tile", [16, 8, 5, 1])
def test_blocks_of_query_tiles_over_key_tiles_cover_each_documents_causal_pairs_once(starts, tile):
    documents = Documents(starts, 16)
    doc = documents.position_ids()  # (a token's document: its index minus its position)
    owner = torch.arange(16) - doc
    wanted = {(i, j) for i in range(16) for j in range(i + 1) if owner[i] == owner[j]}
    covered = []
    edges = list(range(0, 16, tile)) + [16]
    for (q0, q1), (k0, k1) in itertools.product(zip(edges, edges[1:]), repeat=2):
        for block in documents.blocks((q0, q1), (k0, k1)):
            assert q0 <= block.q_start < block.q_end <= q1 and k0 <= block.k_start < block.k_end <= k1
            assert not block.causal or (block.q_start, block.q_end) == (block.k_start, block.k_end)
            assert block.causal or block.k_end <= block.q_start
            covered.extend(_pairs(block))
    assert sorted(covered) == sorted(wanted)  # each pair once, none across a boundary


def test_spans_that_overlap_unaligned_are_refused():
    with pytest.raises(ValueError, match=r"queries \[4, 8\) and keys \[2, 6\) overlap but are not the same tokens"):
        Documents((0,), 8).blocks((4, 8), (2, 6))


def _one_by_one(q, k, v, documents, groups):
    outs = []
    for start, end in documents.spans():
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True, enable_gqa=groups > 1))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("kernel, dtype, tolerance", [("math", torch.float64, 1e-12), ("flash", torch.float64, 1e-12),
                                                      ("flash", torch.float32, 2e-6)])
@pytest.mark.parametrize("groups", [1, 2])
def test_attention_within_documents_equals_each_document_run_alone(kernel, dtype, tolerance, groups):
    torch.manual_seed(0)
    documents = Documents((0, 7, 8, 20), 32)
    q = torch.randn(2, 4, 32, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 4 // groups, 32, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 4, 32, 8, dtype=dtype)
    got = document_attention(q, k, v, documents, kernel, 8 ** -0.5)
    assert got.permute(2, 0, 1, 3).is_contiguous()  # token-major, as Megatron's layer reads it
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = _one_by_one(q, k, v, documents, groups)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=tolerance, rtol=0)
    # and not what attention across the documents gives
    across = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    assert (got - across)[:, :, 7:].abs().max() > 1e-2


def test_a_document_attention_of_another_length_is_refused():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="documents of 9 tokens for a sequence of 8"):
        document_attention(q, q, q, Documents((0,), 9), "math", 0.5)
