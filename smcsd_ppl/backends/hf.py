"""Batched backend over any Hugging Face causal LM with a KV cache per row."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .base import ForwardStats, RowMask, Timer, check_logits, check_prompts

DEFAULT_CACHE_BUDGET = 8 * 2**30  # bytes of KV cache one backend may hold


class HFBatchedLM:
    """Rows of one HF model's KV cache; particles live in the batch dimension.

    Args:
        model: a causal LM in eval mode (any device and dtype).
        max_cache_bytes: refuse (``ValueError``) a forward whose KV cache would exceed this.
        name: used in error messages.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_cache_bytes: int = DEFAULT_CACHE_BUDGET,
        name: str = "model",
    ) -> None:
        self.model = model
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.max_cache_bytes = max_cache_bytes
        self.bytes_per_token = _kv_bytes_per_token(model)
        self.n_params = sum(p.numel() for p in model.parameters())  # what a forward reads
        self.stats = ForwardStats()
        self.cache_kw = _cache_keyword(model)
        self.cache: DynamicCache | None = None
        self.rows = RowMask(torch.zeros(0, 0, dtype=torch.bool, device=self.device))
        # A feature draft reads the target's hidden states with its tokens; a target
        # serving one keeps the hidden states of its last forward (`keep_hidden`).
        self.needs_features = bool(getattr(model, "needs_features", False))
        self.keep_hidden = self.needs_features
        self.last_hidden: torch.Tensor | None = None  # [R, T, H] of the last forward
        # The decoder both of those call, and its cache argument (looked up once, not per forward).
        owner = model.body if self.needs_features else model
        decoder = owner.get_decoder() if hasattr(owner, "get_decoder") else None
        self.decoder_cache_kw = _cache_keyword(decoder) if decoder is not None else None
        # A feature draft's head is plain by construction; others are checked on first use.
        self.plain_head: bool | None = True if self.needs_features else None

    @property
    def n_rows(self) -> int:
        """Rows currently held."""
        return self.rows.valid.shape[0]

    def prefill(
        self, prompts: Sequence[Sequence[int]], features: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Start afresh with one row per prompt (left-padded); next-token logits ``[B, V]``.

        ``features[i]`` (``[len(prompts[i]), H]``) are the hidden states a feature draft
        reads with prompt ``i``'s tokens.
        """
        check_prompts(prompts, self.max_length)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
        for i, p in enumerate(prompts):  # left padding keeps every row's last token in the last column
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            valid[i, width - len(p) :] = True
        feats = None
        if features is not None:
            feats = torch.zeros(len(prompts), width, features[0].shape[-1], device=self.device)
            for i, f in enumerate(features):
                feats[i, width - len(f) :] = f
        self.cache = DynamicCache()
        self.rows = RowMask(torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device))
        return self._forward(ids, valid, last_only=True, features=feats)[:, -1]

    def extend(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        *,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens [R, T]`` in one forward; logits ``[R, T, V]`` (float32).

        ``features [R, T, H]``: the hidden states a feature draft reads with the tokens.
        ``vocab [U]``: return the logits of these tokens only, ``[R, T, U]``; the LM head
        then reads only their rows (a large share of a small draft's forward).
        """
        if self.cache is None:
            raise ValueError(f"{self.name}: extend() before prefill()")
        if tokens.dim() != 2 or tokens.shape[0] != self.n_rows:
            raise ValueError(f"{self.name}: tokens must be [{self.n_rows}, T], got {list(tokens.shape)}")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        if features is not None:
            features = features.to(self.device)
        return self._forward(
            tokens.to(self.device),
            valid.to(self.device),
            last_only=False,
            features=features,
            vocab=None if vocab is None else vocab.to(self.device),
        )

    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [R']`` in order: one ``index_select`` per cache tensor."""
        rows = rows.to(self.device)
        if rows.numel() == 0:
            raise ValueError(f"{self.name}: fork() needs at least one row")
        same_shape = rows.numel() == self.n_rows
        moved = rows != torch.arange(self.n_rows, device=self.device) if same_shape else None
        self.rows.gather(rows)
        if moved is not None and int(moved.sum()) * 2 < self.n_rows:
            # Resampling usually replaces a few rows: copy only those, in place.
            dest, src = torch.nonzero(moved)[:, 0], rows[moved]
            with torch.inference_mode():
                self.map_cache(lambda t: t.index_copy_(0, dest, t.index_select(0, src)))
        else:
            self.map_cache(lambda t: t.index_select(0, rows))
        self._crop_holes()

    def drop_tail(self, n: torch.Tensor) -> None:
        """Turn the last ``n[r]`` real positions of each row into holes."""
        self.rows.drop_tail(n.to(self.device))
        self._crop_holes()

    def _crop_holes(self) -> None:
        if self.rows.wasteful():  # gather real positions to the front, per row
            index = self.rows.compaction()
            self.map_cache(
                lambda t: t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
            )
        n = self.rows.trailing_holes()
        if n:
            self.rows.crop(n)
            self.map_cache(lambda t: t[:, :, : t.shape[2] - n])

    def map_cache(self, fn) -> None:
        """Apply ``fn`` to every layer's key and value tensors ``[R, heads, L, head_dim]``."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def _forward(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        *,
        last_only: bool,
        features: torch.Tensor | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r, t = ids.shape
        if self.needs_features != (features is not None):
            what = "needs the target's hidden states" if self.needs_features else "takes no hidden states"
            raise ValueError(f"{self.name}: this model {what}")
        if features is not None and features.shape[:2] != ids.shape:
            raise ValueError(f"{self.name}: features must be [{r}, {t}, H], got {list(features.shape)}")
        need = int(self.rows.n_real.max()) + t if r else t
        if need > self.max_length:
            raise ValueError(
                f"{self.name}: sequence would reach {need} tokens; the model's context is {self.max_length}"
            )
        cache_bytes = self.bytes_per_token * r * (self.rows.length + t)
        if cache_bytes > self.max_cache_bytes:
            raise ValueError(
                f"{self.name}: KV cache would need {cache_bytes / 2**30:.2f} GiB for {r} rows x "
                f"{self.rows.length + t} positions, over the budget of "
                f"{self.max_cache_bytes / 2**30:.2f} GiB; "
                "use fewer particles or tokens, or raise max_cache_bytes"
            )
        positions = self.rows.new_positions(valid)
        self.rows.append(valid)
        kwargs = {"attention_mask": self.rows.valid.long(), "position_ids": positions, "use_cache": True}
        with Timer(self.stats, self.device, r * t), torch.inference_mode():
            if features is not None:
                kwargs[self.decoder_cache_kw] = self.cache
                hidden = self.model.hidden(ids, features, **kwargs)
            elif self.keep_hidden or (vocab is not None and self._plain_head()):
                kwargs[self.decoder_cache_kw] = self.cache
                hidden = self.model.get_decoder()(input_ids=ids, **kwargs).last_hidden_state
            else:
                kwargs[self.cache_kw] = self.cache
                # An index tensor, not the int 1: HF's slice hidden[:, -1:] keeps the strides
                # of the whole sequence, and torch's CPU linear then takes a path that copies
                # the LM head per row (measured ~30x slower); indexing gives a fresh tensor.
                keep = torch.tensor([t - 1], device=self.device) if last_only else 0
                out = self.model(input_ids=ids, logits_to_keep=keep, **kwargs)
                self.last_hidden = None
                logits = out.logits if vocab is None else out.logits.index_select(-1, vocab)
                return check_logits(logits.float(), self.name)
            self.last_hidden = hidden if self.keep_hidden else None
            if last_only:
                hidden = hidden.index_select(1, torch.tensor([t - 1], device=self.device))  # see above
            logits = _head(self.model.get_output_embeddings(), hidden, vocab)
        return check_logits(logits.float(), self.name)

    def _plain_head(self) -> bool:
        """Whether the logits are the LM head applied to the decoder's output, as in Llama.

        Checked once on two tokens: some models scale or soft-cap their logits after the
        head, and then only the full forward is right.
        """
        if self.plain_head is None and not hasattr(self.model, "get_decoder"):
            self.plain_head = False
        if self.plain_head is None:
            ids = torch.tensor([[0, 1]], device=self.device)
            with torch.inference_mode():
                full = self.model(input_ids=ids, use_cache=False).logits
                hidden = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
                mine = self.model.get_output_embeddings()(hidden)
            self.plain_head = torch.allclose(full.float(), mine.float(), rtol=1e-3, atol=1e-3)
        return self.plain_head


def _head(head: torch.nn.Module, hidden: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """The LM head on ``hidden``, for every token or for the rows ``vocab`` only."""
    if vocab is None:
        return head(hidden)
    bias = head.bias.index_select(0, vocab) if head.bias is not None else None
    return torch.nn.functional.linear(hidden, head.weight.index_select(0, vocab), bias)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The cache argument's name: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one row's KV cache grows by per position (keys + values, all layers)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * elem
