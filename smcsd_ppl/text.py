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


def token_text(tokenizer, ids: Sequence[int]) -> str:
    """A tokenizer's text of token ids, special tokens dropped, U+FFFD where bytes are not yet a character."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def whole_characters(text: str) -> str:
    """``text`` up to its last whole character (any U+FFFD at its end held back).

    Decoding makes U+FFFD of bytes at the end that are not (yet) a character, as when a budget
    cuts inside an emoji. One rule for every text handed out, streamed or final, so that a
    stream is the final text.
    """
    return text.rstrip("\ufffd")


class IncrementalText:
    """The text of a growing token sequence, decoding only what is new (and a few tokens before it).

    Decoding a whole output again at every cycle costs time quadratic in its length. Here an
    update decodes from the start of the last stretch it read (never more than ``LOOKBACK``
    tokens before what is new, once the text is whole), twice: without and with the new tokens;
    what the second adds is new text. A tokenizer may drop a leading space at the start of what
    it decodes, the same in both. Bytes of a character not yet whole wait, as
    ``whole_characters`` holds them back. A sequence that does not extend the last one (every
    particle died) is decoded whole again.

    Args:
        decode: token ids -> text, U+FFFD where bytes are not a character (not held back).

    Attributes:
        text: the text of the tokens seen so far, up to its last whole character.
        decoded: tokens decoded so far, all calls together (what a test counts).
    """

    LOOKBACK = 4

    def __init__(self, decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text, self.decoded = "", 0
        self._prefix = self._read = 0  # ids[prefix:read]: the stretch whose text ends ``text``

    def update(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, up to its last whole character."""
        ids = list(ids)
        n = len(self.ids)
        if len(ids) < n or ids[:n] != self.ids:  # not an extension: start again
            self.ids, self.text, self._prefix, self._read = [], "", 0, 0
        return self.extend(ids[len(self.ids) :])

    def extend(self, new: Sequence[int]) -> str:
        """The text once ``new`` tokens follow those seen (a caller that knows it extends them)."""
        if not new:
            return self.text
        self.ids += new
        ids = self.ids
        head = self._decoded(ids[self._prefix : self._read])
        tail = self._decoded(ids[self._prefix :])
        if len(tail) > len(head) and not tail.endswith("\ufffd"):  # whole: it moves on
            self.text += tail[len(head) :]
            self._prefix = max(self._read, len(ids) - self.LOOKBACK)
            self._read = len(ids)
        return self.text

    def _decoded(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.decode(ids) if ids else ""


class TextStream:
    """The text of a growing token prefix, handed out piece by piece.

    Args:
        decode: token ids -> text, U+FFFD where bytes are not a character (``IncrementalText``'s).

    Attributes:
        text: everything handed out so far.
        tokens: the tokens it was decoded from.
        closed: whether it hands out nothing more (``close``).
    """

    def __init__(self, decode) -> None:
        self.whole = IncrementalText(decode)  # decodes only what each update adds
        self.text, self.tokens, self.closed = "", 0, False

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
        text = self.whole.update(ids)
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
