"""SmolLM2's tokenizer and chat template read from its GGUF metadata: round trips, special
tokens, streaming detokenization, and the template against renders written out by hand."""

from __future__ import annotations

import pytest

from paged.models.chat_template import ChatTemplate
from paged.models.gguf import packaged_path
from paged.models.gguf_tokenizer import GGUFTokenizer
from paged.models.hf_tokenizer import IncrementalDecoder

try:
    packaged_path("smollm2-135m")
except ValueError as e:  # pragma: no cover -- `make install` installs it
    pytest.skip(str(e), allow_module_level=True)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok():
    return GGUFTokenizer("smollm2-135m")


def test_special_ids_and_interface(tok):
    assert (tok.bos_id, tok.eos_ids, tok.eos_id, tok.vocab_size) == (1, (2,), 2, 49152)
    assert tok.special_ids == frozenset({1, 2})


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and \u200b zero-width",
    "def f(x):\n\tif x  >= 10:\n\t\treturn {'a': [1, 2, 3]}  # comment\n    pass\r\n",
    "   leading, trailing   \n\n\n  \t\t  \u00a0 ",
    "",
])
def test_round_trips(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_digits_split_one_by_one(tok):
    """tokenizer.ggml.pre = "smollm": every digit is its own pre-token (as in SmolLM2's
    tokenizer.json: Digits(individual_digits=True) before the byte-level split)."""
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")
    assert len(tok.encode("hello hello hello")) == 3  # ordinary words stay whole


def test_control_tokens_are_special(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.encode("Hi", add_bos=True) == tok.encode("Hi")
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.encode("x", add_eos=True)[-1] == 2


def test_incremental_decoder_streams_the_same_text(tok):
    text = "Grüße 🙂 aus Köln: 日本語 — ok."
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    dec = IncrementalDecoder(tok, prompt)
    pieces = [dec.step([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_bad_ids_refused(tok):
    with pytest.raises(ValueError, match="outside"):
        tok.decode([49152])
    with pytest.raises(TypeError):
        tok.decode("abc")
    with pytest.raises(TypeError):
        tok.encode(b"abc")


def test_chat_template_default_system_prompt(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    want = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    assert tok.chat_template and tok.apply_chat_template(msgs, tokenize=True) == tok.encode(want)


def test_chat_template_conversation_without_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want


def test_template_environment_as_transformers():
    """trim_blocks / lstrip_blocks, special tokens in scope, raise_exception, sandboxing."""
    t = ChatTemplate("{% for m in messages %}\n  {{ bos_token }}{{ m['content'] }}\n"
                     "{% endfor %}", {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == \
        "  <s>a\n  <s>b\n"
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                          "{{ raise_exception('first message must be user') }}{% endif %}ok")
    assert strict.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        strict.render([{"role": "assistant", "content": ""}])
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate("{{ messages.append(1) }}").render([])  # immutable sandbox
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")
    with pytest.raises(TypeError):
        t.render("not a list")


def test_server_chat_path_uses_the_files_template(tok):
    """The chat endpoint's prompt (`paged.server.app._Api.chat_prompt`) is the model's ChatML;
    a conversation the template refuses is a 400, not a server error."""
    import types

    from paged.server.app import ApiError, ServerSettings, _Api
    from paged.server.protocol import ChatMessage

    engine = types.SimpleNamespace(
        tokenizer=tok, config=types.SimpleNamespace(max_model_len=512, max_num_seqs=4,
                                                    model="smollm2-135m"),
        model_config=types.SimpleNamespace(vocab_size=tok.vocab_size))
    api = _Api(engine, None, ServerSettings(served_model_name="smollm2-135m"))
    ids = api.chat_prompt([ChatMessage(role="user", content="Hi")])
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    strict = GGUFTokenizer.__new__(GGUFTokenizer)
    strict.__dict__.update(tok.__dict__)
    strict._template = ChatTemplate("{{ raise_exception('no system messages') }}")
    api.tokenizer = strict
    with pytest.raises(ApiError, match="no system messages"):
        api.chat_prompt([ChatMessage(role="system", content="x")])


def test_library_prompts_accept_conversations(tok):
    """``Engine.generate`` / ``add_request`` with messages: the checks render a conversation with
    the file's template (the same text as the server's chat endpoint) and encode it; a list of
    dicts alone is one prompt; bad messages are refused before anything is added."""
    import types

    from paged.request.checks import check_prompts

    table = types.SimpleNamespace(
        tokenizer=tok, vocab_size=tok.vocab_size, num_requests=0, cache_salt=b"",
        has_request=lambda rid: False,
        config=types.SimpleNamespace(max_model_len=512, max_num_seqs=4, request_timeout_s=None))
    msgs = [{"role": "user", "content": "Hi"}]
    want = tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    one = check_prompts(table, msgs, None)
    assert len(one) == 1 and one[0][1] == want
    many = check_prompts(table, [msgs, "Hi", [5, 6]], None)
    assert [m[1] for m in many] == [want, tok.encode("Hi"), [5, 6]]
    with pytest.raises(ValueError, match=r"prompts\[0\].*role='robot'"):
        check_prompts(table, [[{"role": "robot", "content": "x"}]], None)
    with pytest.raises(TypeError, match=r"prompts\[1\].*content must be a str"):
        check_prompts(table, [msgs, [{"role": "user", "content": None}]], None)
