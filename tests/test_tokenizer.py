"""ByteTokenizer: UTF-8 round trip, specials, bad input."""

import numpy as np
import pytest

from paged.models import ByteTokenizer

TOK = ByteTokenizer()


@pytest.mark.parametrize(
    "text", ["", "def f(x):\n    return x\n", "héllo wörld", "日本語 🚀", "\x00\t"]
)
def test_round_trip(text):
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert TOK.decode(ids) == text


def test_hand_case_and_specials():
    assert TOK.vocab_size == 258 and (TOK.bos_id, TOK.eos_id) == (256, 257)
    assert TOK.encode("é", add_bos=False) == [0xC3, 0xA9]
    assert TOK.encode("a", add_bos=False, add_eos=True) == [97, 257]
    assert TOK.decode([256, 104, 105, 257, 33]) == "hi!"
    assert TOK.decode(np.array([104, 105], np.int32)) == "hi"


def test_invalid_utf8_is_replaced():
    assert TOK.decode([0xC3]) == "\ufffd"
    assert TOK.decode([104, 0xFF, 105]) == "h\ufffdi"


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: TOK.encode(b"bytes"), TypeError, "bytes"),
        (lambda: TOK.encode(None), TypeError, "NoneType"),
        (lambda: TOK.encode("\ud800"), ValueError, "UTF-8"),
        (lambda: TOK.decode([258]), ValueError, "258"),
        (lambda: TOK.decode([-1]), ValueError, "-1"),
        (lambda: TOK.decode([1.5]), TypeError, "1.5"),
        (lambda: TOK.decode("abc"), TypeError, "str"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
