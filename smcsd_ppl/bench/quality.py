"""Quality of an output: the target's log-likelihood of it, and task accuracy."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..api import SMCSD

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_WORD = re.compile(r"[^\W_]+")  # letters and digits; anything else separates words
_ARTICLES = frozenset({"a", "an", "the"})


def target_loglik_per_token(
    pair: SMCSD, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> float | None:
    """Mean log p(output token | prompt, earlier output) under the target at temperature 1.

    One forward of the target model itself where the backend has one (so the backend's
    counters and cache are untouched); else (the vLLM backend) a prefill and an extend of the
    backend, whose rows the next call replaces. ``None`` for an empty output.
    """
    if not output_ids:
        return None
    logits = pair.call(lambda: _output_logits(pair.target_lm, prompt_ids, output_ids))  # [T, V]
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
    """Lower-case words, single-spaced: punctuation separates words, articles dropped (SQuAD-style)."""
    return " ".join(w for w in _WORD.findall(text.lower()) if w not in _ARTICLES)


def short_answer_correct(output: str, answer: str) -> bool:
    """The answer occurs in the output as whole words ("Mars" is not in "Marsupial" nor in "Earth")."""
    want = normalize(answer)
    return bool(want) and re.search(rf"\b{re.escape(want)}\b", normalize(output)) is not None


def check_answer(output: str, answer: str | None) -> bool | None:
    """Whether ``output`` answers correctly: numerically for numbers, else as whole words.

    ``None`` where there is no reference answer (the prompt is not checkable).
    """
    if answer is None:
        return None
    return gsm8k_correct(output, answer) if is_number(answer) else short_answer_correct(output, answer)


@torch.inference_mode()
def _output_logits(lm, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """The target's logits ``[T, V]`` at the positions that predict each output token."""
    model = getattr(lm, "model", None)
    if model is None:
        first = lm.prefill([list(prompt_ids)])[:, None]
        if len(output_ids) == 1:
            return first[0].float()
        rest = lm.extend(torch.tensor([list(output_ids)[:-1]], dtype=torch.long))
        return torch.cat([first, rest], 1)[0].float()
    ids = torch.tensor([list(prompt_ids) + list(output_ids)[:-1]], device=lm.device)
    return model(input_ids=ids, logits_to_keep=len(output_ids)).logits[0].float()
