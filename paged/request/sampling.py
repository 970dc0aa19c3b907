"""``SamplingParams``: what a request asks of the sampler (checked at construction; pure Python).

The on-device sampler that honours them is ``paged.engine.sampler``.
"""

from __future__ import annotations

import dataclasses

from paged.request.stop_strings import check_stops
from paged.util import validate

MAX_LOGPROBS = 20  # top log-probabilities per position at most (vLLM's default limit)


OUTPUT_KINDS = ("cumulative", "final_only")  # vLLM RequestOutputKind.CUMULATIVE / FINAL_ONLY


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
      max_tokens: tokens to generate at most (>= 1); ``None``: up to ``max_model_len`` (the
        engine sets it to ``max_model_len - prompt length`` when the request is added, as vLLM).
      temperature: 0 is greedy; > 0 scales the logits (finite, at most float32's largest).
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: nucleus sampling mass in (0, 1]; 1 keeps all.
      seed: the request's seed; ``None`` lets the engine derive one from its own seed and the
        request's arrival order (deterministic for a given engine and request order).
      n: parallel samples of the same prompt; they share the prompt's KV blocks (fork + CoW).
      stop_token_ids: extra tokens that end generation (the stop token is kept in the output).
      stop: strings that end generation (a str or a list of them, vLLM's ``stop``): searched in
        the detokenized output; the text ends before the first match (``finish_reason="stop"``,
        ``stop_reason`` the string), ``token_ids`` keep every token up to the one that completed
        it (``paged.request.stop_strings``).
      include_stop_str_in_output: keep the matched stop string in the text.
      ignore_eos: keep generating past EOS (benchmarks with fixed output lengths).
      logprobs: ``None``, or k in [0, MAX_LOGPROBS]: every generated token comes with a dict
        token id -> log-probability holding the sampled token and the k most likely tokens
        (``CompletionOutput.logprobs``). Log-probabilities are those of the model's distribution
        (log-softmax of its logits), before temperature, top-k and top-p.
      prompt_logprobs: ``None``, or k in [0, MAX_LOGPROBS]: ``RequestOutput.prompt_logprobs``, one
        entry per prompt position: ``None`` at position 0, then a dict holding the actual prompt
        token and the k most likely tokens at that position. Computed in the prefill itself (no
        second forward pass, chunked prefill included); such a request does not take prefix-cache
        hits (a hit would skip the positions whose log-probabilities it asks for).
      output_kind: vLLM's ``RequestOutputKind``, by name: ``"cumulative"`` (default) reports the
        request after every step that gives it tokens; ``"final_only"`` only once, when it
        finishes (what offline ``generate`` needs: the engine then builds no per-step output for
        it; ``Engine.generate`` uses it). The same tokens either way. vLLM's ``"delta"`` is not a
        kind here: a streaming consumer takes deltas from cumulative outputs with
        ``paged.request.outputs.OutputDeltas``.
      cache_priority: ``None``, or 0..100: the prefix-cache priority of this request's blocks
        once released (higher stays longer; TensorRT-LLM's retention priority, default 35); read
        by the ``priority`` eviction policy (``EngineConfig.prefix_eviction``), ignored by others.
      cache_retention_s: with ``cache_priority``: seconds after the request ends that its blocks
        keep that priority (then the policy's default); ``None``: as long as they stay cached.

    Every field is checked at construction: integers must be integers (not ``bool`` or ``2.0``),
    floats finite and representable in float32 (they are sampled from in float32), ``ignore_eos``
    a ``bool``; TypeError for a wrong type, ValueError for a value out of range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    cache_priority: int | None = None
    cache_retention_s: float | None = None

    def __post_init__(self):
        validate.integer("max_tokens", self.max_tokens, minimum=1, allow_none=True)
        validate.real("temperature", self.temperature, minimum=0)
        validate.integer("top_k", self.top_k, minimum=0)  # 0 disables it
        validate.real("top_p", self.top_p, minimum=0, exclusive=True, maximum=1)
        validate.integer("seed", self.seed, minimum=0, maximum=2**31 - 1, allow_none=True)
        validate.integer("n", self.n, minimum=1)
        validate.boolean("ignore_eos", self.ignore_eos)
        validate.integer("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS, allow_none=True)
        validate.integer("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_LOGPROBS,
                         allow_none=True)
        stops = validate.token_ids("stop_token_ids", self.stop_token_ids, allow_empty=True)
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        object.__setattr__(self, "stop", check_stops(self.stop))
        validate.boolean("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.output_kind == "delta":
            raise ValueError("output_kind='delta' is not a kind here: take deltas from cumulative "
                             "outputs with paged.request.outputs.OutputDeltas")
        validate.one_of("output_kind", self.output_kind, OUTPUT_KINDS)
        validate.integer("cache_priority", self.cache_priority, minimum=0, maximum=100,
                         allow_none=True)
        validate.real("cache_retention_s", self.cache_retention_s, minimum=0, exclusive=True,
                      allow_none=True)
        if self.cache_retention_s is not None and self.cache_priority is None:
            raise ValueError(f"cache_retention_s={self.cache_retention_s} needs cache_priority")
