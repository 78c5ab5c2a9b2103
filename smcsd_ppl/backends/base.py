"""The batched LM protocol, forward statistics and checks every backend shares.

A backend holds R rows (all particles of all requests, in the batch dimension)
of one model's state. Positions fed without a real token (left padding, rows that
sit a step out) are *holes*: invisible to every later token and skipped by
position ids. ``HFBatchedLM`` never keeps them (``backends.kv``); the mock keeps
them in a rectangular history tracked by ``RowMask``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..results import RunStats


class ForwardStats:
    """Counts and wall time of a backend's model forwards.

    On CUDA a forward's time is a pair of events read only when ``seconds`` is read
    (after a run), so timing never makes the host wait inside a cycle.
    """

    def __init__(self, calls: int = 0, seconds: float = 0.0, tokens: int = 0) -> None:
        self.calls, self.tokens = calls, tokens  # tokens: positions computed, holes included (none flattened)
        self.split = 0  # extra passes of calls run as several (a CPU backend's feed of unlike lengths)
        self._seconds = seconds
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def seconds(self) -> float:
        """Time spent in forwards (settles pending CUDA events: a sync, so read it after a run)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._pending) / 1000
            self._pending.clear()
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._pending.clear()
        self._seconds = value

    @property
    def passes(self) -> int:
        """The model's forward passes: one per call, more where a call ran as several."""
        return self.calls + self.split

    def __repr__(self) -> str:
        return f"ForwardStats(calls={self.calls}, seconds={self.seconds:.4f}, tokens={self.tokens})"

    def reset(self) -> None:
        """Zero the counters."""
        self.calls, self.seconds, self.tokens, self.split = 0, 0.0, 0, 0


