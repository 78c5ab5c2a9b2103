"""Our forward of a Llama-family model over a backend's rows: the compiled engine's model.

The model's own forward (transformers' modeling code) is the reference; this one computes the
same function with far fewer operations, which on a CPU is most of a small model's time after
the weights are read. A decoder layer is three parts:

- ``pre_attention``: the input norm, the q, k, v products and the rotary embedding, position by
  position over the feed's tokens flattened to ``[P, H]``;
- attention, which reads each row's cache (``kv.RowCache``: the backend's plan says where the
  new keys and values go and which rows and columns are read) and needs the rows' layout;
- ``post_attention``: the output product, the residual, the norm and the MLP, position by position.

The two position-wise parts are pure functions of tensors; ``graphs.CompiledParts`` runs them as
compiled graphs where it has them (one per shape class, for any number of positions), and the
forward runs them as they are elsewhere. Every product takes the few-row order
(``products.left_product``) when the feed has at most ``FEW`` positions: a function of the feed's
shape, never of the values in it. Llama-family models only (SmolLM2, Llama 3.x); ``unsupported``
says why another model runs the reference forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.functional import linear, scaled_dot_product_attention, silu

from .kv import Feed
from .products import MKL, left_product

SUPPORTED = ("llama",)
FEW = 10  # the most positions a forward may carry for its products to take the weight on the left


@dataclass(frozen=True)
class LayerShape:
    """What a decoder layer's position-wise parts depend on besides their tensors (a compiled graph's key)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> LayerShape:
        """The layer shape of a Llama ``model``."""
        cfg = model.config
        heads = cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            cfg.intermediate_size,
            float(cfg.rms_norm_eps),
            next(model.parameters()).dtype,
        )


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run this forward (None: it can)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"it runs Llama-family models only, not {kind!r}"
    if getattr(model, "reads_hidden", False):
        return "a feature draft reads the target's hidden states"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "the model has biases in its attention or MLP"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "the model's activation or tensor split is not Llama's"
    shape = LayerShape.of(model)
    if shape.kv_heads != shape.heads and _torch_version() < (2, 5):
        return "grouped-query attention needs torch >= 2.5"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMS norm: in float32, then back to ``x``'s dtype before the weight, as the model does."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def product(x: torch.Tensor, weight: torch.Tensor, few: bool) -> torch.Tensor:
    """``x @ W.T``; ``few``: as ``(W @ x.T).T``, the order a CPU runs faster for a few rows."""
    return left_product(x, weight, None) if few else linear(x, weight)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [P, heads, D]`` with ``cos, sin [P, D]`` (Llama's half split)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + turned * sin[:, None]


class Before(NamedTuple):
    """A layer's weights before attention: its input norm and the q, k, v products."""

    norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class After(NamedTuple):
    """A layer's weights after attention: the output product, the norm and the MLP's three products."""

    o: torch.Tensor
    norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def pre_attention(
    x: torch.Tensor,  # [P, H]
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
    w: Before,
    *,
    shape: LayerShape,
    few: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries ``[P, heads, D]`` and new keys and values ``[P, kv_heads, D]``, rotated."""
    p = x.shape[0]
    y = rms_norm(x, w.norm, shape.eps)
    q = product(y, w.q, few).view(p, shape.heads, shape.head_dim)
    k = product(y, w.k, few).view(p, shape.kv_heads, shape.head_dim)
    v = product(y, w.v, few).view(p, shape.kv_heads, shape.head_dim)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def post_attention(
    h: torch.Tensor,  # [P, H] the layer's input
    attended: torch.Tensor,  # [P, heads * D]
    w: After,
    *,
    shape: LayerShape,
    few: bool,
) -> torch.Tensor:
    """The layer's output ``[P, H]``: attention's product and residual, then the MLP and its residual."""
    h = h + product(attended, w.o, few)
    y = rms_norm(h, w.norm, shape.eps)
    return h + product(silu(product(y, w.gate, few)) * product(y, w.up, few), w.down, few)


Part = Callable[..., object]  # a position-wise part, as it runs or compiled


class EagerParts:
    """The position-wise parts as they are (``graphs.CompiledParts`` gives compiled ones)."""

    def pre(self, shape: LayerShape, few: bool) -> Part:
        """``pre_attention`` for ``shape``, in the few-row order or not."""
        return lambda *t: pre_attention(*t, shape=shape, few=few)

    def post(self, shape: LayerShape, few: bool) -> Part:
        """``post_attention`` for ``shape``, in the few-row order or not."""
        return lambda *t: post_attention(*t, shape=shape, few=few)


class LlamaForward:
    """A Llama's forward over a ``RowCache``, its position-wise parts run by ``parts``.

    Args:
        model: a ``LlamaForCausalLM`` in eval mode (``unsupported(model)`` is None).
        parts: what runs the position-wise parts (``EagerParts()`` by default).
        few_rows: products of at most ``FEW`` positions take the weight on the left, where that
            pays (float32 on MKL; ``cpu.CPUTricks.few_rows``).
    """

    flattens = True  # a feed of unlike counts may run its real tokens alone (``backends.ragged``)

    def __init__(self, model: torch.nn.Module, parts=None, *, few_rows: bool = True) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the compiled forward cannot run this model: {reason}")
        self.decoder = model.model
        head = model.get_output_embeddings()
        self.head, self.head_bias = head.weight, head.bias
        self.device = self.head.device
        self.shape = LayerShape.of(model)
        self.parts = parts or EagerParts()
        self.weights = [_weights(layer) for layer in self.decoder.layers]
        self.scale = self.shape.head_dim**-0.5
        self.few_ok = few_rows and MKL and self.head.is_cpu and self.head.dtype == torch.float32

    def __call__(
        self,
        ids: torch.Tensor,  # [n, T], or the real tokens [1, P] where the feed is flat
        feed: Feed,
        *,
        last_only: bool = False,
        vocab: torch.Tensor | None = None,
        keep_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[n, T or 1, V or U]`` (float32; holes of a flat feed 0), and the final states if kept.

        Each layer writes its new keys and values where ``feed.cache`` was planned to, and reads
        what it returns.
        """
        flat = feed.flat
        n, t = ids.shape if flat is None else flat.shape
        x = self.decoder.embed_tokens(ids.reshape(1, -1))  # [1, P, H]
        cos, sin = self.decoder.rotary_emb(x, feed.positions.reshape(1, -1))
        h, cos, sin = x[0], cos[0].to(x.dtype), sin[0].to(x.dtype)
        p = h.shape[0]
        few = self.few_ok and p <= FEW
        pre, post = self.parts.pre(self.shape, few), self.parts.post(self.shape, few)
        for i, (before, after) in enumerate(self.weights):
            q, k, v = pre(h, cos, sin, before)
            attended = self._attend(i, q, k, v, feed)
            h = post(h, attended, after)
        if flat is None:
            h = h.view(n, t, -1)
            h = h[:, -1:] if last_only and not keep_hidden else h  # only what is read is normed
        h = rms_norm(h, self.decoder.norm.weight, self.shape.eps)
        read = h[:, -1:] if last_only and flat is None else h
        head, bias = self.head, self.head_bias
        if vocab is not None:
            head, bias = head.index_select(0, vocab), None if bias is None else bias.index_select(0, vocab)
        m = read.numel() // read.shape[-1]
        logits = product(read.reshape(m, -1), head, self.few_ok and m <= FEW)
        logits = (logits if bias is None else logits + bias).float()
        if flat is not None:  # back to the padded layout, holes 0
            return _scatter(logits, flat), _scatter(h, flat) if keep_hidden else None
        return logits.view(*read.shape[:2], -1), h if keep_hidden else None

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feed: Feed) -> torch.Tensor:
        """Layer ``i``'s attention over its cache rows: ``[P, heads * D]``."""
        s, flat, n = self.shape, feed.flat, feed.allowed.shape[0]
        if flat is None:  # [P, heads, D] -> [n, heads, T, D], as the model's own layers pass them
            keys, values = feed.cache.update(_rows(k, n), _rows(v, n), i)
            queries = _rows(q, n)
        else:  # the tokens stay flat for the cache's writes; queries go back to their rows
            keys, values = feed.cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], i)
            queries = _scatter(q, flat).transpose(1, 2)
        if queries.is_cpu and queries.dtype != torch.float32:
            out = _attend_products(queries, keys, values, feed.allowed, self.scale)
        else:
            gqa = s.kv_heads != s.heads
            out = scaled_dot_product_attention(
                queries, keys, values, attn_mask=feed.allowed, scale=self.scale, enable_gqa=gqa
            )
        out = out.transpose(1, 2)  # [n, T, heads, D]
        out = out[flat] if flat is not None else out.reshape(-1, s.heads, s.head_dim)
        return out.reshape(-1, s.heads * s.head_dim)


