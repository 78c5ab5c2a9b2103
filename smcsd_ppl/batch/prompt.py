"""One prompt, as every loader returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One prompt, as every loader returns it.

    Attributes:
        id: unique within its dataset (the record key uses it).
        text: the prompt (the first turn for multi-turn sets).
        category: the dataset's category, or the dataset's name.
        answer: the reference answer where outputs are checkable (a number for GSM8K).
    """

    id: str
    text: str
    category: str
    answer: str | None = None
