"""Request models and response shapes of the OpenAI API (completions and chat completions).

Requests are parsed from the raw body with pydantic in strict mode (``model_validate_json``): an
integer field refuses ``2.0`` and ``true``, a boolean refuses ``"yes"``, unknown fields are
ignored as OpenAI ignores them. Value checks (ranges, lengths, vocabulary) are `ApiError`s raised
by `sampling_params` and the prompt checks in `paged.server.app`, before anything reaches the
engine. Responses are plain dicts built here (cheaper than models on the streaming path), shaped
as OpenAI's:

- completion: ``{"id": "cmpl-...", "object": "text_completion", "created", "model", "choices":
  [{"index", "text", "logprobs": null, "finish_reason", "stop_reason"}], "usage"}``; a stream
  chunk has the same object name and ``"usage": null``. ``stop_reason`` is vLLM's: the stop
  string or stop token id that ended the choice, else null. With vLLM's ``prompt_logprobs: k``
  a choice also has ``"prompt_logprobs"``: null for the first prompt token, then per position
  ``{"<token id>": {"logprob", "decoded_token"}}`` for the prompt's token and the k most likely
  (chat: one such list at the response's top level).
- chat: ``"chatcmpl-..."``, ``"chat.completion"`` with ``choices[].message`` ``{"role":
  "assistant", "content"}``; chunks ``"chat.completion.chunk"`` with ``choices[].delta`` (the
  first delta of each choice carries ``"role": "assistant"``).
- with ``stream_options.include_usage`` a last chunk with ``"choices": []`` and the usage; every
  stream ends with ``data: [DONE]``.
- errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400
  (``invalid_request_error``), 404 (``model_not_found``), 503 (server busy), 504 (timeout).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

from paged.request import chat
from paged.request.sampling import SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape (`error_body`) with an HTTP status."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code)

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras ``top_k``, ``ignore_eos``,
    ``stop_token_ids``, ``include_stop_str_in_output``)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # Prefix-cache retention (read by the ``priority`` eviction policy): SamplingParams' fields.
    cache_priority: int | None = None
    cache_retention_s: float | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# The chat roles OpenAI and vLLM accept; any other is a 400.
ROLES = chat.ROLES


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    """``model`` from a raw JSON body; ApiError 400 for malformed JSON or a field of the wrong
    type (the message and ``param`` name the first offending field)."""
    if not body.strip():
        raise ApiError("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] in ("json_invalid", "json_type", "model_type", "model_attributes_type"):
            raise ApiError(f"malformed JSON body: {err['msg']}") from None
        # A union reports each alternative; the field is the leading string part of ``loc``.
        loc = [p for p in err["loc"] if isinstance(p, (str, int))]
        field = next((p for p in loc if isinstance(p, str)), None)
        where = ".".join(str(p) for p in loc if not (isinstance(p, str) and (
            p[:1].isupper() or "[" in p)))
        raise ApiError(f"{where or field}: {err['msg']} (got {err.get('input')!r:.80})",
                       param=field) from None


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(f"{param}: {what} is not supported by this server yet", param=param,
                    code="unsupported_parameter")


def sampling_params(req: _Common, max_tokens: int | None, *, logprobs: Any,
                    stop: tuple[str, ...] = (), prompt_logprobs: int | None = None
                    ) -> SamplingParams:
    """The engine's SamplingParams for ``req`` (checked here so the engine never refuses them).

    Raises:
      ApiError: a value out of range (names the parameter), or a parameter this server does not
        implement (penalties, ``logit_bias``; ``logprobs`` when the engine's SamplingParams has
        no such field). ``logprobs``: None, or k top log-probabilities per token.
    """
    if logprobs is not None and "logprobs" not in getattr(SamplingParams,
                                                          "__dataclass_fields__", {}):
        raise _unsupported("logprobs", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _unsupported(name, f"{name} != 0")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    checks = (
        ("max_tokens", max_tokens, max_tokens is None or max_tokens >= 1, "must be >= 1"),
        ("temperature", temperature, 0 <= temperature <= 2 ** 100, "must be >= 0"),
        ("top_p", top_p, 0 < top_p <= 1, "must be in (0, 1]"),
        ("top_k", req.top_k, top_k >= 0, "must be >= 0 (-1 or 0: disabled)"),
        ("n", req.n, req.n >= 1, "must be >= 1"),
        ("seed", req.seed, req.seed is None or 0 <= req.seed < 2 ** 31,
         "must be in [0, 2**31)"),
    )
    for name, value, ok, what in checks:
        if not ok:
            raise ApiError(f"{name}={value!r} {what}", param=name)
    kwargs = dict(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                  top_p=float(top_p), seed=req.seed, n=req.n,
                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                  stop=stop, include_stop_str_in_output=req.include_stop_str_in_output)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if req.cache_priority is not None or req.cache_retention_s is not None:
        kwargs.update(cache_priority=req.cache_priority, cache_retention_s=req.cache_retention_s)
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        param = str(e).split("=", 1)[0] if "=" in str(e) else None
        raise ApiError(str(e), param=param) from None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(f"stop={stop!r} must be at most 4 non-empty strings", param="stop")
    return stops


# --- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shapes:
    """Builds one response's JSON objects (id, ``created`` and model fixed per response)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str):
        self.kind, self.model = kind, model
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self._prefix: str | None = None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[tuple], use: dict, prompt_logprobs=None) -> dict:
        """The whole (non-streaming) response; ``choices``: (index, text, finish_reason,
        logprobs object or None, stop_reason, the completion choice's ``prompt_logprobs`` or
        None); ``prompt_logprobs``: chat's, or None (then absent)."""
        if self.kind == "completion":
            out = []
            for i, t, f, lp, why, plp in choices:
                out.append({"index": i, "text": t, "logprobs": lp, "finish_reason": f,
                            "stop_reason": why})
                if plp is not None:
                    out[-1]["prompt_logprobs"] = plp
            return {**self._head("text_completion"), "choices": out, "usage": use,
                    "system_fingerprint": None}
        out = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                "finish_reason": f, "stop_reason": why} for i, t, f, lp, why, _ in choices]
        extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
        return {**self._head("chat.completion"), "choices": out, "usage": use,
                "system_fingerprint": None, **extra}

    def chunk(self, index: int, text: str, finish_reason: str | None, *,
              first: bool = False, logprobs: dict | None = None,
              stop_reason: str | int | None = None) -> str:
        """One SSE event with one choice's delta (and its tokens' logprobs object, if asked).

        The common case (a completion's text delta, no logprobs) is formatted from a prefix
        serialized once per response: the same JSON as the general path, at a fraction of the
        cost on the streaming hot path.
        """
        if self.kind == "completion":
            if logprobs is None:
                prefix = self._prefix
                if prefix is None:
                    head = json.dumps(self._head("text_completion"), separators=(",", ":"),
                                      ensure_ascii=False)
                    prefix = self._prefix = "data: " + head[:-1] + ',"choices":[{"index":'
                fin = "null" if finish_reason is None else f'"{finish_reason}"'
                why = "null" if stop_reason is None else json.dumps(stop_reason,
                                                                    ensure_ascii=False)
                return (f"{prefix}{index},\"text\":{json.dumps(text, ensure_ascii=False)},"
                        f'"logprobs":null,"finish_reason":{fin},"stop_reason":{why}}}],'
                        f'"usage":null}}\n\n')
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            obj = "text_completion"
        else:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or finish_reason is None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            obj = "chat.completion.chunk"
        return sse({**self._head(obj), "choices": [choice], "usage": None})

    def usage_chunk(self, use: dict) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({**self._head(obj), "choices": [], "usage": use})


