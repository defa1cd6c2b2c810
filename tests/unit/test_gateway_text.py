"""Stop strings and incremental detokenization for the gateway's streams (nesa_node/gateway/text.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nesa_node.gateway.text import TextStream

PIECES = ["a", "b", "ab", "c", " ", "ba", "cab", "é", "\n", "xyz"]  # what each token decodes to


def decoder(tokens: list[int]) -> str:
    return "".join(PIECES[token] for token in tokens)


def run(tokens: list[int], stops: list[str]) -> tuple[str, str, bool]:
    """(streamed text, the text decoded whole and cut at the first stop, whether a stop was found)."""
    stream = TextStream(decoder, stops)
    streamed = ""
    for token in tokens:
        streamed += stream.push(token)
        if stream.stopped:
            break
    streamed += stream.finish()
    whole = decoder(tokens)
    found = [whole.find(stop) for stop in stops if stop and stop in whole]
    return streamed, whole[: min(found)] if found else whole, bool(found)


@given(
    st.lists(st.integers(0, len(PIECES) - 1), max_size=40),
    st.lists(st.text(alphabet="abc xé\n", min_size=1, max_size=4), max_size=4),
)
def test_streamed_text_equals_the_whole_text_cut_at_the_first_stop(tokens, stops):
    streamed, expected, found = run(tokens, stops)
    assert streamed == expected
    assert not any(stop in streamed for stop in stops)  # a stop string never leaks, whole or split


@given(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=40), st.data())
def test_a_stop_string_crossing_token_boundaries_ends_the_stream(tokens, data):
    whole = decoder(tokens)
    start = data.draw(st.integers(0, len(whole) - 1))
    stop = whole[start : start + data.draw(st.integers(1, 4))]
    streamed, expected, found = run(tokens, [stop])
    assert found and streamed == expected == whole[: whole.find(stop)]


def test_a_character_split_across_tokens_waits_for_its_end():
    pieces = {0: b"h", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def decode(tokens):
        return b"".join(pieces[token] for token in tokens).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    assert [stream.push(token) for token in (0, 1, 2, 3)] == ["h", "", "é", "!"]
    assert stream.finish() == "" and stream.text == "hé!"


def test_text_held_back_for_a_stop_that_never_completes_comes_at_the_end():
    stream = TextStream(decoder, ["abz"])
    assert stream.push(0) == ""  # "a" may begin "abz"
    assert stream.push(1) == ""  # "ab" too
    assert stream.push(3) == "abc"  # "abc" cannot
    assert stream.push(0) == ""
    assert stream.finish() == "a"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_windowed_decoding_gives_the_whole_decode_with_the_models_own_tokenizer(tiny_models, arch):
    """With the models' own tokenizer (byte-level BPE, special tokens skipped): the pieces of random ids, decoded a
    window at a time, join to the text of the whole output decoded at once."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    generator = random.Random(7)
    for _ in range(20):
        tokens = [generator.randrange(len(tokenizer)) for _ in range(generator.randint(1, 60))]
        stream = TextStream(decode)
        streamed = "".join(stream.push(token) for token in tokens) + stream.finish()
        assert streamed == decode(tokens)


SENTENCEPIECE = ["\u2581Hi", "\u2581there", "<x>", "!", "\u2581", "\u2581a", "b"]  # "<x>": a special token, skipped


def sentencepiece_decode(tokens: list[int]) -> str:
    """As Llama's and Mistral's tokenizers decode: "\u2581" is a space, special tokens give nothing, and the text's
    first space is dropped."""
    text = "".join(SENTENCEPIECE[token] for token in tokens if SENTENCEPIECE[token] != "<x>").replace("\u2581", " ")
    return text.removeprefix(" ")


@given(st.lists(st.integers(0, len(SENTENCEPIECE) - 1), max_size=30))
def test_a_word_after_a_skipped_special_token_keeps_its_space(tokens):
    """A decoder dropping the first space of what it decodes: a window starting at a token that gave no text (a
    special token) would lose the next word's space ("Hithere"); the window stays on the last token that gave text."""
    stream = TextStream(sentencepiece_decode)
    streamed = "".join(stream.push(token) for token in tokens) + stream.finish()
    assert streamed == sentencepiece_decode(tokens)
    stream = TextStream(sentencepiece_decode)
    assert "".join(stream.push(token) for token in (0, 2, 1)) + stream.finish() == "Hi there"


