"""A Llama forward with static shapes over a preallocated KV arena: the compiled engine's model.

The eager backend (``backends.hf``) sizes every forward by the rows and tokens it is given,
so each forward is a new shape and, on an accelerator, hundreds of kernel launches. Here a
model's state is an arena ``[layers, rows, kv_heads, capacity, head_dim]`` allocated once per
(row bucket, capacity bucket); each row's length lives on the device; a forward of T tokens per
row writes them after each row's last real token and reads the whole capacity through a mask
built from the lengths. Nothing is read back to the host and no shape depends on data, so a
forward, or a whole decoding cycle around it, can be compiled (``torch.compile``) or captured
(CUDA graphs) once per bucket.

The decoder's own weights, norms and rotary embedding are used as they are; attention and its
cache are ours, and every product goes through ``backends.products.linear``, which on a CPU picks
its order by the graph's shape. Llama-family models only (SmolLM2, Llama 3.x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from .base import to_device
from .kv import plan
from .products import linear

CAPACITY_STEP = 256  # arena capacities are multiples of this: one compiled graph per bucket
SUPPORTED = ("llama",)


def capacity_bucket(columns: int, max_length: int) -> int:
    """The arena capacity for ``columns`` positions per row: the next multiple of ``CAPACITY_STEP``."""
    if columns > max_length:
        raise ValueError(f"{columns} positions per row pass the model's context of {max_length}")
    return min(max_length, -(-columns // CAPACITY_STEP) * CAPACITY_STEP)


@dataclass
class Arena:
    """One model's KV state for R rows: per layer keys and values ``[R, Hkv, C, D]``; lengths ``[R]``.

    One tensor per layer, not one for all: a compiled graph writing a slice of one big tensor
    copies the whole of it per layer (measured: 18 ms a token on the embedded target).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor

    @property
    def capacity(self) -> int:
        """Positions each row can hold."""
        return self.keys[0].shape[2]

    def flat(self) -> tuple[torch.Tensor, ...]:
        """Every tensor, as a graph takes them: keys, values, then the lengths."""
        return (*self.keys, *self.values, self.lengths)

    @classmethod
    def of(cls, flat: tuple[torch.Tensor, ...]) -> Arena:
        """The arena of ``flat()``'s tensors."""
        n = (len(flat) - 1) // 2
        return cls(list(flat[:n]), list(flat[n : 2 * n]), flat[-1])

    def rows(self, span: slice) -> Arena:
        """The arena of the rows in ``span`` (views: writes land in this arena)."""
        return Arena([t[span] for t in self.keys], [t[span] for t in self.values], self.lengths[span])

    def move_rows_(self, ancestors: Sequence[int]) -> None:
        """Row i becomes a copy of row ``ancestors[i]`` (host indices), copying only the rows that change."""
        moved = [(d, a) for d, a in enumerate(ancestors) if d != a]
        if not moved:
            return
        dest = to_device(torch.tensor([d for d, _ in moved]), self.lengths.device)
        src = to_device(torch.tensor([a for _, a in moved]), self.lengths.device)
        for t in (*self.keys, *self.values, self.lengths):
            t.index_copy_(0, dest, t.index_select(0, src))

    def gather_(self, ancestors: torch.Tensor) -> None:
        """Row i becomes a copy of row ``ancestors[i]`` (in place: the buffers keep their addresses)."""
        for t in (*self.keys, *self.values):
            t.copy_(t.index_select(0, ancestors))
        self.lengths.copy_(self.lengths.index_select(0, ancestors))


