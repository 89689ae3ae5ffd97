"""Tokenize documents once into Megatron's indexed format: ``PREFIX.bin`` (every document's token
ids, an end-of-document token after each) and ``PREFIX.idx`` (where each document starts), as
Megatron-LM's ``tools/preprocess_data.py`` writes them and :class:`megatron.core.datasets.
indexed_dataset.IndexedDataset` reads them.

    python -m memo.data.prepare --input corpus.jsonl --tokenizer tokenizer.json --output-prefix data/corpus

* ``--input``: one or more files; a ``.jsonl`` file holds a document per line, its text under
  ``--json-key`` (default ``text``); any other file is one document of UTF-8 text.
* ``--tokenizer``: a tokenizer file of Hugging Face's ``tokenizers`` (``tokenizer.json``); nothing
  is downloaded. The end-of-document token is ``--eod-token``, else the first of
  ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>`` the vocabulary has.
* Token ids are stored as ``uint16`` where the vocabulary has fewer than 65,500 entries, else as
  ``int32`` (Megatron's choice).

Both files are written beside the output under temporary names and then linked into place, so
that a run stopped by an error leaves no half-written corpus (a run killed between the two links
leaves the ``.bin`` alone, which a rerun names), and an existing file is never replaced. A text
file is read whole; split a very large one into documents as JSONL. The tokenizer's own special
tokens are added as its post-processor adds them (as Megatron-LM's Hugging Face tokenizer does).
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

from memo.data.tokenizer import EOD_TOKENS, LocalTokenizer, TokenizerError

class PrepareError(ValueError):
    """Input the preparation cannot use; the message is one line that says what to change."""


@dataclass(frozen=True)
class PreparedCorpus:
    """What :func:`prepare` wrote."""

    prefix: Path
    documents: int
    tokens: int  # end-of-document tokens included
    vocab_size: int
    eod: int  # the end-of-document token's id
    dtype: str  # of the stored ids: uint16 or int32


def _documents(path: Path, json_key: str) -> Iterator[str]:
    """The documents of one input file (see the module docstring)."""
    try:
        if path.suffix.lower() != ".jsonl":
            yield path.read_text(encoding="utf-8")
            return
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise PrepareError(f"{path}:{number}: not a JSON object ({error.msg}); write one "
                                       "document per line") from None
                if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                    raise PrepareError(f"{path}:{number}: no text under the key {json_key!r}; set --json-key "
                                       "to the key that holds it")
                yield record[json_key]
    except (OSError, UnicodeDecodeError) as error:
        raise PrepareError(f"{path}: cannot read it as UTF-8 text ({error})") from None


def prepare(inputs: Sequence[Path], tokenizer_path: Path, output_prefix: Path, json_key: str = "text",
            eod_token: Optional[str] = None) -> PreparedCorpus:
    """Tokenize every document of ``inputs`` into ``output_prefix``'s ``.bin`` and ``.idx``.

    Raises:
        PrepareError: for an input or tokenizer it cannot use, or an output that exists.
    """
    prefix = Path(output_prefix)
    bin_path, idx_path = Path(get_bin_path(str(prefix))), Path(get_idx_path(str(prefix)))
    for path in (bin_path, idx_path):
        if path.exists():
            raise PrepareError(f"{path} exists and is kept; choose another --output-prefix")
    try:
        tokenizer = LocalTokenizer(tokenizer_path, eod_token, eod_setting="--eod-token")
    except TokenizerError as error:
        raise PrepareError(str(error)) from None
    eod, vocab_size = tokenizer.eod, tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary = prefix.with_name(f".{prefix.name}.{os.getpid()}.partial")
    temporary_bin, temporary_idx = Path(get_bin_path(str(temporary))), Path(get_idx_path(str(temporary)))
    documents = tokens = 0
    try:
        builder = IndexedDatasetBuilder(str(temporary_bin), dtype=dtype)
        for path in inputs:
            for text in _documents(Path(path), json_key):
                ids = [*tokenizer.tokenize(text), eod]  # (the builder makes its array of them)
                builder.add_document(ids, [len(ids)])
                documents, tokens = documents + 1, tokens + len(ids)
        if documents == 0:
            raise PrepareError(f"no document in {', '.join(map(str, inputs))}; give --input files with text")
        builder.finalize(str(temporary_idx))
        os.link(temporary_bin, bin_path)  # never replaces: fails if the file appeared meanwhile
        try:
            os.link(temporary_idx, idx_path)
        except OSError:
            bin_path.unlink()
            raise
    except FileExistsError as error:
        raise PrepareError(f"{error.filename2 or error.filename} exists and is kept; choose another "
                           "--output-prefix") from None
    except OSError as error:  # a full disk, or a file system without hard links
        raise PrepareError(f"cannot write {prefix}.bin and .idx: {error.strerror or error}; choose another "
                           "--output-prefix") from None
    finally:
        for path in (temporary_bin, temporary_idx):
            path.unlink(missing_ok=True)
    return PreparedCorpus(prefix, documents, tokens, vocab_size, eod, numpy.dtype(dtype).name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, nargs="+", required=True, help=".jsonl or text files")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizers tokenizer.json")
    parser.add_argument("--output-prefix", type=Path, required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="the key of a .jsonl line's text (default: text)")
    parser.add_argument("--eod-token", help="the end-of-document token (default: the first of "
                                            f"{', '.join(EOD_TOKENS)} the vocabulary has)")
    args = parser.parse_args(argv)
    try:
        corpus = prepare(args.input, args.tokenizer, args.output_prefix, args.json_key, args.eod_token)
    except PrepareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{corpus.documents} documents, {corpus.tokens} tokens ({corpus.dtype}, vocabulary of "
          f"{corpus.vocab_size}, end of document {corpus.eod}) in {corpus.prefix}.bin and {corpus.prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
