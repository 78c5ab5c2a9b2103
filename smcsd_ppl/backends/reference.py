"""The model's own forward (transformers' modeling code) over a backend's rows: the reference.

Any causal LM runs here, and our forward (``llama.LlamaForward``) is tested against it. Both
take the same call: a planned ``RowCache`` and the feed's ids, positions and 4D mask. A
flattened feed (``backends.ragged``) reaches attention through transformers' attention
interface; a feature draft (``models.feature_draft``) reads the target's states with its tokens.
"""

from __future__ import annotations

import torch

from . import kv, ragged
from .kv import Feed, attention_mask


class ReferenceForward:
    """The model's own forward, called as ``llama.LlamaForward`` is.

    Args:
        model: any causal LM in eval mode.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache_kw = kv.cache_keyword(model)
        self.reads_hidden = bool(getattr(model, "reads_hidden", False))
        owner = model.body if self.reads_hidden else model
        decoder = owner.get_decoder() if hasattr(owner, "get_decoder") else None
        self.decoder_cache_kw = kv.cache_keyword(decoder) if decoder is not None else None
        # A feature draft's head is plain by construction; others are checked on first use.
        self.plain_head: bool | None = True if self.reads_hidden else None
        # A feed of unlike counts may run flattened where attention can be routed (on a CPU).
        self.flattens = self.device.type == "cpu" and ragged.route_attention(model)

    def __call__(
        self,
        ids: torch.Tensor,
        feed: Feed,
        *,
        last_only: bool = False,
        vocab: torch.Tensor | None = None,
        keep_hidden: bool = False,
        read: torch.Tensor | None = None,  # [R, T, H] a feature draft's input states
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[n, T or 1, V or U]`` (float32; holes of a flat feed 0), and the final states if kept."""
        kwargs = {"attention_mask": attention_mask(feed.allowed, self.model), "use_cache": True}
        kwargs["position_ids"] = feed.positions
        if feed.flat is not None:
            kwargs["rows_valid"] = feed.flat
        logits, hidden = self._logits(ids, kwargs, feed.cache, last_only, read, vocab, keep_hidden)
        if feed.flat is not None:
            return ragged.scatter(logits[0], feed.flat), None
        return logits, hidden

    def _logits(self, ids, kwargs, cache, last_only, read, vocab, keep_hidden):
        t = ids.shape[1]
        if read is not None:
            kwargs[self.decoder_cache_kw] = cache
            hidden = self.model.predict_hidden(ids, read, **kwargs)
        elif keep_hidden or (vocab is not None and self.has_plain_head()):
            kwargs[self.decoder_cache_kw] = cache
            hidden = self.model.get_decoder()(input_ids=ids, **kwargs).last_hidden_state
        else:
            kwargs[self.cache_kw] = cache
            # An index tensor, not the int 1: HF's slice hidden[:, -1:] keeps the strides
            # of the whole sequence, and torch's CPU linear then takes a path that copies
            # the LM head per row (measured ~30x slower); indexing gives a fresh tensor.
            keep = torch.tensor([t - 1], device=self.device) if last_only else 0
            out = self.model(input_ids=ids, logits_to_keep=keep, **kwargs)
            logits = out.logits if vocab is None else out.logits.index_select(-1, vocab)
            return logits.float(), None
        kept = hidden if keep_hidden else None
        if last_only:
            hidden = hidden.index_select(1, torch.tensor([t - 1], device=self.device))  # see above
        return _head(self.model.get_output_embeddings(), hidden, vocab).float(), kept

    def has_plain_head(self) -> bool:
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