class StaticLlama:
    """A Hugging Face Llama run with static shapes over an ``Arena``.

    Args:
        model: a ``LlamaForCausalLM`` in eval mode (any device and dtype).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise ValueError(
                f"the compiled engine runs Llama-family models only, not {cfg.model_type!r}: "
                "use --engine eager"
            )
        self.model = model
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = self.head.weight.shape[0]
        self.max_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if self.n_kv != self.n_heads and _torch_version() < (2, 5):
            raise ValueError(
                "the compiled engine needs torch >= 2.5 (grouped-query attention): use --engine eager"
            )

    def arena(self, rows: int, capacity: int) -> Arena:
        """A zeroed arena of ``rows`` rows of ``capacity`` positions (zeros: masked columns stay finite)."""
        shape = (rows, self.n_kv, capacity, self.head_dim)

        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

        return Arena(zeros(), zeros(), torch.zeros(rows, dtype=torch.long, device=self.device))

    def forward(
        self,
        arena: Arena,
        tokens: torch.Tensor,  # [R, T]
        valid: torch.Tensor,  # [R, T] False = hole: written, never seen, overwritten later
        last_only: bool = False,
    ) -> torch.Tensor:
        """Write ``tokens`` after each row's real tokens; float32 logits ``[R, T or 1, V]``.

        The arena's lengths move on by each row's real tokens. No host read, no data-dependent
        shape: the same call at the same shapes is the same graph.
        """
        r, t = tokens.shape
        dest, positions, allowed = plan(arena.lengths, valid, arena.capacity)  # [R,T], [R,T], [R,1,T,C]
        h = self.decoder.embed_tokens(tokens)
        cos, sin = self.decoder.rotary_emb(h, positions)
        rows = torch.arange(r, device=tokens.device)[:, None]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer, i, h, (cos, sin), arena, (rows, dest), allowed)
            h = h + _mlp(layer.mlp, layer.post_attention_layernorm(h))
        arena.lengths.add_(valid.sum(1))
        h = self.decoder.norm(h[:, -1:] if last_only else h)
        return linear(self.head, h).float()

    def _attention(self, layer, i, h, rope, arena: Arena, at, allowed) -> torch.Tensor:
        """Layer ``i``'s attention: new keys and values written to the arena, all columns read.

        ``rope``: the rotary (cos, sin) of the positions; ``at``: the (rows, columns) written.
        """
        attn = layer.self_attn
        (cos, sin), (rows, dest) = rope, at
        r, t, _ = h.shape
        x = layer.input_layernorm(h)
        q = linear(attn.q_proj, x).view(r, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = linear(attn.k_proj, x).view(r, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = linear(attn.v_proj, x).view(r, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = arena.keys[i], arena.values[i]  # [R, Hkv, C, D]
        keys.transpose(1, 2).index_put_((rows, dest), k.transpose(1, 2))
        values.transpose(1, 2).index_put_((rows, dest), v.transpose(1, 2))
        if h.is_cpu and h.dtype != torch.float32:
            out = _attend(q, keys, values, allowed, attn.scaling)
        else:
            out = scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=attn.scaling, enable_gqa=self.n_kv != self.n_heads
            )
        return linear(attn.o_proj, out.transpose(1, 2).reshape(r, t, self.n_heads * self.head_dim))


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float):
    """Attention as three products: ``q [R, H, T, D]``, ``keys [R, Hkv, C, D]``, ``allowed [R, 1, T, C]``.

    For a CPU in bf16, where torch's fused kernel is several times slower for a few query
    tokens per row, with the same error against float32 (docs/benchmarks.md, "The static path").
    """
    r, heads, t, d = q.shape
    kv, columns = keys.shape[1], keys.shape[2]
    group = heads // kv  # query heads per key head, read together
    scores = (q.reshape(r, kv, group * t, d) @ keys.transpose(-1, -2)) * scale
    scores = scores.view(r, kv, group, t, columns).masked_fill(~allowed[:, :, None], -torch.inf)
    weights = torch.softmax(scores, -1).view(r, kv, group * t, columns)
    return (weights @ values).view(r, heads, t, d)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama MLP, its products in the order ``products.linear`` picks for their shape."""
    return linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x [R, H, T, D]`` with ``cos, sin [R, T, D]`` (Llama's half split)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin
