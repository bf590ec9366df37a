"""An embedding model's own tokenizer (its ``tokenizer.json``: BERT's WordPiece, lower-cased), and the
limits of what the model takes.

Text becomes ``[CLS] … [SEP]`` ids, as sentence-transformers encodes it; a token array (OpenAI's
``input`` as token ids) is taken as the ids of a text, so the same two specials wrap it: the ids of
"hello" embed exactly as "hello" does. Nothing is truncated or padded here (the file asks for both:
they are turned off); an input longer than the model's ``max_tokens``, specials included, is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


class InputTooLong(ValueError):
    """An input has more tokens than the model takes."""


class EmbeddingTokenizer:
    def __init__(self, model_dir: str | Path, max_tokens: int) -> None:
        self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.max_tokens = max_tokens
        self.cls_id, self.sep_id = self._special("[CLS]"), self._special("[SEP]")

    def _special(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {token} token")
        return token_id

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, specials included (in parallel: ``tokenizers`` releases the GIL)."""
        return [list(e.ids) for e in self._tokenizer.encode_batch_fast(list(texts))]

    def wrap(self, token_ids: Sequence[int]) -> list[int]:
        """A token array as the model input: [CLS] ids [SEP]."""
        return [self.cls_id, *token_ids, self.sep_id]

    def check(self, index: int, ids: Sequence[int]) -> None:
        """Raises InputTooLong or ValueError naming input ``index`` if the model cannot take ``ids``."""
        if len(ids) > self.max_tokens:
            raise InputTooLong(
                f"input {index} has {len(ids)} tokens; this model takes at most {self.max_tokens} "
                "([CLS] and [SEP] included)"
            )
        if bad := next((t for t in ids if not 0 <= t < self.vocab_size), None):
            raise ValueError(
                f"input {index}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
