"""Both libraries on one mock model: our ``CachedCausalLM`` over the mock pair, and the
same mock target as LLaMPPL's language model, so one program can run on each."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch
from helpers import EOS, mock_pair

from smcsd_ppl.config import DraftRecord
from smcsd_ppl.engine.client import Engine
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.llamppl import CachedCausalLM

STRINGS = ["ab", " cde", "xyz", "</s>"]  # token 3 is EOS, as in the mock's exact tests


class MockTokenizer:
    """The four mock tokens as text."""

    eos_token_id = EOS
    all_special_ids = [EOS]

    def __init__(self, strings):
        self.strings = strings
        self.vocab_size = len(strings)

    @property
    def eos_token(self):
        return self.strings[EOS]

    def convert_ids_to_tokens(self, i):
        return self.strings[i]

    def decode(self, ids):
        return "".join(self.strings[i] for i in ids)

    def batch_decode(self, ids, **kwargs):
        return [self.strings[i[0]] for i in ids]


class MockPair:
    """What ``CachedCausalLM`` needs of a pair, over the mock target and draft."""

    def __init__(self, target, draft, strings):
        self.target_lm, self.draft_lm = target, draft
        self.tokenizer, self.eos_token_ids = MockTokenizer(strings), [EOS]
        self.draft_record, self.store = DraftRecord(), RowStore(target, draft)
        self.engine = Engine.over(self.store, [EOS], decode=self.decode)

    def rows(self):
        return self.store

    def call(self, fn):
        return fn()  # a mock's forwards are table lookups: the caller's thread does

    def decode(self, ids):
        return "".join(self.tokenizer.strings[i] for i in ids if i != EOS)


def mock_lm(strings=STRINGS) -> CachedCausalLM:
    """Our language model over the mock pair."""
    return CachedCausalLM(MockPair(*mock_pair(), strings))


class TheirMockLM:
    """The mock target as LLaMPPL's ``LMContext`` reads a language model (prompts are token ids)."""

    def __init__(self, target, strings=STRINGS):
        self.target = target
        self.str_vocab = list(strings)
        self.tokenizer = SimpleNamespace(
            encode=lambda prompt: [int(t) for t in prompt],
            decode=lambda ids: "".join(strings[i] for i in ids),
            eos_token_id=EOS,
            eos_token=strings[EOS],
            vocab_size=len(strings),
            convert_ids_to_tokens=lambda i: strings[i],
        )
        self.masks = SimpleNamespace(ALL_TOKENS=set(range(len(strings))))

    def next_token_logprobs_unbatched(self, token_ids):
        return torch.log_softmax(self.target.next_logits(list(token_ids)).float(), -1).numpy()

    async def next_token_logprobs(self, token_ids):
        await asyncio.sleep(0)  # as a batching LM does: every other particle runs up to its own call
        return self.next_token_logprobs_unbatched(token_ids)

    def __deepcopy__(self, memo):
        return self
