"""A small corpus made in the test: a word-level tokenizer and documents of a grammar it learns,
prepared into Megatron's indexed format by ``memo.data.prepare``."""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from memo.data.prepare import prepare

SUBJECTS = ["the cat", "a dog", "the host", "a tile", "the layer"]
VERBS = ["sat on", "swapped", "sent", "kept", "recomputed"]
OBJECTS = ["the mat", "a buffer", "the device", "an arena", "the tokens"]


GRAMMAR_WORDS = " ".join(SUBJECTS + VERBS + OBJECTS) + " ."


def documents(count: int, seed: int = 0, upper: bool = False) -> list[str]:
    """``count`` documents of one to six sentences: subject, verb, object, full stop (in capitals
    where ``upper``: a corpus whose words another one does not have)."""
    g = random.Random(seed)
    return [(str.upper if upper else str)(" ".join(f"{g.choice(SUBJECTS)} {g.choice(VERBS)} {g.choice(OBJECTS)} ." for _ in range(g.randint(1, 6))))
            for _ in range(count)]


def make_tokenizer(path: Path, texts: list[str]) -> Path:
    """A word-level tokenizer of the words of ``texts``, with ``<unk>`` and ``<|endoftext|>``."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    tokenizer.save(str(path))
    return path


def make_corpus(directory: Path, count: int = 200, seed: int = 0, name: str = "corpus",
                tokenizer: Path | None = None, upper: bool = False) -> tuple[Path, Path, list[str]]:
    """Prepare ``count`` documents into ``directory/name.bin|.idx``; returns the prefix, the
    tokenizer file (made from the grammar's words unless given) and the documents."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = documents(count, seed, upper)
    if tokenizer is None:
        tokenizer = make_tokenizer(directory / "tokenizer.json", [GRAMMAR_WORDS, GRAMMAR_WORDS.upper()])
    jsonl = directory / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([jsonl], tokenizer, directory / name)
    return directory / name, tokenizer, texts
