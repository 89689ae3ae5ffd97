"""Causal attention of query tiles over a key/value store, merged by log-sum-exp, against PyTorch's
whole-sequence attention in float64 (forward and every gradient), and within documents against
each document's own."""

import pytest
import torch

from memo.model.documents import Documents
from memo.model.tiled_attention import tile_backward, tile_forward
from memo.model.tiles import rank_tile_blocks
from varlen_flash import use_varlen_flash

SEQ, BATCH, HEADS, DIM = 48, 2, 4, 8


def _documents_alone(q, k, v, documents, scale, groups):
    """Each document's own causal attention (``[s, b, heads, dim]`` in and out), one by one."""
    parts = []
    for start, end in documents.spans():
        heads_first = [t[start:end].permute(1, 2, 0, 3) for t in (q, k, v)]
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            *heads_first, is_causal=True, scale=scale, enable_gqa=groups != HEADS).permute(2, 0, 1, 3))
    return torch.cat(parts)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("groups", [HEADS, 2])  # multi-head and grouped keys and values
@pytest.mark.parametrize("tiles", [1, 2, 3, 8])
@pytest.mark.parametrize("starts", [None, (0, 5, 6, 29)], ids=["causal", "documents"])
def test_tiles_over_the_store_equal_whole_attention(tiles, groups, kernel, starts):
    # documents that start inside tiles, one of a single token, one across three tiles of 6
    _check_tiles(tiles, groups, kernel, None if starts is None else Documents(starts, SEQ), BATCH)


@pytest.mark.parametrize("tiles", [1, 3, 8])
def test_a_tiles_own_documents_take_one_variable_length_call_on_cuda(monkeypatch, tiles):
    """On CUDA a tile's block of its own keys runs its documents in one call of FlashAttention's
    variable-length entry points (here a float64 stand-in of them): the same attention, forward
    and backward, as blocks per document."""
    fake = use_varlen_flash(monkeypatch)
    _check_tiles(tiles, 2, "flash", Documents((0, 5, 6, 29), SEQ), 1)
    assert fake.calls == 2 * tiles  # each tile's forward and backward


def _check_tiles(tiles: int, groups: int, kernel: str, documents, batch: int) -> None:
    """Every tile's attention over the store, forward then backward in descending order, equals
    each document's own causal attention in float64 (1e-12)."""
    gen = torch.Generator().manual_seed(tiles * 10 + groups)
    q = torch.randn(SEQ, batch, HEADS, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(SEQ, batch, groups, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(SEQ, batch, HEADS, DIM, dtype=torch.float64, generator=gen)
    scale = DIM ** -0.5
    reference = _documents_alone(q, k, v, documents or Documents((0,), SEQ), scale, groups)
    reference.backward(dout)

    c = SEQ // tiles
    keys, values = k.detach(), v.detach()  # the store: every tile's keys and values
    out, lse = torch.empty_like(q), []
    for t in range(tiles):
        rows = slice(t * c, (t + 1) * c)
        o, l = tile_forward(kernel, q.detach()[rows].permute(1, 2, 0, 3), keys, values, t, scale,
                            documents=documents)
        out[rows] = o.permute(2, 0, 1, 3)
        lse.append(l)
        assert o.permute(2, 0, 1, 3).is_contiguous()  # token-major, as Megatron's attention output
    torch.testing.assert_close(out, reference.detach(), rtol=0, atol=1e-12)

    dq = torch.empty_like(q)
    key_grads, value_grads = torch.zeros_like(keys), torch.zeros_like(values)
    for t in reversed(range(tiles)):
        rows = slice(t * c, (t + 1) * c)
        tile_q, tile_out, tile_dout = (x[rows].permute(1, 2, 0, 3) for x in (q.detach(), out, dout))
        dq[rows] = tile_backward(kernel, tile_dout, tile_q, keys, values, tile_out, lse[t], t, scale,
                                 key_grads, value_grads, documents=documents).permute(2, 0, 1, 3)
        # only tiles ≥ t see block t: its gradients are complete once tile t is done
        torch.testing.assert_close(key_grads[rows], k.grad[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(value_grads[rows], v.grad[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dq, q.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_tiles_cover_the_sequence_once_in_megatrons_chunks(cp):
    """Under context parallelism a rank's tiles are the first half of its tiles in chunk r and the
    rest in chunk 2·cp − 1 − r (the walk and the fit place them by this one rule)."""
    tiles = 4  # per rank: two per chunk
    placed = {r: rank_tile_blocks(tiles, cp, r) for r in range(cp)}
    assert sorted(j for blocks in placed.values() for j in blocks) == list(range(tiles * cp))
    if cp > 1:
        assert placed[0] == [0, 1, 4 * cp - 2, 4 * cp - 1]
        assert placed[cp - 1] == [2 * cp - 2, 2 * cp - 1, 2 * cp, 2 * cp + 1]
