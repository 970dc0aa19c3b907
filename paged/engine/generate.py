"""``generate``: prompts in, finished outputs out, on any engine of the shared protocol; and
``load_model``: the model, weights and tokenizer an engine serves."""

from __future__ import annotations

import dataclasses

from paged.models.tokenizer import ByteTokenizer
from paged.request.checks import check_prompts
from paged.util.progress_bar import progress as progress_bar


def generate(engine, table, prompts, params, *, progress: bool = False) -> list:
    """Runs ``prompts`` to completion on ``engine``; returns their outputs in prompt order.

    All or nothing: every prompt and params is checked against ``table`` (what
    ``request_checks.check_request`` reads) before the first is added through
    ``engine.add_checked``, so one bad prompt raises with the engine unchanged. When the prompts
    are done and no other request is unfinished, a step still in flight (dispatched before the last
    stop was read back; its results are dropped) is read back too, so the engine is left with no
    step in flight and no block quarantined. The requests ask for their final output only
    (``SamplingParams.output_kind="final_only"``): the steps make no output for them until they
    finish.
    """
    # Only finished outputs are read here, so none is made per step (the same tokens).
    checked = [(rid, ids, dataclasses.replace(p, output_kind="final_only"), *rest)
               for rid, ids, p, *rest in check_prompts(table, prompts, params)]
    ids = [request[0] for request in checked]
    for request in checked:
        engine.add_checked(request)
    done: dict = {}
    with progress_bar(len(ids), progress) as update:
        while len(done) < len(ids):
            finished = [out for out in engine.step() if out.finished]
            done.update((out.request_id, out) for out in finished)
            update(len(finished))
    while engine.has_step_in_flight() and not engine.unfinished_request_ids():
        engine.step()
    return [done[r] for r in ids]


def load_model(config, model_config=None, params=None) -> tuple:
    """``(model_config, params, tokenizer)`` an engine serves: the given model (a checkpoint
    directory's or a GGUF file's tokenizer still applies), else ``config.model`` loaded (a
    bundled name, a Hugging Face checkpoint directory or a GGUF file)."""
    if model_config is None:
        from paged.models.registry import load_any

        return load_any(config.model, dtype=config.dtype, max_model_len=config.max_model_len)
    from paged.models.gguf import is_gguf_path
    from paged.models.hf import is_checkpoint_dir
    from paged.models.hf_tokenizer import load_tokenizer

    tokenizer = ByteTokenizer()
    if is_checkpoint_dir(config.model):
        tokenizer = load_tokenizer(config.model, model_config.vocab_size)
    elif is_gguf_path(config.model):
        from paged.models.gguf_tokenizer import GGUFTokenizer

        tokenizer = GGUFTokenizer(config.model)
    return model_config, params, tokenizer
