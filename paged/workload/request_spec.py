"""One request of a workload (`RequestSpec`) and its JSONL form.

A trace file (JSONL) is an optional header ``{"workload": {"name", "evidence", "seed", "meta"}}``,
then one object per request: ``arrival_s``, ``output_len``, one of ``prompt`` (text; length =
UTF-8 bytes + BOS) / ``prompt_token_ids`` / ``prompt_len``; optional ``request_id``, ``n``,
``shared_prefix_len`` (``REQUEST_KEYS``). Unknown keys are errors. `paged.workload.workload.Workload`
reads and writes whole files with the parsers here; every error names the file and line.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
from typing import Any

from paged.util import validate
from paged.workload.evidence import check_evidence

BOS_ID = 256  # ByteTokenizer.bos_id; not imported so this module stays free of JAX.

REQUEST_KEYS = frozenset({"request_id", "arrival_s", "prompt", "prompt_token_ids", "prompt_len",
                           "output_len", "n", "shared_prefix_len"})

@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
      request_id: unique within the workload.
      arrival_s: arrival time in seconds from the start of the run.
      prompt_token_ids: the prompt as token ids, or None.
      prompt: the prompt as text, or None (at most one of the two is set; neither for a
        length-only trace, see `Workload.with_synthetic_prompts`).
      prompt_len: prompt tokens, BOS included.
      output_len: tokens to generate (``max_tokens`` with EOS ignored).
      n: parallel samples of this prompt.
      shared_prefix_len: leading prompt tokens identical across the workload by construction.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...] | None
    prompt: str | None
    prompt_len: int
    output_len: int
    n: int = 1
    shared_prefix_len: int = 0

    def __post_init__(self):
        validate.string("request_id", self.request_id)
        object.__setattr__(self, "arrival_s", validate.real("arrival_s", self.arrival_s, minimum=0))
        validate.integer("prompt_len", self.prompt_len, minimum=1)
        validate.integer("output_len", self.output_len, minimum=1)
        validate.integer("n", self.n, minimum=1)
        validate.integer("shared_prefix_len", self.shared_prefix_len, minimum=0)
        if self.shared_prefix_len > self.prompt_len:
            raise ValueError(f"shared_prefix_len={self.shared_prefix_len} > "
                             f"prompt_len={self.prompt_len}")
        if self.prompt is not None and self.prompt_token_ids is not None:
            raise ValueError(f"request {self.request_id!r}: both prompt and prompt_token_ids")
        if self.prompt is not None:
            self._check_text()
        if self.prompt_token_ids is not None:
            self._check_ids()

    def _check_text(self):
        if not isinstance(self.prompt, str) or not self.prompt:
            raise TypeError(f"prompt={self.prompt!r:.80} must be a non-empty str")
        if byte_token_len(self.prompt) != self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: prompt_len={self.prompt_len} but the "
                             f"prompt is {byte_token_len(self.prompt)} byte tokens (BOS included)")

    def _check_ids(self):
        ids = tuple(validate.token_ids("prompt_token_ids", self.prompt_token_ids))
        if len(ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: prompt_len={self.prompt_len} but "
                             f"{len(ids)} prompt_token_ids")
        object.__setattr__(self, "prompt_token_ids", ids)

    def engine_prompt(self) -> str | list[int]:
        """The prompt as `Engine.add_request` takes it (text, or a list of token ids).

        Raises:
          ValueError: the request only has a length (call `Workload.with_synthetic_prompts`).
        """
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.prompt is not None:
            return self.prompt
        raise ValueError(f"request {self.request_id!r} has only prompt_len={self.prompt_len}; "
                         "call Workload.with_synthetic_prompts(seed) first")

    def to_json(self) -> dict[str, Any]:
        """The request as one JSONL object (None fields left out)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out


def byte_token_len(text: str) -> int:
    """Tokens of ``text`` under the bundled byte tokenizer: UTF-8 bytes plus BOS."""
    return len(text.encode("utf-8")) + 1


def at_arrival(r: RequestSpec, arrival_s: float) -> RequestSpec:
    """``r`` arriving at ``arrival_s`` (checked); its other fields were checked when it was made."""
    new = copy.copy(r)
    object.__setattr__(new, "arrival_s", validate.real("arrival_s", arrival_s, minimum=0))
    return new


def with_lengths(r: RequestSpec, prompt_len: int, output_len: int) -> RequestSpec:
    """``r`` with new lengths; prompt ids (or text as ids) cut or padded only when shorter."""
    ids = r.prompt_token_ids
    if r.prompt is not None and prompt_len != r.prompt_len:
        raise ValueError(f"request {r.request_id!r} has text; its length cannot change")
    if ids is not None and prompt_len != len(ids):
        if prompt_len > len(ids):
            raise ValueError(f"request {r.request_id!r}: prompt ids cannot grow; derive lengths "
                             "before with_synthetic_prompts")
        ids = ids[:prompt_len]
    return dataclasses.replace(r, prompt_len=prompt_len, output_len=output_len,
                               prompt_token_ids=ids,
                               shared_prefix_len=min(r.shared_prefix_len, prompt_len))


def parse_json_line(line: str, line_no: int, path: pathlib.Path) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_header(obj: dict, line_no: int, path: pathlib.Path) -> dict:
    h = obj["workload"]
    if len(obj) != 1 or not isinstance(h, dict) or set(h) - {"name", "evidence", "seed", "meta"}:
        raise ValueError(f"{path}:{line_no}: bad header {obj!r:.200}")
    try:
        check_evidence(h.get("evidence"))
    except ValueError as e:
        raise ValueError(f"{path}:{line_no}: {e}") from None
    return {"name": h.get("name"), "evidence": h["evidence"], "seed": h.get("seed"),
            "meta": h.get("meta") or {}}


def parse_request(obj: dict, line_no: int, path: pathlib.Path, *, default_id: str) -> RequestSpec:
    where = f"{path}:{line_no}"
    unknown = set(obj) - REQUEST_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(REQUEST_KEYS)}")
    for key in ("arrival_s", "output_len"):
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    prompt_len = obj.get("prompt_len")
    if prompt_len is None:
        if prompt is None and ids is None:
            raise ValueError(f"{where}: need one of 'prompt', 'prompt_token_ids', 'prompt_len'")
        # A wrong type gets a placeholder length so RequestSpec names the type error instead.
        prompt_len = byte_token_len(prompt) if isinstance(prompt, str) else (
            len(ids) if isinstance(ids, list) else 1)
    try:
        return RequestSpec(request_id=obj.get("request_id", default_id),
                           arrival_s=obj["arrival_s"], prompt_token_ids=ids, prompt=prompt,
                           prompt_len=prompt_len, output_len=obj["output_len"],
                           n=obj.get("n", 1), shared_prefix_len=obj.get("shared_prefix_len", 0))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