def _weights(layer: torch.nn.Module) -> tuple[Before, After]:
    """A decoder layer's weights, by part."""
    attn, mlp = layer.self_attn, layer.mlp
    before = Before(layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    after = After(
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_proj.weight,
        mlp.up_proj.weight,
        mlp.down_proj.weight,
    )
    return before, after


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[n * T, heads, D]`` as ``[n, heads, T, D]``."""
    return x.view(n, -1, *x.shape[1:]).transpose(1, 2)


def _scatter(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``x [P, ...]`` (the real positions of ``flat [n, T]``, in order) in the padded layout; holes 0."""
    out = x.new_zeros(*flat.shape, *x.shape[1:])
    out[flat] = x
    return out


def _attend_products(q, keys, values, allowed, scale: float) -> torch.Tensor:
    """Attention as three products: ``q [R, H, T, D]``, ``keys [R, Hkv, C, D]``, ``allowed [R, 1, T, C]``.

    For a CPU in half precision, where torch's fused kernel takes several times longer for a
    few query tokens per row, with the same error against float32 (docs/benchmarks.md).
    """
    r, heads, t, d = q.shape
    kv, columns = keys.shape[1], keys.shape[2]
    group = heads // kv  # query heads per key head, read together
    scores = (q.reshape(r, kv, group * t, d) @ keys.transpose(-1, -2)) * scale
    scores = scores.view(r, kv, group, t, columns).masked_fill(~allowed[:, :, None], -torch.inf)
    weights = torch.softmax(scores.float(), -1).to(q.dtype).view(r, kv, group * t, columns)
    return (weights @ values).view(r, heads, t, d)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
