"""Distillation data: text the target writes itself, with its top-k next-token log-probs.

A draft should match the target where it will be used: on the target's own continuations
of prompts. ``collect`` lets the target answer prompts in batches, scores every position of
each (truncated) prompt + answer with one teacher-forced forward, and keeps the top-k
log-probabilities, so training needs no target forward. Work is written shard by shard
(one file per batch of prompts, renamed into place when complete), so an interrupted
collection resumes where it stopped and a finished one is never redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import transformers

from ..backends.base import pad_left
from ..methods.hf import plain_sampling

SHARD_GLOB = "shard-*.pt"


@dataclass(frozen=True)
class Example:
    """One training or evaluation sequence.

    Attributes:
        ids: token ids ``[T]`` (a prompt's tail, then the target's continuation).
        start: index of the first continuation token (0 for corpus text).
        top_ids: ``[T-1, k]`` the target's k most likely next tokens after each prefix.
        top_logp: ``[T-1, k]`` their log-probabilities at temperature 1 (float16).
    """

    ids: torch.Tensor
    start: int
    top_ids: torch.Tensor
    top_logp: torch.Tensor


def continue_prompts(
    model: transformers.PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float | None,
    eos_ids: Sequence[int],
    seed: int,
) -> list[list[int]]:
    """The target's continuations of token-id prompts, batched with left padding.

    ``temperature=None`` decodes greedily. Each continuation ends at its first EOS (kept).
    The global torch RNG is left as it was.
    """
    device = model.device
    pad = int(eos_ids[0])
    ids, valid = pad_left(prompts, device, fill=pad)
    mask, width = valid.long(), ids.shape[1]
    if temperature is None:
        settings = dict(
            do_sample=False, max_new_tokens=max_new_tokens, top_k=None, top_p=None, temperature=None
        )
    else:
        settings = plain_sampling(temperature, max_new_tokens)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(
            ids, attention_mask=mask, **settings, pad_token_id=pad, eos_token_id=list(eos_ids)
        )
    stops = set(int(e) for e in eos_ids)
    results = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        results.append(row[:end])
    return results


def right_padded(
    sequences: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]`` right-padded with 0, and the attention mask of the real tokens."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def teacher_topk(
    model: transformers.PreTrainedModel, sequences: Sequence[Sequence[int]], k: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-k next-token log-probs of the target after every prefix of each sequence."""
    ids, mask = right_padded(sequences, model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for row, seq in enumerate(sequences):
        logp = torch.log_softmax(logits[row, : len(seq) - 1].float(), dim=-1)
        values, indices = logp.topk(k, dim=-1)
        out.append((indices.to("cpu", torch.int32), values.to("cpu", torch.float16)))
    return out


@dataclass(frozen=True)
class CollectSettings:
    """How ``collect`` samples and keeps the target's answers.

    Attributes:
        max_new_tokens: continuation length cap.
        temperature: sampling temperature of the continuations; ``None`` is greedy.
        max_prompt_tokens: keep only this many trailing prompt tokens in the examples.
        top_k: how many next-token log-probs to keep per position.
        batch_size: prompts per generation batch, and per shard.
        seed: shard ``i`` samples with seed ``seed + i``.
    """

    max_new_tokens: int = 128
    temperature: float | None = 0.7
    max_prompt_tokens: int = 192
    top_k: int = 64
    batch_size: int = 16
    seed: int = 0


def collect(
    model: transformers.PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    eos_ids: Sequence[int],
    settings: CollectSettings = CollectSettings(),
    on_progress: Callable[[int, int], None] | None = None,
) -> pathlib.Path:
    """Write the target's continuations of ``prompts`` with its top-k log-probs, shard by shard.

    Args:
        model: the target.
        prompts: token-id prompts (chat template already applied).
        out_dir: shard directory; existing complete shards are kept (resume, under the same
            settings only).
        eos_ids: the target's end-of-sequence ids.
        settings: how answers are sampled and kept.
        on_progress: called with (prompts done, prompts in all).

    Returns:
        ``out_dir``.
    """
    c = settings
    _check_collect(model, prompts, max_new_tokens=c.max_new_tokens, top_k=c.top_k, batch_size=c.batch_size)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_meta(out, dict(prompts=_digest(prompts), **asdict(c)))
    generation = dict(max_new_tokens=c.max_new_tokens, temperature=c.temperature, eos_ids=eos_ids)
    for n, first in enumerate(range(0, len(prompts), c.batch_size)):
        path = out / f"shard-{n:05d}.pt"
        if not path.is_file():  # a complete shard is never redone
            batch = [list(p) for p in prompts[first : first + c.batch_size]]
            answers = continue_prompts(model, batch, seed=c.seed + n, **generation)
            _write_answers(path, model, batch, answers, c.max_prompt_tokens, c.top_k)
        if on_progress is not None:
            on_progress(min(first + c.batch_size, len(prompts)), len(prompts))
    return out


def _check_collect(model, prompts: Sequence[Sequence[int]], **counts: int) -> None:
    """Refuse no prompts, an empty prompt, counts below 1, or a top-k beyond the vocabulary."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("collect needs at least one prompt, and no empty prompt")
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if counts["top_k"] > model.config.vocab_size:
        raise ValueError(f"top_k ({counts['top_k']}) exceeds the vocabulary ({model.config.vocab_size})")


def _write_answers(path, model, batch, answers, max_prompt_tokens: int, top_k: int) -> None:
    """One shard: each prompt's tail and its non-empty answer, scored by the target."""
    tails = [p[-max_prompt_tokens:] for p in batch]
    seqs = [t + a for t, a in zip(tails, answers) if a]
    starts = [len(t) for t, a in zip(tails, answers) if a]
    _write_shard(path, model, seqs, starts, top_k)


def greedy_examples(
    model: transformers.PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    eos_ids: Sequence[int],
    max_new_tokens: int = 64,
    batch_size: int = 16,
    on_progress: Callable[[int], None] | None = None,
) -> list[Example]:
    """The target's greedy continuations of ``prompts`` as examples (no top-k: for evaluation).

    ``on_progress`` is called with the number of prompts done after each batch.
    """
    examples = []
    for first in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[first : first + batch_size]]
        answers = continue_prompts(
            model, batch, max_new_tokens=max_new_tokens, temperature=None, eos_ids=eos_ids, seed=0
        )
        empty = torch.zeros((0, 0))
        examples += [Example(torch.tensor(p + a), len(p), empty, empty) for p, a in zip(batch, answers) if a]
        if on_progress is not None:
            on_progress(first + len(batch))
    return examples


