"""Quality of an output: the target's log-likelihood of it, and task accuracy."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..api import SMCSD

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def target_loglik_per_token(
    pair: SMCSD, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> float | None:
    """Mean log p(output token | prompt, earlier output) under the target at temperature 1.

    One forward of the target model itself (not its batched backend, so the backend's
    counters and cache are untouched). ``None`` for an empty output.
    """
    if not output_ids:
        return None
    model = pair.target_lm.model
    ids = torch.tensor([list(prompt_ids) + list(output_ids)[:-1]], device=pair.target_lm.device)
    with torch.inference_mode():
        # the last len(output) positions predict the output tokens
        logits = model(input_ids=ids, logits_to_keep=len(output_ids)).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, -1)
    tokens = torch.tensor(list(output_ids), device=logp.device)
    return float(logp.gather(1, tokens[:, None]).mean())


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas and a trailing period dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def is_number(answer: str) -> bool:
    """Whether a reference answer is a plain number (then checked numerically)."""
    return re.fullmatch(r"[-+]?\d+(\.\d+)?", answer.replace(",", "").strip()) is not None


def gsm8k_correct(output: str, answer: str) -> bool:
    """GSM8K rule: the last number in the output equals the reference number."""
    got = last_number(output)
    if got is None:
        return False
    try:
        return float(got) == float(answer.replace(",", ""))
    except ValueError:
        return False


def normalize(text: str) -> str:
    """Lower case, no punctuation or articles, single spaces (SQuAD-style)."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def short_answer_correct(output: str, answer: str) -> bool:
    """The normalized answer occurs in the normalized output."""
    want = normalize(answer)
    return bool(want) and f" {want} " in f" {normalize(output)} "


def check_answer(output: str, answer: str | None) -> bool | None:
    """Whether ``output`` answers correctly: numerically for numbers, else by containment.

    ``None`` where there is no reference answer (the prompt is not checkable).
    """
    if answer is None:
        return None
    return gsm8k_correct(output, answer) if is_number(answer) else short_answer_correct(output, answer)
