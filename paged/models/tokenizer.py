"""`ByteTokenizer`: UTF-8 bytes as ids 0..255, plus BOS (256) and EOS (257). No merges, no files."""

from __future__ import annotations

import numbers
from collections.abc import Iterable


class ByteTokenizer:
    """Byte-level tokenizer shared by the bundled models.

    Attributes:
      bos_id: 256, prepended by ``encode`` unless ``add_bos=False``.
      eos_id: 257, the stop token of generation.
      eos_ids: ``(257,)``: every stop token (the interface of `paged.models.hf_tokenizer`, whose
        checkpoints may have several).
      vocab_size: 258.
    """

    bos_id: int = 256
    eos_id: int = 257
    eos_ids: tuple[int, ...] = (257,)
    vocab_size: int = 258

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.bos_id, self.eos_id))

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Encodes ``text`` as its UTF-8 bytes.

        Args:
          text: any str (surrogates that UTF-8 cannot encode raise).
          add_bos: prepend ``bos_id``.
          add_eos: append ``eos_id``.

        Returns:
          The token ids.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``text`` cannot be encoded as UTF-8 (lone surrogates).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}: {text!r:.80}")
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"text {text!r:.80} is not encodable as UTF-8: {e}") from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids to text, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD.

        Args:
          ids: token ids (python or numpy ints) in ``[0, vocab_size)``.

        Returns:
          The text.

        Raises:
          TypeError: ``ids`` is a str/bytes or holds a non-integer.
          ValueError: an id is outside ``[0, vocab_size)``.
        """
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        out = bytearray()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"token id {i!r} must be an int")
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")
