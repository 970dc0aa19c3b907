"""Tokenizers of Hugging Face checkpoints, and an incremental decoder for streaming text.

`load_tokenizer(directory)` returns an `HFTokenizer` when the directory has ``tokenizer.json``
(encoded and decoded by the ``tokenizers`` library), else a `TokenIdsOnly` that refuses text.
Both have the interface the engine uses for the bundled `ByteTokenizer`: ``encode(text) ->
list[int]``, ``decode(ids) -> str``, ``eos_id``, ``vocab_size``, plus ``eos_ids`` (every stop
token) and ``bos_id``.

Special tokens are resolved as transformers does:

* **Stops** (``eos_ids``): ``generation_config.json``'s ``eos_token_id`` (an int or a list) wins,
  as it does for ``generate``; else ``config.json``'s ``eos_token_id``; else the tokenizer's
  ``eos_token`` (``tokenizer_config.json``). ``eos_id`` is the first of them, -1 when there is none.
* **BOS when encoding**: ``tokenizer_config.json``'s ``bos_token`` (a string or ``{"content":
  ...}``; an explicit null means no BOS), else ``config.json``'s ``bos_token_id``. If
  ``tokenizer_config.json`` sets ``add_bos_token`` / ``add_eos_token``, text is encoded without the
  ``tokenizer.json`` post-processor and BOS / EOS are added as those flags say (what transformers'
  Llama tokenizers do); otherwise the post-processor of ``tokenizer.json`` decides, exactly as
  ``Tokenizer.encode(text)`` does.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from paged.models.hf_config import read_json

TOKENIZER_FILE = "tokenizer.json"


def _optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def _ids(value: Any, path: Path, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: {key}={value!r} must be a token id or a list of them")
    return tuple(values)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: str | Path, token_to_id=None) -> dict:
    """``{"bos_id", "eos_ids", "add_bos", "add_eos"}`` of a checkpoint, resolved as described in
    the module docstring. ``token_to_id`` maps a token string to its id (None: no tokenizer, so
    only the configs' ids count). ``add_bos`` / ``add_eos`` are None when the tokenizer config does
    not set them."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    gen_path = directory / "generation_config.json"
    tok_path = directory / "tokenizer_config.json"
    cfg, gen, tok = read_json(cfg_path), _optional_json(gen_path), _optional_json(tok_path)

    def lookup(key: str) -> int | None:
        text = _token_text(tok.get(key))
        if text is None or token_to_id is None:
            return None
        found = token_to_id(text)
        if found is None:
            raise ValueError(f"{tok_path}: {key}={text!r} is not a token of {TOKENIZER_FILE}")
        return found

    eos = _ids(gen.get("eos_token_id"), gen_path, "eos_token_id")
    if not eos:
        eos = _ids(cfg.get("eos_token_id"), cfg_path, "eos_token_id")
    if not eos:
        eos = _ids(lookup("eos_token"), tok_path, "eos_token")
    if "bos_token" in tok and token_to_id is not None:
        bos = lookup("bos_token")
    else:
        bos = (_ids(cfg.get("bos_token_id"), cfg_path, "bos_token_id") or (None,))[0]
    flags = {}
    for key in ("add_bos_token", "add_eos_token"):
        value = tok.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{tok_path}: {key}={value!r} must be a bool")
        flags[key] = value
    if flags["add_bos_token"] and bos is None:
        raise ValueError(f"{tok_path}: add_bos_token is true but no bos_token is defined")
    if flags["add_eos_token"] and not eos:
        raise ValueError(f"{tok_path}: add_eos_token is true but no eos token is defined")
    return {"bos_id": bos, "eos_ids": eos, "add_bos": flags["add_bos_token"],
            "add_eos": flags["add_eos_token"]}


def _check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"token id {i!r} must be an int")
        if not 0 <= int(i) < vocab_size:
            raise ValueError(f"token id {int(i)} outside [0, {vocab_size})")
        out.append(int(i))
    return out


