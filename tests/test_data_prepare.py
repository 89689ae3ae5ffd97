"""``python -m memo.data.prepare``: documents tokenized into Megatron's indexed format, read back by
megatron-core's own reader; bad input in one line; nothing replaced."""

import json
import subprocess

import numpy
import pytest
from conftest import PYTHON
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from memo.data.prepare import PrepareError, main, prepare

DOCUMENTS = ["the cat sat on the mat", "a dog ran", "the dog and the cat sat"]


@pytest.fixture
def tokenizer_file(tmp_path):
    """A word-level tokenizer of the documents' words, with an end-of-text token."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(DOCUMENTS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_documents_come_back_from_megatrons_reader_as_their_tokens_and_an_end_of_document(tmp_path, tokenizer_file):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCUMENTS[:2])))
    text = tmp_path / "more.txt"
    text.write_text(DOCUMENTS[2])
    done = prepare([corpus, text], tokenizer_file, tmp_path / "out" / "corpus")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eod = tokenizer.token_to_id("<|endoftext|>")
    expected = [tokenizer.encode(d).ids + [eod] for d in DOCUMENTS]
    assert (done.documents, done.tokens, done.eod, done.dtype) == (3, sum(map(len, expected)), eod, "uint16")
    dataset = IndexedDataset(str(tmp_path / "out" / "corpus"))
    assert len(dataset) == 3 and list(dataset.document_indices) == [0, 1, 2, 3]
    assert [dataset[i].tolist() for i in range(3)] == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["corpus.bin", "corpus.idx"]  # no leftovers


def test_the_command_line_prepares_and_then_refuses_to_replace(tmp_path, tokenizer_file, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"body": DOCUMENTS[0]}) + "\n")
    arguments = ["--input", str(corpus), "--tokenizer", str(tokenizer_file), "--output-prefix", str(tmp_path / "corpus"),
                 "--json-key", "body"]
    done = subprocess.run([PYTHON, "-m", "memo.data.prepare", *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("1 documents, 7 tokens (uint16")
    before = (tmp_path / "corpus.bin").read_bytes()
    assert main(arguments) == 2  # (the command's own function, in this process)
    assert capsys.readouterr().err.strip().endswith("corpus.bin exists and is kept; choose another --output-prefix")
    assert (tmp_path / "corpus.bin").read_bytes() == before


@pytest.mark.parametrize("content, options, message", [
    ('{"text": "a cat"}\n{"text": \n', {}, "corpus.jsonl:2: not a JSON object"),
    ('{"body": "a cat"}\n', {}, "corpus.jsonl:1: no text under the key 'text'; set --json-key"),
    ('{"text": "a cat"}\n', {"eod_token": "<eod>"}, "has no end-of-document token <eod>; set --eod-token"),
    ("\n\n", {}, "no document in"),
])
def test_bad_input_is_one_line_and_leaves_no_file(tmp_path, tokenizer_file, content, options, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(content)
    with pytest.raises(PrepareError, match=message) as error:
        prepare([corpus], tokenizer_file, tmp_path / "corpus", **options)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "tokenizer.json"]


def test_a_file_that_is_no_tokenizer_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    (tmp_path / "a.txt").write_text("a cat")
    with pytest.raises(PrepareError, match="tokenizer.json: not a tokenizer file of the tokenizers library"):
        prepare([tmp_path / "a.txt"], bad, tmp_path / "corpus")


def test_ids_past_65500_are_stored_as_int32_even_in_a_small_vocabulary(tmp_path):
    """A vocabulary may leave gaps: an id past 65,500 needs int32 though the count is small."""
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "cat": 1, "<|endoftext|>": 70000}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    assert Tokenizer.from_file(str(path)).get_vocab_size() == 3
    (tmp_path / "a.txt").write_text("cat")
    done = prepare([tmp_path / "a.txt"], path, tmp_path / "corpus")
    dataset = IndexedDataset(str(tmp_path / "corpus"))
    assert (done.dtype, done.eod) == ("int32", 70000) and dataset[0].tolist() == [1, 70000]


def test_a_vocabulary_of_65500_or_more_is_stored_as_int32(tmp_path):
    words = [f"w{i}" for i in range(65600)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", *words])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w0 w65599")
    done = prepare([tmp_path / "a.txt"], tmp_path / "tokenizer.json", tmp_path / "corpus")
    assert done.dtype == "int32" and done.eod == 1
    dataset = IndexedDataset(str(tmp_path / "corpus"))  # held: its items are views of its mapped file
    assert dataset[0].dtype == numpy.int32 and dataset[0].tolist() == [2, 65601, 1]
