"""One request's host state: ``SamplingParams``, stop strings, ``Sequence`` (tokens, status,
counters), ``RequestOutput`` / ``CompletionOutput``, and the checks a request passes before it is
admitted (``checks``). Pure Python; no JAX."""
