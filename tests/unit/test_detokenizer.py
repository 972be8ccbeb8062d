"""Incremental detokenisation with the embedded SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tokenmill.core.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

UNICODE_TEXT = "Hello world 😀 中文 café 🇫🇷 𝔘 ok, ünïcödé 👨‍👩‍👧!"


def token_strings(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.backend.id_to_token(i) for i in ids]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "Say hi"}])


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], step: int = 1) -> list[str]:
    return [detok.add_tokens(list(ids[i:i + step])) for i in range(0, len(ids), step)]


def test_split_characters_wait_for_their_last_byte(tok, chat_prompt) -> None:
    ids = tok.encode(UNICODE_TEXT)
    # The emoji's four bytes are spread over two tokens: the first completes nothing.
    emoji_at = token_strings(tok, ids).index("ĠðŁĺ")
    assert tok.decode(ids[emoji_at:emoji_at + 2]) == " 😀"
    deltas = stream(IncrementalDetokenizer(tok, chat_prompt), ids)
    assert deltas[emoji_at] == "" and deltas[emoji_at + 1] == " 😀"
    assert "".join(deltas) == UNICODE_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert sum(d == "" for d in deltas) >= 5  # several tokens completed no character


@pytest.mark.parametrize("step", [2, 3, 7])
def test_several_tokens_per_step_give_the_same_text(tok, chat_prompt, step) -> None:
    ids = tok.encode(UNICODE_TEXT)
    detok = IncrementalDetokenizer(tok, chat_prompt)
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == detok.output_text == UNICODE_TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_first_token_keeps_its_leading_space(tok) -> None:
    prompt = tok.encode("Say")
    assert IncrementalDetokenizer(tok, prompt).add_tokens(tok.encode(" hello")) == " hello"
    assert IncrementalDetokenizer(tok, []).add_tokens(tok.encode(" hello")) == " hello"


def test_special_tokens_skipped_or_kept(tok, chat_prompt) -> None:
    ids = tok.encode("Hi there") + [2]  # <|im_end|>
    skipped = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(skipped, ids) == ["Hi", " there", ""]
    kept = IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "Hi there<|im_end|>"


def test_incomplete_bytes_at_the_end_are_dropped(tok) -> None:
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, ids[:-1])) + detok.flush() == "ok"
    assert detok.output_text == "ok"


def test_invalid_bytes_show_once_later_text_proves_them_invalid(tok) -> None:
    lone_continuation_byte = tok.encode(" 😀")[-1]  # "Ģ": byte 0x80-0xBF on its own
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens([lone_continuation_byte]) == ""
    assert detok.add_tokens(tok.encode(" ok")) == "\ufffd ok"


def test_stop_string_spanning_tokens(tok, chat_prompt) -> None:
    text = "The answer is 42. Done here."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, chat_prompt, stop=["42. Do"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == "The answer is "
    assert detok.stopped and detok.stop_reason == "42. Do"
    assert detok.add_tokens(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_string_inside_a_token_cuts_the_token_text(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["ell"])
    assert detok.add_tokens(tok.encode("Hello")) == "H"
    assert detok.stopped and detok.output_text == "H"


def test_stop_at_the_very_start(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["Hello"])
    assert stream(detok, tok.encode("Hello world")) == ["", ""]
    assert detok.stopped and detok.output_text == ""


def test_include_stop_str_in_output(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world"], include_stop_str_in_output=True)
    deltas = stream(detok, tok.encode("Hello world and more"))
    assert "".join(deltas) == detok.output_text == "Hello world"
    assert detok.stop_reason == "world"


def test_possible_stop_prefix_is_held_then_released(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=[" wonder"])
    assert detok.add_tokens(tok.encode("Hello")) == "Hello"
    assert detok.add_tokens(tok.encode(" wo")) == ""  # could begin " wonder"
    assert detok.add_tokens(tok.encode("rld")) == " world"  # it did not
    assert not detok.stopped


def test_held_text_is_flushed_when_the_request_ends(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["\n\nUser:"])
    deltas = stream(detok, tok.encode("Bye\n\nUs"))
    assert "".join(deltas) == "Bye"
    assert detok.output_text == "Bye\n\nUs"
    assert detok.flush() == "\n\nUs"
    assert detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["cd", "bcde", "z"])
    detok.add_tokens(tok.encode("abcdef"))
    assert detok.stop_reason == "bcde" and detok.output_text == "a"


class _DecodeSpy:
    """The real tokenizer, recording how many ids each decode call sees."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens)


def test_per_token_work_does_not_grow_with_the_output(tok, chat_prompt) -> None:
    ids = tok.encode(UNICODE_TEXT * 20)
    spy = _DecodeSpy(tok)
    detok = IncrementalDetokenizer(spy, chat_prompt, stop=["never appears"])
    assert "".join(stream(detok, ids)) + detok.flush() == UNICODE_TEXT * 20
    assert len(spy.sizes) <= 2 * len(ids) + 1
    assert max(spy.sizes) <= 12  # a few tokens of context + a split character
