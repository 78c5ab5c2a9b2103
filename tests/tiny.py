"""Tiny offline models for fast tests: a byte-level BPE tokenizer and random-weight Llamas.

Everything here is built in code (no hub, no files) in well under a second. The
models are random, so only structural properties (equal logits, shapes, counts,
errors) may be judged on them, never output quality.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from smcsd_ppl.models import LoadedModel

EOT = "<|endoftext|>"
MAX_POSITIONS = 128

TEXT = """\
The quick brown fox jumps over the lazy dog. A small model reads a short story
about a cat who sat on the mat and looked at the moon. Once upon a time there was
a little girl who lived in a village near the forest. Every morning she walked to
the river to fetch water, and every evening she told her grandmother what she saw.
The sun rises in the east and sets in the west. Rain falls, rivers run to the sea,
and the wind carries the seeds of trees across the hills. Numbers like 1, 2, 3 and
42 appear in text too, as do questions: what is the capital of France? It is Paris.
"""

OTHER_TEXT = """\
def main():
    for i in range(10):
        print(i * i)
    return {"key": [1, 2, 3], "value": None}

class Stack:
    def push(self, item): self.items.append(item)
    def pop(self): return self.items.pop()
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;
"""


@functools.cache
def tokenizer(text: str = TEXT, vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``text`` (every byte encodable)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT)


def other_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer trained on different text: a different vocabulary."""
    return tokenizer(OTHER_TEXT, 290)


def llama(
    vocab_size: int | None = None,
    *,
    seed: int = 0,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    eos_token_id: int | None = None,
    eos_bias: float = 0.0,
) -> LlamaForCausalLM:
    """A random-weight Llama (hidden 64, 4 heads, 2 KV heads) in eval mode.

    ``eos_bias`` adds a constant to the EOS logit, to make EOS frequent.
    """
    tok = tokenizer()
    vocab_size = vocab_size or len(tok)
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Default init (std 0.02) gives nearly uniform next-token distributions; widen the
    # output layer so logits differ visibly between positions and models.
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        if eos_bias:
            head = torch.nn.Linear(config.hidden_size, vocab_size, bias=True)
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[eos] = eos_bias
            model.lm_head = head
    model.generation_config.eos_token_id = eos
    return model.to(dtype).eval().requires_grad_(False)


def pair(
    *, dtype: torch.dtype = torch.float32, eos_bias: float = 0.0, draft_eos_bias: float | None = None
) -> tuple[LoadedModel, LoadedModel]:
    """A target (3 layers) and a draft (a different random 2-layer model), one tokenizer.

    ``draft_eos_bias`` defaults to ``eos_bias``.
    """
    tok = tokenizer()
    draft_eos_bias = eos_bias if draft_eos_bias is None else draft_eos_bias
    target = LoadedModel(
        llama(seed=0, layers=3, dtype=dtype, eos_bias=eos_bias), tok, "tiny-target", "random init"
    )
    draft = LoadedModel(
        llama(seed=1, layers=2, dtype=dtype, eos_bias=draft_eos_bias), tok, "tiny-draft", "random init"
    )
    return target, draft


def mismatched_draft() -> LoadedModel:
    """A draft with a tokenizer trained on other text (a different vocabulary)."""
    tok = other_tokenizer()
    return LoadedModel(
        llama(len(tok), seed=2, eos_token_id=tok.eos_token_id), tok, "tiny-other", "random init"
    )


def smcsd_pair():
    """``SMCSD`` over the tiny pair: a factory an engine process can call (``PairSpec(factory=...)``)."""
    from smcsd_ppl.api import SMCSD

    return SMCSD(*pair())
