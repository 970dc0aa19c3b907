"""The tokenizer of a GGUF file, built from its metadata with the ``tokenizers`` library.

``tokenizer.ggml.model = "gpt2"`` is byte-level BPE: the vocabulary is ``tokenizer.ggml.tokens``
(id = position), the merges ``tokenizer.ggml.merges`` ("a b" strings, in rank order). The
pre-tokenizer follows ``tokenizer.ggml.pre`` as llama.cpp reads it (``PRE_TOKENIZERS``: "smollm"
splits every digit off, then the GPT-2 regex; "gpt2" / "default" the GPT-2 regex alone), the
decoder is byte-level. Tokens of type CONTROL (3) are special tokens (never split, skipped when
decoding), USER_DEFINED (4) added tokens. BOS / EOS come from ``tokenizer.ggml.bos_token_id`` /
``eos_token_id`` (and ``eot_token_id``, another stop), BOS is added when encoding only if
``tokenizer.ggml.add_bos_token`` says so. The chat template is ``tokenizer.chat_template``.

`GGUFTokenizer` has `paged.models.hf_tokenizer.HFTokenizer`'s interface (``encode``, ``decode``,
``bos_id``, ``eos_ids``, ``eos_id``, ``vocab_size``, ``special_ids``), so the engine, the server
and `IncrementalDecoder` (streaming) use it the same way, plus ``chat_template`` and
``apply_chat_template`` (Hugging Face's signature) for the server's chat endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from paged.models.chat_template import ChatTemplate
from paged.models.hf_tokenizer import TokenizersBase

CONTROL, USER_DEFINED = 3, 4
PRE_TOKENIZERS = ("smollm", "gpt2", "default")


def _pre_tokenizer(pre: str, path: Path):
    from tokenizers import pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                     f"{list(PRE_TOKENIZERS)}")


def build_tokenizer(reader, path: Path):
    """``(tokenizers.Tokenizer, token strings, token types)`` of a GGUF reader's metadata.

    Raises:
      ValueError: not a "gpt2" (byte-level BPE) tokenizer, an unsupported pre-tokenizer, or
        malformed tokens / merges.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from paged.models.gguf import field

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE)")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens / tokenizer.ggml.merges are missing")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{path}: merge {m!r} is not two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok, tokens, types


class GGUFTokenizer(TokenizersBase):
    """A GGUF file's byte-level BPE tokenizer and chat template.

    Attributes:
      bos_id: the BOS id (None: the file names none).
      eos_ids: the stop ids (EOS, and EOT when the file names a different one).
      eos_id: ``eos_ids[0]``, -1 when there is none.
      vocab_size: number of tokens.
      chat_template: the template text ("" when the file has none).
      source: the file.

    Raises:
      ValueError: see `build_tokenizer`; a special token id outside the vocabulary.
    """

    def __init__(self, path: str | Path, reader=None):
        from paged.models.gguf import field, open_gguf, resolve

        path = resolve(path)
        reader = reader if reader is not None else open_gguf(path)
        self._tok, tokens, _ = build_tokenizer(reader, path)
        self.source = path
        self.vocab_size: int = len(tokens)

        def token_id(key):
            value = field(reader, key)
            if value is not None and not 0 <= int(value) < len(tokens):
                raise ValueError(f"{path}: {key}={value} outside [0, {len(tokens)})")
            return None if value is None else int(value)

        self.bos_id: int | None = token_id("tokenizer.ggml.bos_token_id")
        eos, eot = token_id("tokenizer.ggml.eos_token_id"), token_id("tokenizer.ggml.eot_token_id")
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        self.eos_id: int = self.eos_ids[0] if self.eos_ids else -1
        self._add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
        if self._add_bos and self.bos_id is None:
            raise ValueError(f"{path}: tokenizer.ggml.add_bos_token is true but no BOS id")
        self.chat_template: str = field(reader, "tokenizer.chat_template", "") or ""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id,
                 "unk_token": token_id("tokenizer.ggml.unknown_token_id"),
                 "pad_token": token_id("tokenizer.ggml.padding_token_id")}
        specials = {k: tokens[v] for k, v in names.items() if v is not None and v >= 0}
        self._template = ChatTemplate(self.chat_template, specials) if self.chat_template else None

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (special tokens in the text become their ids).

        Args:
          text: any str.
          add_bos: prepend BOS if the file says to (``tokenizer.ggml.add_bos_token``).
          add_eos: append ``eos_id``.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``add_eos`` with no EOS defined.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}: {text!r:.80}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self._add_bos:
            ids = [self.bos_id, *ids]
        if add_eos:
            if self.eos_id < 0:
                raise ValueError(f"{self.source}: add_eos=True but the file names no EOS")
            ids = [*ids, self.eos_id]
        return list(ids)

    def apply_chat_template(self, messages: Sequence[Mapping], *, tokenize: bool = False,
                            add_generation_prompt: bool = True):
        """``messages`` rendered with the file's chat template (Hugging Face's signature).

        Returns:
          The prompt text, or its token ids with ``tokenize=True`` (no BOS added: the
          template writes what the model expects).

        Raises:
          ValueError: the file has no chat template, or the template refuses the messages.
        """
        if self._template is None:
            raise ValueError(f"{self.source}: the file has no tokenizer.chat_template")
        text = self._template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_bos=False) if tokenize else text
