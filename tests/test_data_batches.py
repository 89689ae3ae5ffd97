"""Training data is deterministic, learnable, and split over data parallel without overlap."""

import pytest
import torch

from memo.config import ConfigError, TrainConfig
from memo.data.batches import ByteTokens, SyntheticTokens, micro_batches, token_source


def test_synthetic_samples_are_deterministic_pairs():
    source = SyntheticTokens(vocab_size=50257, seed=7)
    a = source.sample(3, 101)
    assert a.shape == (101,) and a.dtype == torch.int64
    assert torch.equal(a, SyntheticTokens(50257, 7).sample(3, 101))
    assert not torch.equal(a, source.sample(4, 101))
    assert int(a.max()) < 50257 and int(a.min()) >= 0
    # Every odd position is the fixed successor of the token before it.
    successor = dict(zip(source.alphabet.tolist(), source.successor.tolist()))
    assert all(successor[x] == y for x, y in zip(a[0::2].tolist(), a[1::2].tolist()))
    assert set(a.tolist()) <= set(source.alphabet.tolist())


def test_batches_shift_labels_by_one():
    batch = next(micro_batches(SyntheticTokens(1000, 1), 16, 2, 1, 0, 1, torch.device("cpu")))
    (mb,) = batch
    assert mb["tokens"].shape == mb["labels"].shape == mb["position_ids"].shape == (2, 16)
    assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])
    assert torch.equal(mb["position_ids"][1], torch.arange(16))


def test_data_parallel_ranks_split_the_global_batch():
    source = SyntheticTokens(1000, 1)
    cpu = torch.device("cpu")
    one_rank = micro_batches(source, 8, 1, 4, dp_rank=0, dp_size=1, device=cpu)
    ranks = [micro_batches(source, 8, 2, 1, dp_rank=r, dp_size=2, device=cpu) for r in range(2)]
    for _ in range(3):
        whole = torch.cat([mb["tokens"] for mb in next(one_rank)])
        split = torch.cat([next(r)[0]["tokens"] for r in ranks])
        assert torch.equal(whole, split)


def test_byte_tokens_read_windows_of_the_file(tmp_path):
    text = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.to(torch.uint8).numpy().tobytes())
    source = ByteTokens(str(path), seed=0, length=65)
    window = source.sample(5, 65)
    assert window.dtype == torch.int64
    starts = [i for i in range(4096 - 64) if torch.equal(text[i : i + 65], window)]
    assert len(starts) == 1
    assert torch.equal(window, ByteTokens(str(path), 0, 65).sample(5, 65))
    assert not torch.equal(window, source.sample(6, 65))


def test_text_file_shorter_than_a_sample_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("hello")
    with pytest.raises(ConfigError, match=r"has 5 bytes but a sample needs seq \+ 1 = 9"):
        token_source(TrainConfig(data=str(path)), 50257, 8)
