"""Chat templates (Jinja2 strings from a checkpoint's metadata) rendered as Hugging Face does.

transformers renders ``tokenizer.chat_template`` in a sandboxed Jinja2 environment
(``ImmutableSandboxedEnvironment``, ``trim_blocks`` and ``lstrip_blocks`` on) with the messages,
``add_generation_prompt``, the special tokens' text (``bos_token``, ``eos_token``, ...) and a
``raise_exception(message)`` helper the templates call to refuse a conversation. `ChatTemplate`
does the same; a template's own error becomes a ValueError.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence


def _raise_exception(message):
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"chat template does not parse: {e}") from None


class ChatTemplate:
    """A Jinja2 chat template with the special tokens' text it is rendered with.

    Args:
      source: the template text.
      special_tokens: e.g. ``{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}``.

    Raises:
      ValueError: ``source`` is not a non-empty str or does not parse.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str) or not source:
            raise ValueError(f"chat template must be a non-empty str, got {source!r:.60}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
               **extra) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content``).

        Raises:
          TypeError: ``messages`` is not a list of dicts.
          ValueError: the template refuses the conversation (``raise_exception``) or fails.
        """
        from jinja2.exceptions import TemplateError

        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping)
                                                         for m in messages):
            raise TypeError(f"messages must be a list of dicts, got {messages!r:.80}")
        context = {**self.special_tokens, **extra}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **context)
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None