BYTE_TOKENS = [
    b"a",
    b" ",
    "é".encode(),
    b"\xc3",
    b"\xa9",
    b"\xe2\x82",
    b"\xac",
    b"\xf0",
    b"\x9f",
    b"\x98\x80",
    b"\x80",
    b"\xff",
    b"\xad\xe6",  # the end of one character and the start of the next, as byte-level vocabularies have
    b"\x87\xe5",
    b"\xa9\xe2\x82",
]


def bytes_decode(tokens: list[int]) -> str:
    """As a byte-level tokenizer decodes: each token's bytes, joined, with U+FFFD for what is not valid UTF-8."""
    return b"".join(BYTE_TOKENS[token] for token in tokens).decode("utf-8", errors="replace")


@given(st.lists(st.integers(0, len(BYTE_TOKENS) - 1), max_size=40))
def test_tokens_of_parts_of_characters_and_garbage_stream_as_they_decode_whole(tokens):
    stream = TextStream(bytes_decode)
    assert "".join(stream.push(token) for token in tokens) + stream.finish() == bytes_decode(tokens)


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("中文字", [b"\xe4", b"\xb8", b"\xad\xe6", b"\x96", b"\x87\xe5", b"\xad", b"\x97"]),
        ("中文字", [b"\xe4\xb8", b"\xad\xe6", b"\x96", b"\x87\xe5", b"\xad\x97"]),
        ("é€中", [b"\xc3", b"\xa9\xe2", b"\x82", b"\xac\xe4", b"\xb8\xad"]),
    ],
)
def test_tokens_that_end_one_character_and_begin_the_next_stream_whole(text, parts):
    """Byte-level tokens crossing character boundaries, each leaving the text with an incomplete character at its
    end, more of them in a row than garbage may wait: the text still streams as it decodes whole."""
    vocabulary = sorted(set(parts))

    def decode(tokens: list[int]) -> str:
        return b"".join(vocabulary[token] for token in tokens).decode("utf-8", errors="replace")

    tokens = [vocabulary.index(part) for part in parts]
    stream = TextStream(decode)
    assert "".join(stream.push(token) for token in tokens) + stream.finish() == text == decode(tokens)


def counting(decode):
    """`decode`, and a list whose one item counts the tokens it was given in all."""
    decoded = [0]

    def counted(tokens: list[int]) -> str:
        decoded[0] += len(tokens)
        return decode(tokens)

    return counted, decoded


def test_a_run_of_tokens_that_never_decode_costs_the_same_per_token():
    """Tokens that never make valid UTF-8 (a lone continuation byte each) are released as they decode, not decoded
    again with every new one; a character split over tokens after them still comes out whole."""
    decode, decoded = counting(bytes_decode)
    stream = TextStream(decode)
    garbage = [BYTE_TOKENS.index(b"\x80")] * 2000
    emoji = [BYTE_TOKENS.index(part) for part in (b"\xf0", b"\x9f", b"\x98\x80")]
    streamed = "".join(stream.push(token) for token in garbage + emoji) + stream.finish()
    assert streamed == "\ufffd" * 2000 + "\U0001f600"
    assert decoded[0] <= 40 * len(garbage)  # a bounded window per token; the pending run each time: ~2000 each


def test_special_tokens_that_give_no_text_are_not_decoded_again_and_again():
    decode, decoded = counting(sentencepiece_decode)
    stream = TextStream(decode)
    tokens = [0] + [2] * 2000 + [1]  # "▁Hi", 2000 special tokens (skipped), "▁there"
    assert "".join(stream.push(token) for token in tokens) + stream.finish() == "Hi there"
    assert decoded[0] <= 40 * len(tokens)


def test_a_stop_string_before_a_character_split_across_tokens_ends_the_stream_at_once():
    """Stop "ab", then a token that completes it and begins a character ("b" + the first byte of "ä"): the stop is
    whole although the text waits for that character's end, so the stream stops there, not up to MAX_WAITING tokens
    later (a generation that would run on past its stop, its answer counted as cut by length)."""
    vocabulary = [b"a", b"b\xc3", b"\xa4", b"c"]

    def decode(tokens: list[int]) -> str:
        return b"".join(vocabulary[token] for token in tokens).decode("utf-8", errors="replace")

    stream = TextStream(decode, ["ab"])
    assert stream.push(0) == ""  # "a": the start of the stop
    assert stream.push(1) == "" and stream.stopped  # "ab" then half of "ä": stopped now
    assert stream.finish() == "" and stream.text == ""
    for token in (2, 3):  # nothing after a stop
        assert stream.push(token) == ""
