"""Training sequences from Megatron's indexed datasets, through megatron-core's own GPT dataset.

``train.data=megatron:<prefix>`` (or a weighted blend of prefixes) is read as Megatron-LM reads
``--data-path``: megatron-core's :class:`~megatron.core.datasets.blended_megatron_dataset_builder.
BlendedMegatronDatasetBuilder` splits each prefix's documents into train, valid and test by
``train.data_split``, shuffles them, and packs them end to end (an end-of-document token after
each) into samples of ``seq + 1`` tokens; a blend draws samples from its prefixes by weight. Its
sample indices are cached as ``.npy`` files (``train.data_cache``, else megatron-core's
``<prefix>/cache/``) under a hash of every setting that shapes them, built once by global rank 0.
"""

import contextlib
import fcntl
import logging
import math
import struct
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

from memo.config import ConfigError, TrainConfig
from memo.config.validate import megatron_blend
from memo.data.tokenizer import LocalTokenizer, TokenizerError

log = logging.getLogger("memo")


@contextlib.contextmanager
def _index_build_lock(train: TrainConfig, prefix: str) -> Iterator[None]:
    """Global rank 0 of each job builds megatron-core's cached sample indices (the other ranks
    wait for it, then read them); jobs of a sweep on one corpus would write the same files at
    once, which megatron-core writes in place: each job's rank 0 builds them under an exclusive
    lock on a file in the cache directory, so the second finds them whole. Where the file cannot
    be made (a read-only directory) nothing is built there either, and megatron-core says so."""
    if dist.is_initialized() and dist.get_rank() != 0:
        yield
        return
    directory = Path(train.data_cache) if train.data_cache is not None else Path(prefix) / "cache"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / ".memo-build.lock", "a")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: build as megatron-core does alone
            pass
        yield


# megatron-core's .idx (indexed_dataset.py): magic, version, dtype code, sequences, documents
_INDEX_HEAD = struct.Struct("<9sQBQQ")
_INDEX_MAGIC = b"MMIDIDX\x00\x00"


def _checked_index(prefix: str) -> str:
    """``prefix``, once its ``.idx`` is whole and its ``.bin`` holds every sequence the index
    points to: megatron-core reads a cut file with numpy and fails with a traceback (and another
    from its ``__del__``) that names no file.

    Raises:
        ConfigError: naming the file that is missing, cut short or not an index.
    """
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    try:
        with open(idx, "rb") as stream:
            head = stream.read(_INDEX_HEAD.size)
            magic, _, code, sequences, documents = _INDEX_HEAD.unpack(head) if len(head) == _INDEX_HEAD.size else (
                None, 0, 0, 0, 0)
            if magic != _INDEX_MAGIC:
                raise ConfigError(f"train.data: {idx} is not a Megatron index (no MMIDIDX header); prepare it again "
                                  "(python -m memo.data.prepare)")
            arrays = sequences * (4 + 8) + documents * 8  # lengths int32, pointers int64, document starts int64
            if idx.stat().st_size < _INDEX_HEAD.size + arrays:
                raise ConfigError(f"train.data: {idx} is {idx.stat().st_size} bytes, and its header needs "
                                  f"{_INDEX_HEAD.size + arrays}: it is cut short; copy or prepare it again")
            if sequences:
                stream.seek(_INDEX_HEAD.size + 4 * (sequences - 1))
                length = struct.unpack("<i", stream.read(4))[0]
                stream.seek(_INDEX_HEAD.size + 4 * sequences + 8 * (sequences - 1))
                try:
                    element = DType.size(code)
                except ValueError:
                    raise ConfigError(f"train.data: {idx} names no element type its header ({code}) could have: it "
                                      "is damaged; copy or prepare it again") from None
                end = struct.unpack("<q", stream.read(8))[0] + length * element
                if bin_.stat().st_size < end:
                    raise ConfigError(f"train.data: {bin_} is {bin_.stat().st_size} bytes, and {idx} points to "
                                      f"{end}: it is cut short; copy or prepare it again")
    except OSError as error:
        raise ConfigError(f"train.data: {error.filename} cannot be read ({error.strerror}); give the prefix of a "
                          ".bin/.idx pair (python -m memo.data.prepare)") from None
    return prefix


