"""The inputs of `experiments/quality.py`: a real English corpus available offline, its chunks,
and needle-in-a-haystack retrieval prompts built on it.

Corpus: the help topics of the Python documentation that CPython ships in its standard library
(``pydoc_data.topics``, the text ``help("assert")`` prints; English prose with code examples;
Python Software Foundation License 2.0). Topics are joined in sorted order, so the text and its
chunks are the same on every machine with the same Python version (recorded with the result).

Retrieval: a key-value needle ("The secret code of {name} is {number}.") inserted at a depth of
a haystack of corpus text, then the question, all in one user message rendered with the model's
chat template; a run is correct when the answer contains the number (exact match of the value).
The haystack is real text, the needle and question are constructed: the retrieval results are
``evidence: constructed``, the perplexity and fidelity results ``evidence: real``.
"""

from __future__ import annotations

import dataclasses
import platform

import numpy as np

CORPUS = {
    "name": "pydoc_data.topics (Python documentation help topics, CPython standard library)",
    "licence": "Python Software Foundation License Version 2",
}
NAMES = ("Orion", "Vega", "Lyra", "Draco", "Cygnus", "Aquila", "Perseus", "Carina")
QUESTION = "What is the secret code of {name}? Answer with the number only."


def corpus_text() -> str:
    """The corpus (see the module docstring)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def corpus_info(text: str, num_tokens: int) -> dict:
    return {**CORPUS, "python_version": platform.python_version(), "chars": len(text),
            "tokens": num_tokens}


def chunks(ids: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` consecutive non-overlapping chunks of ``length`` tokens from the start.

    Raises:
      ValueError: the corpus is too short.
    """
    if length * count > len(ids):
        raise ValueError(f"{count} chunks of {length} tokens need {length * count} tokens; the "
                         f"corpus has {len(ids)}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


@dataclasses.dataclass(frozen=True)
class Needle:
    """One retrieval prompt: its token ids and the value the answer must contain."""

    length: int  # target prompt length (tokens)
    depth: float  # fraction of the haystack before the needle
    answer: str
    prompt_ids: list[int]
    name: str = ""  # whose secret code the question asks for


def needles(tokenizer, corpus_ids: list[int], length: int, depth: float, count: int,
            seed: int) -> list[Needle]:
    """``count`` retrieval prompts of about ``length`` tokens with the needle at ``depth``.

    The haystack is corpus text (different offsets per needle), cut at token boundaries and
    decoded; the needle sentence goes between two paragraphs nearest the depth.
    """
    rng = np.random.default_rng([seed, length, int(depth * 1000)])
    out = []
    overhead = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION.format(name="Orion")}], tokenize=True)) + 24
    hay_tokens = max(length - overhead, 64)
    for i in range(count):
        name = NAMES[(i + int(depth * 10)) % len(NAMES)]
        number = str(int(rng.integers(100000, 1000000)))
        start = int(rng.integers(0, len(corpus_ids) - hay_tokens))
        hay = tokenizer.decode(corpus_ids[start:start + hay_tokens])
        cut = int(len(hay) * depth)
        nl = hay.rfind("\n", 0, cut)
        cut = nl + 1 if nl > cut - 400 else cut
        needle = f"\nThe secret code of {name} is {number}.\n"
        content = hay[:cut] + needle + hay[cut:] + "\n\n" + QUESTION.format(name=name)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True)
        out.append(Needle(length=length, depth=depth, answer=number, prompt_ids=ids, name=name))
    return out