@runtime_checkable
class BatchedLM(Protocol):
    """Everything the inference code, the runners and the benchmarks use of a language model.

    Hidden states are the model's final hidden states (what its LM head reads). A backend
    whose ``reads_hidden`` is true (a feature draft, ``models.feature_draft``) takes the
    target's hidden states with its tokens; one told to ``keep_hidden_states()`` keeps those
    of its last forward in ``hidden``. ``contract.BatchedLMContract`` checks a backend.

    A backend may subclass this protocol to inherit ``prefill``, ``extend`` (their checks,
    then its own ``_prefill(prompts, hidden)`` and ``_extend(tokens, valid, hidden, vocab)``)
    and ``keep_hidden_states``, as the HF and vLLM backends do; the mock only matches it.
    A backend whose rows hold memory of their own may define ``release()``: drop every row
    and free it (the next ``prefill`` starts afresh); the engine calls it when it goes idle.
    """

    name: str  # names the backend in error messages
    device: torch.device  # where its forwards run and its returned tensors live
    vocab_size: int  # V, the width of its logits
    max_length: int  # its context: no row may hold more tokens
    stats: ForwardStats  # its forwards so far
    n_params: int | None  # parameters one forward reads (None: unknown); prices a draft step
    max_cache_bytes: int  # the KV-cache budget it refuses to pass
    bytes_per_token: int  # what one row's cache grows by per position
    reads_hidden: bool  # prefill and extend take the target's hidden states with the tokens
    hidden: torch.Tensor | None  # ``[R, T, H]`` of the last forward, once kept (else None)

    @property
    def n_rows(self) -> int:
        """Rows currently held."""

    def prefill(
        self, prompts: Sequence[Sequence[int]], hidden: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Start afresh with one row per prompt; logits of each prompt's next token ``[B, V]``.

        ``hidden[i] [len(prompts[i]), H]``: the states read with prompt i (``reads_hidden`` only).
        """
        check_prompts(prompts, self.max_length)
        return self._prefill(prompts, hidden)

    def append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add one row per prompt after the rows held (requests joining a running batch).

        The rows held keep their state; the new ones are prefilled on their own. Returns each
        prompt's next-token logits ``[B, V]``.
        """
        check_prompts(prompts, self.max_length)
        if self.n_rows == 0:
            return self._prefill(prompts, None)
        return self._append(prompts)

    def extend(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        *,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens [R, T]`` to every row in ONE forward; logits ``[R, T, V]`` (float32).

        ``valid [R, T]`` marks holes (False): fed but invisible to later tokens. ``hidden
        [R, T, H]``: the states read with the tokens (``reads_hidden`` only). ``vocab [U]``
        asks for the logits of those tokens only (``[R, T, U]``), as constrained drafting does.
        A hole's logits are unspecified: no caller reads them.
        """
        if self.n_rows == 0:
            raise ValueError(f"{self.name}: extend() before prefill()")
        if tokens.dim() != 2 or tokens.shape[0] != self.n_rows:
            raise ValueError(f"{self.name}: tokens must be [{self.n_rows}, T], got {list(tokens.shape)}")
        return self._extend(tokens, valid, hidden, vocab)

    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [R']`` in order (duplicates allowed); indices on the host spare a sync."""

    def drop_tail(self, n: torch.Tensor) -> None:
        """Forget the last ``n[r]`` real tokens of each row (rejected or cut drafts)."""

    def keep_hidden_states(self) -> None:
        """From now on keep each forward's hidden states in ``hidden`` (a feature draft's target)."""
        self.keeps_hidden = True

    def check_finite(self) -> None:
        """Raise if a forward since the last check produced NaN logits."""


@runtime_checkable
class TreeLM(BatchedLM, Protocol):
    """A backend that also verifies token trees in one forward (``backends.tree``)."""

    def extend_tree(
        self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Feed a tree of ``tokens [R, T]`` (``parents [R, T]``, -1 = root) per row; logits ``[R, T, V]``."""

    def keep_path(self, keep: torch.Tensor) -> None:
        """Keep the tree nodes ``keep [R, T]`` (one root-to-node path per row); forget the rest."""


def pad_left(
    seqs: Sequence[Sequence[int]], device: torch.device | None = None, *, fill: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ``ids [R, T]`` and ``valid [R, T]``, holes (``fill``) on the left.

    Left padding puts every row's last token in the last column, where a batched forward
    reads the next-token logits. Built on the host, then moved without waiting for the
    device's queue (``to_device``).
    """
    width = max(1, max((len(s) for s in seqs), default=0))
    ids = torch.full((len(seqs), width), fill, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            valid[i, width - len(s) :] = True
    if device is None:
        return ids, valid
    return to_device(ids, device), to_device(valid, device)


def pad_left_hidden(hidden: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row hidden states ``[L_i, H]`` -> ``[R, width, H]``, zeros on the left (as ``pad_left``)."""
    some = hidden[0]
    out = some.new_zeros(len(hidden), width, some.shape[-1])
    for i, h in enumerate(hidden):
        if len(h):
            out[i, width - len(h) :] = h
    return out


class RowMask:
    """Which physical positions of each row are real tokens (the mock backend's bookkeeping)."""

    def __init__(self, valid: torch.Tensor) -> None:
        self.valid = valid  # [R, L] bool
        self.n_real = valid.sum(1)  # [R] next position id of each row

    @property
    def length(self) -> int:
        """Physical columns per row."""
        return self.valid.shape[1]

    def append(self, valid_new: torch.Tensor) -> None:
        """Record appended positions ``[R, T]``."""
        self.valid = torch.cat([self.valid, valid_new], 1)
        self.n_real = self.n_real + valid_new.sum(1)

    def replace_tail(self, start: int, valid_new: torch.Tensor) -> None:
        """Mark the columns from ``start`` on as ``valid_new [R, L - start]`` (a tree's kept nodes)."""
        self.valid = torch.cat([self.valid[:, :start], valid_new], 1)
        self.n_real = self.valid.sum(1)

    def gather(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` in this order."""
        self.valid = self.valid.index_select(0, rows)
        self.n_real = self.n_real.index_select(0, rows)

    def drop_tail(self, n: torch.Tensor) -> None:
        """Mark the last n[r] real positions of row r as holes."""
        if int(n.max()) == 0:
            return
        if bool((n > self.n_real).any()):
            raise ValueError(f"cannot drop {n.tolist()} tokens from rows holding {self.n_real.tolist()}")
        # rank of each real position counted from the row's end: 1 = last real token
        from_end = self.valid.long().flip(1).cumsum(1).flip(1)
        drop = self.valid & (from_end <= n[:, None])
        self.valid = self.valid & ~drop
        self.n_real = self.n_real - n

    def wasteful(self) -> bool:
        """Holes take more than half the columns (SD rows that rejected different amounts)."""
        return self.length > 2 * int(self.n_real.max()) + 16

    def compaction(self) -> torch.Tensor:
        """Column index ``[R, L']`` moving each row's real positions to the front, in order.

        The mask becomes the matching one (holes only at row ends); callers gather
        their per-position state (KV cache, token history) with the returned index.
        """
        width = int(self.n_real.max())
        order = torch.argsort((~self.valid).to(torch.uint8), dim=1, stable=True)[:, :width]
        self.valid = torch.arange(width, device=self.valid.device)[None, :] < self.n_real[:, None]
        return order


class Timer:
    """Adds a block's time to ``ForwardStats``: CUDA events on CUDA (no sync), else the wall clock."""

    def __init__(self, stats: ForwardStats, device: torch.device, tokens: int) -> None:
        self.stats, self.device, self.tokens = stats, device, tokens
        self.events = None

    def __enter__(self) -> Timer:
        if self.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stats.calls += 1
        self.stats.tokens += self.tokens
        if self.events is not None:
            self.events[1].record()
            self.stats._pending.append(self.events)
        else:
            self.stats.seconds += time.perf_counter() - self.start


def length_groups(lengths: Sequence[int], ratio: float = 2.0, slack: int = 64) -> list[list[int]]:
    """Indices grouped for left-padded forwards, longest first.

    A length joins the group of a longer one when it is at least the longest / ``ratio`` (each
    row then pads under half of it), or when the padding is at most ``slack`` positions: about
    what a forward's own cost is worth on a CPU (one position of a 1,000-token prefill of the
    embedded target costs about a fortieth of a one-token forward), so short prompts share one.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        longest = lengths[groups[-1][0]] if groups else 0
        if groups and (lengths[i] * ratio >= longest or longest - lengths[i] <= slack):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait for the device's queue.

    A plain copy from host memory to a GPU waits for every queued kernel, like a read.
    A copy from pinned memory with ``non_blocking`` does not; the caching host allocator
    keeps the pinned block alive until the copy is done. Tensors already on the device
    (or any tensor on a CPU run) pass through.
    """
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_prompts(prompts: Sequence[Sequence[int]], max_length: int) -> None:
    """Clear errors for empty or over-long prompts before any forward runs."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: at least one token is needed")
        if len(p) >= max_length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {max_length}")


class EngineFault(RuntimeError):
    """The engine failed, not the request: a server answers 5xx (a user's mistake is a ValueError)."""


class NonFiniteLogits(EngineFault):
    """A model produced NaN logits: broken weights, or a dtype that overflows."""


class CacheExhausted(EngineFault):
    """The KV cache would pass its byte budget with what runs now."""


def nan_logits(what: str) -> NonFiniteLogits:
    """The error of NaN logits from ``what`` (the model, or the rows that saw them)."""
    return NonFiniteLogits(f"{what} produced NaN logits (try dtype=float32, or check the weights)")


def check_logits(logits: torch.Tensor, what: str) -> torch.Tensor:
    """NaN logits mean a broken model or dtype overflow: fail loudly, not deep in sampling."""
    if torch.isnan(logits).any():
        raise nan_logits(what)
    return logits


def check_finite(*backends: BatchedLM) -> None:
    """Raise if a backend produced NaN logits since its last check: one host read for all.

    Backends that keep a device-side ``nonfinite`` flag (``HFBatchedLM``) are read
    together, once per cycle, instead of syncing on every forward; others check themselves.
    """
    flagged = [lm for lm in backends if isinstance(getattr(lm, "nonfinite", None), torch.Tensor)]
    for lm in backends:
        if lm not in flagged:
            lm.check_finite()
    if flagged and any(
        torch.stack([lm.nonfinite.to(flagged[0].nonfinite.device) for lm in flagged]).tolist()
    ):
        for lm in flagged:
            lm.check_finite()


def call_clock(target: BatchedLM, draft: BatchedLM) -> tuple[float, int, int, float, float]:
    """The time and both backends' forward counts and times now (``call_stats`` takes differences)."""
    t, d = target.stats, draft.stats
    return time.perf_counter(), t.calls, d.calls, t.seconds, d.seconds


def call_stats(method: str, start: tuple, target: BatchedLM, draft: BatchedLM, new_tokens: int) -> RunStats:
    """The cost of a call begun at ``start = call_clock(...)``: wall time, forwards and their time."""
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    now = call_clock(target, draft)
    seconds, t_calls, d_calls, t_seconds, d_seconds = (a - b for a, b in zip(now, start))
    return RunStats(method, new_tokens, seconds, t_calls, d_calls, t_seconds, d_seconds)
