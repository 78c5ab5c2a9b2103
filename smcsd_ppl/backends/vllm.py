"""Rows of one model on vLLM's engine, through its public API only.

A row is a token list held here. Every forward sends each row's whole sequence to the engine
as a pooling request that returns the model's final hidden state at every position (token
pooling ``ALL``, no activation), and applies the model's LM head here: the logits are the
model's own, so every weight (log p at T_t and alpha, log q at T_d, the bonus normaliser,
constraint masks, the quality cut's divergence) is computed exactly as on the HF backend,
by the same code. Forks and dropped tails touch only the token lists.

What this costs: the engine computes, on each call, every position its prefix cache does
not hold. That cache works in whole blocks (32 positions here on CPUs, vLLM's 16 on GPUs),
so a row recomputes less than a block of context besides its new tokens. Reading the cache
for such requests takes ``PoolingParams(skip_reading_prefix_cache=False)`` (vLLM marks the
field internal); where a vLLM release refuses it, or the cache served one of a row's new
tokens, the row is recomputed whole. See docs/scaling.md for the per-cycle count.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import BatchedLM, ForwardStats, Timer, nan_logits
from .vllm_engine import (
    CPU_BLOCK,
    INSTALL_HINT,
    cache_reading_params,
    import_vllm,
    restore_parallel_state,
    start_engine,
)
from .vllm_export import weights_dir

__all__ = [
    "CPU_BLOCK",
    "INSTALL_HINT",
    "EngineParts",
    "VLLMBatchedLM",
    "built_parts",
    "import_vllm",
    "start_engine",
    "vllm_backend",
    "weights_dir",
]


class VLLMBatchedLM(BatchedLM):
    """A ``BatchedLM`` whose forwards run on a vLLM engine (see the module docstring).

    Args:
        engine: a ``vllm.LLM`` started by ``start_engine`` (token pooling ``ALL``).
        head: the LM head ``[V, H]`` (its bias ``[V]`` too, if any), on the device logits live on.
        max_length: the engine's context (``max_model_len``).
        name: used in error messages.
        n_params: parameters one forward reads (prices a draft step).
    """

    reads_hidden = False
    bytes_per_token = 0  # the engine manages its own KV cache
    max_cache_bytes = 0

    def __init__(
        self,
        engine,
        head: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        max_length: int,
        name: str = "model",
        n_params: int | None = None,
    ) -> None:
        self.engine, self.head, self.bias = engine, head, bias
        self.name, self.max_length, self.n_params = name, max_length, n_params
        self.device, self.dtype = head.device, head.dtype
        self.vocab_size = head.shape[0]
        self.stats = ForwardStats()
        self.rows: list[list[int]] = []
        self.positions = 0  # positions the engine computed so far (new tokens and recomputed context)
        self.cached = cache_reading_params()  # None: every call recomputes whole rows
        self.keeps_hidden = False
        self.hidden: torch.Tensor | None = None
        self.nonfinite = False

    @property
    def n_rows(self) -> int:
        """Rows currently held."""
        return len(self.rows)

    def _prefill(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        """``BatchedLM.prefill``'s forward: the prompts become the rows."""
        _no_hidden(self, hidden)
        self.rows = [[int(t) for t in p] for p in prompts]
        self.nonfinite = False
        states = self._states([0] * len(self.rows))  # each prompt's last position
        return self._logits(states, None)[:, 0]

    def _append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``BatchedLM.append``: the prompts join the rows; the engine reads them alone."""
        first = len(self.rows)
        self.rows += [[int(t) for t in p] for p in prompts]
        with Timer(self.stats, self.device, sum(len(p) for p in prompts)):
            last = torch.stack([got[-1] for got in self._encode(range(first, len(self.rows)), None)])
        return self._logits(last[:, None], None)[:, 0]

    def _extend(self, tokens: torch.Tensor, valid, hidden, vocab) -> torch.Tensor:
        """``BatchedLM.extend``'s forward: the real tokens join the rows, holes are left out."""
        _no_hidden(self, hidden)
        r, t = tokens.shape
        valid = torch.ones(r, t, dtype=torch.bool) if valid is None else valid.cpu()
        ids = tokens.cpu().tolist()
        new = [[x for x, ok in zip(row, v) if ok] for row, v in zip(ids, valid.tolist())]
        longest = max((len(a) + len(b) for a, b in zip(self.rows, new)), default=0)
        if longest > self.max_length:
            raise ValueError(
                f"{self.name}: sequence would reach {longest} tokens; "
                f"the model's context is {self.max_length}"
            )
        for row, extra in zip(self.rows, new):
            row.extend(extra)
        states = self._states([len(x) for x in new])  # [R, 1 + new, H]: from the token before
        # Column j reads the state of the row's last real token at or before it: index i is its
        # i-th new real token (index 0, the token before the block, only leading holes read).
        seen = valid.long().cumsum(1).to(states.device)
        picked = states.gather(1, seen[:, :, None].expand(r, t, states.shape[-1]))
        return self._logits(picked, vocab)

    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [R']`` in order (duplicates allowed): the token lists are copied."""
        if rows.numel() == 0:
            raise ValueError(f"{self.name}: fork() needs at least one row")
        self.rows = [list(self.rows[i]) for i in rows.tolist()]

    def drop_tail(self, n: torch.Tensor) -> None:
        """Forget the last ``n[r]`` tokens of each row."""
        drop = n.tolist()
        if any(d > len(row) for d, row in zip(drop, self.rows)) or min(drop, default=0) < 0:
            raise ValueError(
                f"{self.name}: cannot drop {drop} tokens from rows holding {[len(r) for r in self.rows]}"
            )
        self.rows = [row[: len(row) - d] for row, d in zip(self.rows, drop)]

    def check_finite(self) -> None:
        """Raise if a forward since the last check produced NaN logits."""
        bad, self.nonfinite = self.nonfinite, False
        if bad:
            raise nan_logits(self.name)

    def _states(self, new: list[int]) -> torch.Tensor:
        """Final hidden states of each row's last ``new[r] + 1`` positions ``[R, 1 + max(new), H]``.

        Left-aligned (zeros after a row's own states). One engine call for all rows; a row
        the cache served a new token of is recomputed whole.
        """
        states: list[torch.Tensor | None] = [None] * len(self.rows)
        with Timer(self.stats, self.device, sum(new) or len(self.rows)):
            for i, (got, n) in enumerate(zip(self._encode(range(len(self.rows)), self.cached), new)):
                states[i] = _last_states(got, n)
            redo = [i for i, x in enumerate(states) if x is None]
            for i, got in zip(redo, self._encode(redo, None) if redo else []):
                states[i] = _last_states(got, new[i])
        out = self.head.new_zeros(len(self.rows), 1 + max(new), self.head.shape[1])
        for i, x in enumerate(states):
            out[i, : len(x)] = x
        return out

    def _encode(self, rows, params) -> list[torch.Tensor]:
        """The engine's states for ``rows`` (reading its prefix cache with ``params``): the last ones."""
        from vllm.inputs import TokensPrompt

        restore_parallel_state(self.engine)
        outs = self.engine.encode(
            [TokensPrompt(prompt_token_ids=self.rows[i]) for i in rows],
            pooling_params=params,
            pooling_task="token_embed",
            use_tqdm=False,
        )
        data = [o.outputs.data.to(device=self.device, dtype=self.head.dtype) for o in outs]
        self.positions += sum(len(x) for x in data)
        return data

    def _logits(self, states: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """The LM head on ``states``: float32 logits of every token, or of ``vocab``'s only."""
        self.hidden = states if self.keeps_hidden else None
        head, bias = self.head, self.bias
        if vocab is not None:
            vocab = vocab.to(self.device)
            head, bias = head.index_select(0, vocab), None if bias is None else bias.index_select(0, vocab)
        logits = torch.nn.functional.linear(states, head, bias).float()
        self.nonfinite |= bool(torch.isnan(logits).any())
        return logits


def _no_hidden(lm: VLLMBatchedLM, hidden) -> None:
    if hidden is not None:
        raise ValueError(f"{lm.name}: the vLLM backend takes no hidden states (no feature drafts)")


def _last_states(got: torch.Tensor, n: int) -> torch.Tensor | None:
    """A row's states for its last ``n + 1`` positions, from the engine's last ``len(got)``.

    None where the cache served one of the ``n`` new tokens. Where it served the position just
    before them, only a leading hole would read that state; the first new one stands in.
    """
    if len(got) < max(n, 1):
        return None
    return torch.cat([got[:1], got]) if len(got) == n else got[-(n + 1) :]


@dataclass(frozen=True)
class EngineParts:
    """What a ``VLLMBatchedLM`` is made of besides its engine.

    Attributes:
        path: the directory (or hub id) the engine loads the weights from.
        head: the LM head ``[V, H]``, on the device and in the dtype logits are computed in.
        bias: the head's bias ``[V]``, if any.
        max_length: the model's context (``max_position_embeddings``), or None for the engine's.
        n_params: parameters one forward reads (prices a draft step).
    """

    path: str
    head: torch.Tensor
    bias: torch.Tensor | None
    max_length: int | None
    n_params: int


def built_parts(model, *, role: str, cache_root: pathlib.Path) -> EngineParts:
    """``EngineParts`` of a model built in PyTorch (a ``LoadedModel``); one written out if only in memory."""
    import_vllm()  # not installed: say so before writing anything
    if getattr(model.model, "reads_hidden", False):
        raise ValueError(
            f"the vLLM backend cannot run the {role} {model.name!r}: feature drafts read the target's states"
        )
    from .reference import ReferenceForward

    if not ReferenceForward(model.model).has_plain_head():  # checked on two tokens
        raise ValueError(
            f"the vLLM backend cannot run the {role} {model.name!r}: its logits are not its LM head "
            "applied to its last hidden state (scaled or soft-capped); use the HF backend"
        )
    head = model.model.get_output_embeddings()
    return EngineParts(
        weights_dir(model, cache_root),
        head.weight.detach(),
        None if getattr(head, "bias", None) is None else head.bias.detach(),
        getattr(model.model.config, "max_position_embeddings", None),
        sum(p.numel() for p in model.model.parameters()),
    )


def vllm_backend(parts: EngineParts, *, role: str, options: dict) -> VLLMBatchedLM:
    """A ``VLLMBatchedLM`` over an engine started on ``parts.path``, applying ``parts.head`` here."""
    engine = start_engine(
        parts.path,
        dtype=parts.head.dtype,
        max_length=options.get("max_model_len") or parts.max_length,
        role=role,
        options=options,
    )
    return VLLMBatchedLM(
        engine,
        parts.head,
        bias=parts.bias,
        max_length=int(engine.llm_engine.model_config.max_model_len),
        name=role,
        n_params=parts.n_params,
    )