def completion_logprobs(ids, lps, decode, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> log-probability: the sampled token and the k most likely)
    and ``text_offset`` (of each token in the choice's text, from ``offset``)."""
    tokens = [decode([t]) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in zip(ids, lps)],
            "top_logprobs": [{decode([k]): v for k, v in lp.items()} for lp in lps],
            "text_offset": offsets}


def prompt_logprobs(plps, decode) -> list | None:
    """vLLM's ``prompt_logprobs`` list from the engine's (`RequestOutput.prompt_logprobs`):
    None at position 0, then ``{"<token id>": {"logprob", "decoded_token"}}`` per position."""
    if plps is None:
        return None
    return [None if lp is None else {str(t): {"logprob": v, "decoded_token": decode([t])}
                                     for t, v in lp.items()} for lp in plps]


def echo_logprobs(prompt_ids, plps, decode, generated: dict | None) -> dict:
    """OpenAI's ``echo`` with ``logprobs``: the prompt's tokens scored first (the first one's
    ``token_logprobs`` and ``top_logprobs`` null, as it has no context), then ``generated`` (the
    choice's `completion_logprobs`, its offsets from the end of the prompt's text)."""
    plps = list(plps) if plps is not None else [None] * len(prompt_ids)
    head = completion_logprobs(prompt_ids, [lp or {} for lp in plps], decode)
    for i, lp in enumerate(plps):
        if lp is None:
            head["token_logprobs"][i] = head["top_logprobs"][i] = None
    if generated:
        end = sum(len(t) for t in head["tokens"])
        generated = {**generated, "text_offset": [o + end for o in generated["text_offset"]]}
        for key in head:
            head[key] = head[key] + generated[key]
    return head


def chat_logprobs(ids, lps, decode, k: int) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [the k most likely, same fields]}]}``."""
    def entry(t, v):
        s = decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp in zip(ids, lps):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        content.append({**entry(t, lp.get(t)), "top_logprobs": [entry(a, v) for a, v in top]})
    return {"content": content}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
