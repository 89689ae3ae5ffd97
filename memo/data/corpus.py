"""Training sequences from Megatron's indexed datasets, through megatron-core's own GPT dataset.

``train.data=megatron:<prefix>`` (or a weighted blend of prefixes) is read as Megatron-LM reads
``--data-path``: megatron-core's :class:`~megatron.core.datasets.blended_megatron_dataset_builder.
BlendedMegatronDatasetBuilder` splits each prefix's documents into train, valid and test by
``train.data_split``, shuffles them, and packs them end to end (an end-of-document token after
each) into samples of ``seq + 1`` tokens; a blend draws samples from its prefixes by weight. Its
sample indices are cached as ``.npy`` files (``train.data_cache``, else ``cache/`` beside the
prefix) under a hash of every setting that shapes them, built once by global rank 0.
"""

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from memo.config import ConfigError, TrainConfig
from memo.config.validate import megatron_blend
from memo.data.tokenizer import LocalTokenizer, TokenizerError

log = logging.getLogger("memo")


@dataclass(frozen=True)
class SampleCounts:
    """How many samples (sequences) a run draws from each split: Megatron builds that many."""

    train: int
    valid: int = 0


class MegatronCorpus:
    """The samples of ``train.data=megatron:...``: ``sample(i, seq + 1)`` is packed sequence ``i``
    of the train split, ``valid_sample(i, seq + 1)`` of the valid split.

    Raises:
        ConfigError: a tokenizer that cannot be read, a vocabulary larger than the model's, an
            index megatron-core cannot read, or a split without documents.
    """

    def __init__(self, train: TrainConfig, vocab_size: int, seq: int, counts: SampleCounts):
        prefixes, weights = megatron_blend(train)
        try:
            tokenizer = LocalTokenizer(train.tokenizer, train.eod_token)
        except TokenizerError as error:
            raise ConfigError(f"train.tokenizer: {error}") from None
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"train.tokenizer={train.tokenizer} has ids up to {tokenizer.vocab_size - 1} but the "
                              f"model's vocabulary is {vocab_size}; set model.vocab_size to at least "
                              f"{tokenizer.vocab_size}")
        self.eod = tokenizer.eod
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
        config.split_matrix = [config.split_matrix[0], config.split_matrix[1] if counts.valid else None, None]
        drawn = {"train": config.split_matrix[0], **({"valid": config.split_matrix[1]} if counts.valid else {})}
        try:
            for prefix in prefixes:
                self._check_split_documents(train, prefix, drawn)
            self.train, self.valid, _ = BlendedMegatronDatasetBuilder(
                GPTDataset, [counts.train, counts.valid, 0], lambda: True, config).build()
        except (AssertionError, ValueError, OSError) as error:
            raise ConfigError(f"train.data={train.data}: megatron-core cannot build its dataset "
                              f"({str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}); "
                              "check the .bin/.idx pair, train.data_split and train.data_cache") from None
        log.info("megatron data: %s, %d train samples of %d tokens%s", ", ".join(prefixes), len(self.train), seq,
                 f", {len(self.valid)} valid" if self.valid is not None else "")

    @staticmethod
    def _check_split_documents(train: TrainConfig, prefix: str, drawn: dict) -> None:
        """Every split drawn from (name: book-ends as fractions of the documents, None for none)
        has a document of ``prefix``: megatron-core, asked for samples of an empty split, never
        returns."""
        documents = len(IndexedDataset(prefix))
        for name, bookends in drawn.items():
            if bookends is None or round(bookends[1] * documents) <= round(bookends[0] * documents):
                raise ConfigError(f"train.data_split={train.data_split} leaves the {name} split of {prefix} ({documents} "
                                  f"documents) without a document; give {name} a larger share")

    @staticmethod
    def _tokens(dataset, index: int, length: int) -> torch.Tensor:
        item = dataset[index % len(dataset)]
        text = torch.cat((item["tokens"], item["labels"][-1:]))
        assert len(text) == length, f"megatron-core's sample has {len(text)} tokens, not {length}"
        return text

    def sample(self, index: int, length: int) -> torch.Tensor:
        """Training sequence ``index``: ``length`` (= seq + 1) int64 token ids."""
        return self._tokens(self.train, index, length)

    def valid_sample(self, index: int, length: int) -> Optional[torch.Tensor]:
        """Validation sequence ``index``: ``length`` (= seq + 1) int64 token ids."""
        return self._tokens(self.valid, index, length)
