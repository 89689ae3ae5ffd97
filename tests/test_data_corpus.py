"""``train.data=megatron:<prefix>``: samples packed by megatron-core's GPT dataset from a corpus
prepared here, blends drawn by weight, and bad input in one line."""

import dataclasses

import pytest
import torch
from tiny_corpus import make_corpus

from memo.config import ConfigError, TrainConfig
from memo.data.corpus import MegatronCorpus
from memo.data.tokenizer import LocalTokenizer

# megatron-core's blended dataset asks for the process's rank: a run always has a process group
pytestmark = pytest.mark.usefixtures("parallel_state")


def _train(prefix, tokenizer, tmp_path, **settings) -> TrainConfig:
    return TrainConfig(data=f"megatron:{prefix}", tokenizer=str(tokenizer), data_cache=str(tmp_path / "cache"),
                       **settings)


def _pieces(sample: list[int], eod: int) -> list[list[int]]:
    pieces, piece = [], []
    for token in sample:
        piece.append(token)
        if token == eod:
            pieces.append(piece)
            piece = []
    return pieces + [piece]


def test_samples_are_documents_packed_end_to_end_with_their_end_tokens(tmp_path):
    prefix, tokenizer_file, texts = make_corpus(tmp_path / "data", count=60)
    tokenizer = LocalTokenizer(str(tokenizer_file))
    documents = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    seq = 48
    corpus = MegatronCorpus(_train(prefix, tokenizer_file, tmp_path, data_split="1,0,0"), 64, seq)
    tokens = sum(len(d) for d in documents)
    assert len(corpus.train) == (tokens - 1) // seq  # one pass over the documents, as megatron-core packs them
    for i in range(40):
        sample = corpus.sample(i, seq + 1)
        assert sample.dtype == torch.int64 and sample.shape == (seq + 1,)
        pieces = _pieces(sample.tolist(), tokenizer.eod)
        # whole documents between the first and the last piece, which are a document's end and start
        assert all(p in documents for p in pieces[1:-1])
        assert any(d[len(d) - len(pieces[0]):] == pieces[0] for d in documents)
        assert any(d[: len(pieces[-1])] == pieces[-1] for d in documents)
    again = MegatronCorpus(_train(prefix, tokenizer_file, tmp_path, data_split="1,0,0"), 64, seq)
    assert all(torch.equal(corpus.sample(i, seq + 1), again.sample(i, seq + 1)) for i in range(40))
    # past the pass, the same pass again: sample i is one thing for a run of any length
    assert torch.equal(corpus.sample(3 + len(corpus.train), seq + 1), corpus.sample(3, seq + 1))


def test_a_blend_draws_from_each_prefix_by_its_weight(tmp_path):
    """Two corpora of one tokenizer, one in capitals: a 3:1 blend's samples come three to one from
    them (megatron-core's blended dataset), each sample from one of them."""
    a, tokenizer, _ = make_corpus(tmp_path / "data", count=80, seed=1, name="a")
    b, _, _ = make_corpus(tmp_path / "data", count=80, seed=2, name="b", tokenizer=tokenizer, upper=True)
    train = TrainConfig(data=f"megatron:3 {a} 1 {b}", tokenizer=str(tokenizer), data_split="1,0,0",
                        data_cache=str(tmp_path / "cache"))
    corpus = MegatronCorpus(train, 64, 32)
    vocab = LocalTokenizer(str(tokenizer)).vocab
    upper = {i for w, i in vocab.items() if w.isalpha() and w.isupper()}
    lower = {i for w, i in vocab.items() if w.isalpha() and w.islower()}
    n = len(corpus.train)  # a pass of each corpus at its weight: a's samples, and four thirds of them in all
    assert n > 50
    drawn = [set(corpus.sample(i, 33).tolist()) for i in range(n)]
    from_a, from_b = sum(not s & upper for s in drawn), sum(not s & lower for s in drawn)
    assert from_a + from_b == n
    assert from_a == pytest.approx(0.75 * n, abs=2)  # Megatron's blend keeps the weights' ratio, up to rounding