def _digest(prompts: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:16]


def _check_meta(out: pathlib.Path, settings: dict) -> None:
    """Refuse to mix shards made from other prompts or settings into one directory."""
    meta = out / "meta.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old != settings:
            changed = sorted(k for k in settings if old.get(k) != settings[k])
            raise ValueError(f"{out} holds data made with other {', '.join(changed)}; use another directory")
    else:
        meta.write_text(json.dumps(settings) + "\n")


def corpus_examples(
    model: transformers.PreTrainedModel,
    texts: Sequence[str],
    tokenizer: transformers.PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    *,
    length: int = 256,
    top_k: int = 64,
    batch_size: int = 16,
) -> pathlib.Path:
    """Score plain text with the target: chunks of ``length`` tokens, written as shards."""
    chunks = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        chunks += [ids[i : i + length] for i in range(0, len(ids), length) if len(ids[i : i + length]) > 1]
    if not chunks:
        raise ValueError("the corpus holds no text")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for n, first in enumerate(range(0, len(chunks), batch_size)):
        path = out / f"shard-{n:05d}.pt"
        if path.is_file():
            continue
        seqs = chunks[first : first + batch_size]
        _write_shard(path, model, seqs, [0] * len(seqs), top_k)
    return out


def _write_shard(
    path: pathlib.Path, model: transformers.PreTrainedModel, seqs: list[list[int]], starts: list[int], k: int
) -> None:
    """Score ``seqs`` with the target and write them as one shard, renamed into place when complete."""
    tops = teacher_topk(model, seqs, k) if seqs else []
    shard = {
        "ids": [torch.tensor(s, dtype=torch.int32) for s in seqs],
        "starts": starts,
        "top_ids": [i for i, _ in tops],
        "top_logp": [v for _, v in tops],
    }
    torch.save(shard, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def load_examples(*dirs: str | os.PathLike) -> list[Example]:
    """All examples in the shard directories, in a fixed order."""
    examples = []
    for directory in dirs:
        paths = sorted(pathlib.Path(directory).glob(SHARD_GLOB))
        if not paths:
            raise ValueError(f"no data shards ({SHARD_GLOB}) in {str(directory)!r}")
        for path in paths:
            shard = torch.load(path, weights_only=True)
            for ids, start, top_ids, top_logp in zip(
                shard["ids"], shard["starts"], shard["top_ids"], shard["top_logp"], strict=True
            ):
                examples.append(Example(ids.long(), int(start), top_ids.long(), top_logp))
    return examples
