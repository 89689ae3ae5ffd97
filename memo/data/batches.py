"""Training sequences: deterministic synthetic tokens, byte tokens of a text file, or Megatron's
indexed data.

Sample ``i`` of a run is a function of (seed, i) alone, and data-parallel rank r of d takes the
samples ``(k·d + r)·b ..`` of micro-batch k, so the global batch of a step is the same for every
parallel layout; tensor- and context-parallel ranks of one replica read identical samples.
"""

from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

from memo.config import ConfigError, TrainConfig
from memo.config.validate import MEGATRON_DATA
from memo.data.corpus import MegatronCorpus
from memo.model.documents import DocumentParams, Documents

SYNTHETIC_ALPHABET = 1024


class SyntheticTokens:
    """Pairs (a, succ(a)) of tokens: a uniform over an alphabet, succ a fixed permutation of it.

    Every second token is predictable from the one before, so a model that learns the pairs
    reaches a loss of ½·ln(alphabet) nats, from ln(vocab) at initialization: training visibly
    works at any sequence length, with no download.
    """

    def __init__(self, vocab_size: int, seed: int, alphabet: int = SYNTHETIC_ALPHABET):
        g = torch.Generator().manual_seed(seed)
        self.alphabet = torch.randperm(vocab_size, generator=g)[: min(alphabet, vocab_size)]
        self.successor = self.alphabet[torch.randperm(len(self.alphabet), generator=g)]
        self.seed = seed

    def sample(self, index: int, length: int) -> torch.Tensor:
        """Sequence number ``index``: ``length`` int64 token ids."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        picks = torch.randint(len(self.alphabet), ((length + 1) // 2,), generator=g)
        pairs = torch.stack((self.alphabet[picks], self.successor[picks]), dim=1)
        return pairs.flatten()[:length]

    def valid_sample(self, index: int, length: int) -> torch.Tensor:
        """Validation sequence ``index``: drawn from seeds no training sequence uses."""
        return self.sample(-1 - index, length)


class ByteTokens:
    """Windows of a text file at deterministic random offsets; each byte is a token (0–255)."""

    def __init__(self, path: str, seed: int, length: int):
        self.data = np.fromfile(Path(path), dtype=np.uint8)
        if len(self.data) < length:
            raise ConfigError(
                f"train.data={path} has {len(self.data)} bytes but a sample needs seq + 1 = "
                f"{length}; use a longer file or a shorter seq"
            )
        self.seed = seed

    def sample(self, index: int, length: int) -> torch.Tensor:
        """Sequence number ``index``: ``length`` consecutive bytes as int64 token ids."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(len(self.data) - length + 1, (1,), generator=g))
        return torch.from_numpy(self.data[start : start + length].astype(np.int64))

    def valid_sample(self, index: int, length: int) -> torch.Tensor:
        """Validation sequence ``index``: a window at offsets of seeds no training sample uses (a
        text file has no held-out part: prepare it as Megatron data for that)."""
        return self.sample(-1 - index, length)


TokenSource = Union[SyntheticTokens, ByteTokens, MegatronCorpus]


def token_source(train: TrainConfig, vocab_size: int, seq: int, validation: bool = False) -> TokenSource:
    """The source ``train.data`` names: synthetic tokens, a text file's bytes, or Megatron's
    indexed data (:class:`memo.data.corpus.MegatronCorpus`, its valid split built where
    ``validation``)."""
    if train.data == "synthetic":
        return SyntheticTokens(vocab_size, train.seed)
    if train.data.startswith(MEGATRON_DATA):
        return MegatronCorpus(train, vocab_size, seq, validation)
    return ByteTokens(train.data, train.seed, seq + 1)


def micro_batches(
    source,
    seq: int,
    micro_batch_size: int,
    micro_batches_per_step: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    consumed_samples: int = 0,
    eod: Optional[int] = None,
) -> Iterator[list[dict]]:
    """Yield, for each step, this rank's micro-batches as ``tokens``/``labels``/``position_ids``
    tensors of shape ``[micro_batch_size, seq]`` on ``device``; labels are tokens shifted by one.
    The first step's samples follow the ``consumed_samples`` an earlier run (a checkpoint) drew.

    With ``eod`` (documents kept apart, one sequence per micro-batch) a micro-batch also holds
    ``documents`` (:class:`~memo.model.documents.DocumentParams`, the model's
    ``packed_seq_params``) and ``loss_mask`` (0 where the token is ``eod``: its label begins the
    next document), and its positions restart at every document."""
    positions = torch.arange(seq, device=device).expand(micro_batch_size, seq)
    step = 0
    while True:
        batch = []
        for k in range(micro_batches_per_step):
            first = consumed_samples + ((step * micro_batches_per_step + k) * dp_size + dp_rank) * micro_batch_size
            rows = torch.stack([source.sample(first + j, seq + 1) for j in range(micro_batch_size)])
            on_device = rows.to(device)
            micro_batch = {"tokens": on_device[:, :-1], "labels": on_device[:, 1:], "position_ids": positions}
            if eod is not None:
                params = DocumentParams.of(Documents.of(rows[0, :-1], eod), device)  # (found on the host)
                micro_batch.update(position_ids=params.position_ids[None], documents=params,
                                   loss_mask=micro_batch["tokens"] != eod)
            batch.append(micro_batch)
        yield batch
        step += 1
