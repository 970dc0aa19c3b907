"""Chat messages as a prompt: one rendering for the library (a conversation given to
``Engine.generate`` / ``add_request``) and the server's chat endpoint.

A conversation is a non-empty list of message dicts ``{"role", "content"}``. It is rendered with
the tokenizer's chat template when it has one (``tokenizer.apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)`` with a non-empty ``tokenizer.chat_template``, as
Hugging Face renders it), otherwise with a plain template (one ``"<|{role}|>\\n{content}\\n"``
block per message, then ``"<|assistant|>\\n"``); the text is then encoded as any text prompt is
(``tokenizer.encode(text)``). Pure Python: the tokenizer is duck-typed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The chat roles OpenAI and vLLM accept; any other is refused (the server: a 400).
ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def is_conversation(prompt) -> bool:
    """Whether ``prompt`` is a conversation: a non-empty list/tuple of dicts."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, Mapping) for m in prompt))


def check_messages(messages: Sequence[Mapping]) -> list[dict]:
    """The messages as plain dicts, or TypeError / ValueError naming ``messages[i]``."""
    if not is_conversation(messages):
        raise TypeError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} must be one of {ROLES}")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}].content must be a str, got "
                            f"{type(content).__name__}")
        out.append({**m, "role": role, "content": content})
    return out


def chat_text(tokenizer, messages: Sequence[Mapping]) -> str:
    """The prompt text of ``messages`` (see the module docstring).

    Raises:
      TypeError / ValueError: a malformed message, or the template refuses the conversation.
    """
    msgs = check_messages(messages)
    template = getattr(tokenizer, "apply_chat_template", None)
    if callable(template) and getattr(tokenizer, "chat_template", None):
        return template(msgs, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"


def chat_ids(tokenizer, messages: Sequence[Mapping]) -> list[int]:
    """The prompt token ids of ``messages``: `chat_text` encoded as a text prompt is."""
    return list(tokenizer.encode(chat_text(tokenizer, messages)))
