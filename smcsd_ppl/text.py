"""Checks of user text shared by the API and the command line (standard library only)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence


def check_prompt(prompt: object) -> str:
    """Return ``prompt`` if it is non-empty text that UTF-8 can encode, else raise ``ValueError``."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(
            "prompts must be text (str), got bytes; decode them first, e.g. data.decode('utf-8')"
        )
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompts must be text (str), got {type(prompt).__name__}; "
            "for token ids use SMCSD.run([SMCSDModel(ids)])"
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        # A lone surrogate: in a command line, bytes that are not UTF-8.
        raise ValueError(
            f"the prompt is not valid Unicode text (character {err.start} is a lone surrogate "
            f"{prompt[err.start]!r}; on a command line: bytes that are not UTF-8)"
        ) from err
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text to continue")
    return prompt


def whole_characters(text: str) -> str:
    """``text`` up to its last whole character (any U+FFFD at its end held back).

    Decoding makes U+FFFD of bytes at the end that are not (yet) a character, as when a budget
    cuts inside an emoji. One rule for every text handed out, streamed or final, so that a
    stream is the final text.
    """
    return text.rstrip("\ufffd")


class TextStream:
    """The text of a growing token prefix, handed out piece by piece.

    Args:
        decode: token ids -> text.

    Attributes:
        text: everything handed out so far.
        tokens: the tokens it was decoded from.
        closed: whether it hands out nothing more (``close``).
    """

    def __init__(self, decode) -> None:
        self.decode, self.text, self.tokens, self.closed = decode, "", 0, False

    def close(self) -> None:
        """Hand out nothing more: what was handed out is final (an interrupted run)."""
        self.closed = True

    def update(self, ids) -> str:
        """The text ``ids`` add to what was handed out ('' if none yet, or once closed).

        A character split across tokens (decoded as U+FFFD) waits for its next tokens, and a
        decoding that no longer starts with what was handed out adds nothing.
        """
        if self.closed:
            return ""
        text = whole_characters(self.decode(list(ids)))
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""
        new, self.text, self.tokens = text[len(self.text) :], text, len(ids)
        return new


def check_token_ids(ids: Sequence[int], vocab: int) -> None:
    """Refuse a token-id prompt that is empty or holds ids outside ``[0, vocab)``."""
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token id")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[0]!r}")


def encode_prompt(tokenizer, prompt: str, *, chat: bool = True) -> list[int]:
    """Token ids of a text prompt, wrapped in the chat template when ``chat`` and there is one."""
    check_prompt(prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    return [int(t) for t in ids]