def test_validation_samples_come_from_documents_the_training_split_never_sees(tmp_path):
    prefix, tokenizer_file, texts = make_corpus(tmp_path / "data", count=100)
    corpus = MegatronCorpus(_train(prefix, tokenizer_file, tmp_path, data_split="8,2,0"), 64, 24,
                            True)
    eod = LocalTokenizer(str(tokenizer_file)).eod
    seen = {tuple(p) for i in range(50) for p in _pieces(corpus.sample(i, 25).tolist(), eod)[1:-1]}
    held_out = {tuple(p) for i in range(10) for p in _pieces(corpus.valid_sample(i, 25).tolist(), eod)[1:-1]}
    assert held_out and not held_out & seen - {(eod,)}


@pytest.mark.parametrize("change, message", [
    (lambda p, t: {"data": f"megatron:{p}x"}, r"corpusx.idx does not exist; give the prefix of a .bin/.idx pair"),
    (lambda p, t: {"data": f"megatron:0.5 {p} {p}"}, r"is not a blend: write megatron:<prefix> or"),
    (lambda p, t: {"data": f"megatron:0.5 {p} -1 {p}"}, r"with positive weights"),
    (lambda p, t: {"data": f"megatron:nan {p} 1 {p}"}, r"with positive weights"),
    (lambda p, t: {"data": "megatron: "}, r"names no prefix: write megatron:<prefix>"),
    (lambda p, t: {"tokenizer": None}, r"train.tokenizer=None is not a file: megatron data needs"),
    (lambda p, t: {"data_split": "1,0"}, r"train.data_split=1,0 must be three non-negative weights"),
    (lambda p, t: {"eod_token": "<eod>"}, r"has no end-of-document token <eod>; set train.eod_token"),
])
def test_bad_settings_are_one_line(tmp_path, change, message):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    train = dataclasses.replace(_train(prefix, tokenizer, tmp_path), **change(prefix, tokenizer))
    with pytest.raises(ConfigError, match=message) as error:
        MegatronCorpus(train, 64, 16)
    assert "\n" not in str(error.value)


def test_a_split_shorter_than_a_sequence_is_one_line(tmp_path):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    with pytest.raises(ConfigError, match=r"the train split has fewer than seq \+ 1 = 4097 tokens; give train a "
                                          "larger share of train.data_split, or a shorter seq"):
        MegatronCorpus(_train(prefix, tokenizer, tmp_path), 64, 4096)


@pytest.mark.parametrize("split, validation, message", [
    ("1,0,0", True, "train.data_split=1,0,0 leaves the valid split of .*corpus "
                                              r"\(20 documents\) without a document; give valid a larger share"),
    ("1,99,0", False, "leaves the train split of .* without a document; give train a larger share"),
])
def test_a_split_without_documents_is_one_line_not_a_hang(tmp_path, split, validation, message):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    with pytest.raises(ConfigError, match=message):
        MegatronCorpus(_train(prefix, tokenizer, tmp_path, data_split=split), 64, 16, validation)


def test_a_vocabulary_larger_than_the_models_is_refused(tmp_path):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    vocab = LocalTokenizer(str(tokenizer)).vocab_size
    with pytest.raises(ConfigError, match=f"has ids up to {vocab - 1} but the model's vocabulary is {vocab - 1}; "
                                          f"set model.vocab_size to at least {vocab}"):
        MegatronCorpus(_train(prefix, tokenizer, tmp_path), vocab - 1, 16)


def _cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


# megatron-core's reader, failing in its constructor, would fail again in its finalizer: it is never reached
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage, message", [
    (lambda p: p.with_suffix(".idx").write_bytes(b"not an index"), r"corpus.idx is not a Megatron index"),
    (lambda p: _cut(p.with_suffix(".idx"), 60), r"corpus.idx is 60 bytes, and its header needs \d+: it is cut short"),
    (lambda p: _cut(p.with_suffix(".bin"), 10), r"corpus.bin is 10 bytes, and .*corpus.idx points to \d+: it is cut"),
])
def test_a_damaged_index_or_data_file_is_named_in_one_line(tmp_path, damage, message):
    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    damage(prefix)
    with pytest.raises(ConfigError, match=message) as error:
        MegatronCorpus(_train(prefix, tokenizer, tmp_path), 64, 16)
    assert "\n" not in str(error.value)