class TokenizersBase:
    """What a tokenizer over the ``tokenizers`` library (``self._tok``) shares, wherever its
    vocabulary came from (a checkpoint's ``tokenizer.json``: `HFTokenizer`; a GGUF file's
    metadata: ``paged.models.gguf_tokenizer.GGUFTokenizer``): the special ids and decoding.
    A subclass sets ``_tok``, ``bos_id``, ``eos_ids`` and ``vocab_size``."""

    @property
    def special_ids(self) -> frozenset[int]:
        ids = set(self.eos_ids) | ({self.bos_id} if self.bos_id is not None else set())
        return frozenset(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens skipped by default; broken UTF-8 becomes U+FFFD).

        Raises:
          TypeError: ``ids`` is a str/bytes or holds a non-integer.
          ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = _check_ids(ids, self.vocab_size)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class HFTokenizer(TokenizersBase):
    """A checkpoint's ``tokenizer.json`` (``tokenizers`` library) with its special tokens.

    Attributes:
      bos_id: the BOS id (None: the tokenizer has none).
      eos_ids: the stop ids of generation (possibly several, possibly none).
      eos_id: ``eos_ids[0]``, or -1 when there is none (the engine's single-id stop check).
      vocab_size: ids the tokenizer knows, added tokens included.
      source: the directory it was read from.
    """

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- the library raises its own error types
            raise ValueError(f"{path}: not a readable tokenizer file ({e})") from None
        special = special_tokens(directory, self._tok.token_to_id)
        self.source = directory
        self.bos_id: int | None = special["bos_id"]
        self.eos_ids: tuple[int, ...] = special["eos_ids"]
        self.eos_id: int = self.eos_ids[0] if self.eos_ids else -1
        self._add_bos, self._add_eos = special["add_bos"], special["add_eos"]
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
          text: any str.
          add_bos: add the special tokens the checkpoint adds (BOS, see the module docstring);
            False encodes the bare text.
          add_eos: also append ``eos_id`` (if the checkpoint does not already).

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``add_eos`` with no EOS defined.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}: {text!r:.80}")
        if not add_bos:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        elif self._add_bos is None and self._add_eos is None:
            ids = self._tok.encode(text).ids  # tokenizer.json's post-processor decides
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if self._add_bos:
                ids = [self.bos_id, *ids]
            if self._add_eos:
                ids = [*ids, self.eos_id]
        if add_eos and not (ids and ids[-1] in self.eos_ids):
            if self.eos_id < 0:
                raise ValueError(f"{self.source}: add_eos=True but the checkpoint has no EOS")
            ids = [*ids, self.eos_id]
        return list(ids)



class TokenIdsOnly:
    """Stand-in tokenizer of a checkpoint without ``tokenizer.json``: prompts must be token ids.

    ``encode`` raises ValueError; ``decode`` returns "" (outputs carry their token ids); the
    stop ids come from ``generation_config.json`` / ``config.json`` as for `HFTokenizer`.
    """

    def __init__(self, directory: str | Path, vocab_size: int):
        special = special_tokens(directory)
        self.source = Path(directory)
        self.bos_id: int | None = special["bos_id"]
        self.eos_ids: tuple[int, ...] = special["eos_ids"]
        self.eos_id: int = self.eos_ids[0] if self.eos_ids else -1
        self.vocab_size = vocab_size
        self.special_ids = frozenset(self.eos_ids)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        raise ValueError(f"{self.source} has no {TOKENIZER_FILE}: prompts must be token ids, "
                         f"not text (got {text!r:.40})")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        _check_ids(ids, self.vocab_size)
        return ""


def load_tokenizer(directory: str | Path, vocab_size: int) -> HFTokenizer | TokenIdsOnly:
    """The checkpoint's tokenizer: `HFTokenizer` if it has ``tokenizer.json``, else `TokenIdsOnly`
    (``vocab_size``: the model's)."""
    if (Path(directory) / TOKENIZER_FILE).is_file():
        return HFTokenizer(directory)
    return TokenIdsOnly(directory, vocab_size)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces without splitting a character.

    Byte-level tokenizers (and `ByteTokenizer`) may split one UTF-8 character over several tokens,
    and SentencePiece-style decoders change a word's text by what precedes it, so decoding each
    new token alone is wrong. Each `step` decodes the window ``ids[prefix_offset:]`` and the
    window ``ids[prefix_offset:read_offset]`` (the tokens already emitted, kept as context) and
    returns the difference, unless the new text ends in U+FFFD (an incomplete character): then it
    returns "" and keeps the tokens until a later step completes it. `flush` returns what is
    still held back at the end (with U+FFFD for bytes that never formed a character).

    Concatenating every `step` and the final `flush` gives ``tokenizer.decode(all ids)`` for
    byte-level and byte tokenizers.

    Args:
      tokenizer: anything with ``decode(ids) -> str`` (`HFTokenizer`, `ByteTokenizer`).
      prompt_ids: ids already shown (the prompt): context for the first pieces, never emitted.
      context: how many already-shown tokens to keep decoding in front of the new ones.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), *, context: int = 5):
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - context, 0)

    def step(self, new_ids: Iterable[int]) -> str:
        """Appends ``new_ids``; returns the text they complete ("" if it is still incomplete)."""
        self.ids.extend(int(i) for i in new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """The text of the tokens still held back (the sequence ended mid-character)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
