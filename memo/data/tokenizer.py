"""A local ``tokenizer.json`` as megatron-core's datasets take a tokenizer.

Megatron's GPT dataset reads a tokenizer's vocabulary size (to pick the ids' storage type), its
end-of-document id (where documents of a packed sequence meet) and its identity (for the hash of
its cached indices); :class:`LocalTokenizer` gives these for a file of Hugging Face's
``tokenizers`` library, read from disk (nothing is downloaded), through megatron-core's public
tokenizer base class.
"""

from collections import OrderedDict
from pathlib import Path
from typing import Optional

from megatron.core.tokenizers import MegatronTokenizerBase

EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")  # Llama-3's, Llama-2's, Gemma's; Qwen's has none


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message is one line that says what to change."""


class LocalTokenizer(MegatronTokenizerBase):
    """The tokenizer of ``path`` (a ``tokenizer.json``) and its end-of-document token: ``eod_token``,
    else the first of :data:`EOD_TOKENS` its vocabulary has; ``eod_setting`` is where a user sets it,
    named in the error when there is none.

    Raises:
        TokenizerError: the file is not a tokenizer, or has no end-of-document token.
    """

    def __init__(self, path: str, eod_token: Optional[str] = None, eod_setting: str = "train.eod_token"):
        super().__init__(str(path), {})
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises its own exception types for a bad file
            raise TokenizerError(f"{path}: not a tokenizer file of the tokenizers library ({error}); give a "
                                 "tokenizer.json") from None
        names = (eod_token,) if eod_token is not None else EOD_TOKENS
        self._eod = next((i for i in map(self._tokenizer.token_to_id, names) if i is not None), None)
        if self._eod is None:
            raise TokenizerError(f"{path}: the vocabulary has no end-of-document token {' or '.join(names)}; set "
                                 f"{eod_setting} to the one it has")
        # one more than the largest id, not the count: a vocabulary may leave gaps
        self._vocab_size = max(self.vocab.values()) + 1

    @property
    def eod(self) -> int:
        """The end-of-document token's id."""
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        """The begin-of-text token's id (the first of :data:`BOS_TOKENS` the vocabulary has), or None."""
        return next((i for i in map(self._tokenizer.token_to_id, BOS_TOKENS) if i is not None), None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: one more than its largest."""
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What Megatron hashes, with the dataset's settings, to name its cached sample indices."""
        return OrderedDict(cls=f"{type(self).__module__}.{type(self).__qualname__}",
                           tokenizer_path=str(Path(self.path).resolve()), eod=self._eod)

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``, with the special tokens the tokenizer's post-processor adds."""
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("a pretraining corpus has no chat turns")