class MegatronCorpus:
    """The samples of ``train.data=megatron:...``: ``sample(i, seq + 1)`` is packed sequence ``i``
    of the train split, ``valid_sample(i, seq + 1)`` of the valid split (built where
    ``validation``).

    Each split is built as one pass over its documents (a blend: as many samples, drawn by
    weight, as give every prefix at least one pass), whatever the run's steps and batch, and a
    run that draws more goes through it again in the same order: sample ``i`` is the same for a
    run of any length, so a run resumed with more steps or another global batch draws what it
    would have drawn had it not stopped.

    Raises:
        ConfigError: a tokenizer that cannot be read, a vocabulary larger than the model's, an
            index megatron-core cannot read, a split without documents, or a cache it cannot write.
    """

    def __init__(self, train: TrainConfig, vocab_size: int, seq: int, validation: bool = False):
        prefixes, weights = megatron_blend(train)
        try:
            tokenizer = LocalTokenizer(train.tokenizer, train.eod_token)
        except TokenizerError as error:
            raise ConfigError(f"train.tokenizer: {error}") from None
        self.eod = tokenizer.eod  # the end-of-document id, which ends every packed document
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"train.tokenizer={train.tokenizer} has ids up to {tokenizer.vocab_size - 1} but the "
                              f"model's vocabulary is {vocab_size}; set model.vocab_size to at least "
                              f"{tokenizer.vocab_size}")
        config = GPTDatasetConfig(
            random_seed=train.seed,
            sequence_length=seq,
            blend=(prefixes, weights),
            split=train.data_split,
            path_to_cache=train.data_cache,
            tokenizer=tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        # Splits the run does not draw from are not built (the test split never is): their
        # documents stay where data_split puts them, out of the training split either way.
        config.split_matrix = [config.split_matrix[0], config.split_matrix[1] if validation else None, None]
        drawn = {"train": config.split_matrix[0], **({"valid": config.split_matrix[1]} if validation else {})}
        try:
            # one pass: megatron-core builds as many samples as it is asked for, reshuffled by the
            # count; a single prefix is given its own (None), a blend as many as give each prefix
            # one pass at its weight
            indexes = [IndexedDataset(_checked_index(prefix)) for prefix in prefixes]
            passes = {name: [self._split_tokens(train, prefix, index, name, bookends) // seq
                             for prefix, index in zip(prefixes, indexes, strict=True)]
                      for name, bookends in drawn.items()}  # samples of one pass, per prefix
            shares = None if weights is None else [w / sum(weights) for w in weights]
            sizes = [None if shares is None else 0 if name not in drawn else
                     max(1, max(math.ceil(n / share) for n, share in zip(passes[name], shares, strict=True)))
                     for name in ("train", "valid", "test")]
            with _index_build_lock(train, prefixes[0]):
                self.train, self.valid, _ = BlendedMegatronDatasetBuilder(
                    GPTDataset, sizes, lambda: True, config).build()
        except ConfigError:
            raise
        except Exception as error:  # megatron-core raises bare Exceptions too (an unwritable cache)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"train.data={train.data}: megatron-core cannot build its dataset ({reason}); "
                              "check the .bin/.idx pair, train.data_split and train.data_cache") from None
        for name, split in (("train", self.train), ("valid", self.valid if validation else None)):
            if split is not None and len(split) == 0:
                raise ConfigError(f"train.data={train.data}: the {name} split has fewer than seq + 1 = {seq + 1} "
                                  f"tokens; give {name} a larger share of train.data_split, or a shorter seq")
        log.info("megatron data: %s, %d train samples of %d tokens%s", ", ".join(prefixes), len(self.train), seq,
                 f", {len(self.valid)} valid" if self.valid is not None else "")

    @staticmethod
    def _split_tokens(train: TrainConfig, prefix: str, index: IndexedDataset, name: str, bookends) -> int:
        """Tokens of ``prefix``'s documents in one split (book-ends as fractions of its documents,
        as megatron-core cuts them); a split drawn from must have a document: megatron-core,
        asked for samples of an empty split, never returns."""
        documents = len(index)
        first, end = (round(b * documents) for b in bookends) if bookends is not None else (0, 0)
        if end <= first:
            raise ConfigError(f"train.data_split={train.data_split} leaves the {name} split of {prefix} ({documents} "
                              f"documents) without a document; give {name} a larger share")
        return int(index.sequence_lengths[first:end].sum())

    @staticmethod
    def _tokens(dataset, index: int, length: int) -> torch.Tensor:
        item = dataset[index % len(dataset)]  # past the pass: the same pass again
        text = torch.cat((item["tokens"], item["labels"][-1:]))
        assert len(text) == length, f"megatron-core's sample has {len(text)} tokens, not {length}"
        return text

    def sample(self, index: int, length: int) -> torch.Tensor:
        """Training sequence ``index``: ``length`` (= seq + 1) int64 token ids."""
        return self._tokens(self.train, index, length)

    def valid_sample(self, index: int, length: int) -> torch.Tensor:
        """Validation sequence ``index``: ``length`` (= seq + 1) int64 token ids."""
        return self._tokens(self.valid, index, length)
