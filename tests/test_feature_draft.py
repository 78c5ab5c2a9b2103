"""Feature drafts (EAGLE-style): the row store feeds them the right hidden states, exactness holds."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from helpers import EOS, chi_square_pvalue, exact_target, run_rows
from tiny import llama, tokenizer

from smcsd_ppl import SMCSD, SMCConfig
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.config import SMCConfig as Config
from smcsd_ppl.inference.blocks import BlockRequest
from smcsd_ppl.inference.drafting import draft_blocks, generator_draws
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.methods.sd import speculative_sampling
from smcsd_ppl.models import LoadedModel
from smcsd_ppl.models.feature_draft import FeatureDraft, feature_student, final_hidden

PROMPTS = [[5, 17, 33, 2, 250, 9, 11], [40, 41], [7, 8, 99]]
METHODS_WITH_A_DRAFT = ("smcsd", "sd", "easd", "minedraft")


def random_feature_draft(target, seed: int = 1, scale: float = 0.5) -> FeatureDraft:
    """An untrained feature draft whose hidden-state input matters (random, not small)."""
    torch.manual_seed(seed)
    draft = feature_student(target, [0])
    with torch.no_grad():
        draft.fc.weight.normal_(0.0, scale / draft.fc.weight.shape[1] ** 0.5)
    return draft.eval().requires_grad_(False)


def scratch_logq(target, draft, seq, block, temperature):
    """log q of each drafted token, recomputed without caches: the committed tokens go with
    the target's states, each drafted token with the draft's own predicted state."""
    with torch.inference_mode():
        ids = torch.tensor([seq])
        states = final_hidden(target, ids, torch.ones_like(ids))[0]
        feats = torch.cat([torch.zeros(1, states.shape[1]), states[:-1]])
        out = []
        for d in block:
            hidden = draft.predict_hidden(ids, feats[None])[0]
            logq = torch.log_softmax(draft.get_output_embeddings()(hidden[-1]) / temperature, -1)
            out.append(float(logq[d]))
            ids = torch.cat([ids, torch.tensor([[d]])], 1)
            feats = torch.cat([feats, hidden[-1:]])
        return torch.tensor(out)


def test_hidden_states_kept_without_changing_logits():
    model = llama(seed=0, layers=3)
    plain, keeping = HFBatchedLM(model), HFBatchedLM(model)
    keeping.keep_hidden_states()
    torch.testing.assert_close(plain.prefill(PROMPTS), keeping.prefill(PROMPTS))
    step = torch.tensor([[3, 4], [5, 6], [7, 8]])
    valid = torch.tensor([[True, True], [False, True], [True, False]])
    torch.testing.assert_close(plain.extend(step, valid), keeping.extend(step, valid))
    assert plain.hidden is None and keeping.hidden.shape == (3, 2, 64)
    seq = PROMPTS[0] + [3, 4]
    ids = torch.tensor([seq])
    expect = final_hidden(model, ids, torch.ones_like(ids))[0, -2:]
    torch.testing.assert_close(keeping.hidden[0], expect, atol=1e-4, rtol=1e-4)


def test_feature_backend_refuses_missing_or_stray_states():
    model = llama(seed=0, layers=2)
    draft = HFBatchedLM(random_feature_draft(model))
    with pytest.raises(ValueError, match="needs the target's hidden states"):
        draft.prefill(PROMPTS)
    with pytest.raises(ValueError, match="takes no hidden states"):
        HFBatchedLM(model).prefill(PROMPTS[:1], [torch.zeros(len(PROMPTS[0]), 64)])


@pytest.mark.parametrize("block_size", [1, 3])
def test_drafted_q_is_the_drafts_q_given_the_targets_states(block_size):
    # Through commits of every kept length (0..K), a fork and a repeated row, each drafted
    # token's log q must equal a from-scratch forward with the true states of committed
    # tokens and the draft's own states inside the block.
    target = llama(seed=0, layers=3)
    draft = random_feature_draft(target)
    t_d = 0.9
    store = RowStore(HFBatchedLM(target), HFBatchedLM(draft))
    logits = store.start(PROMPTS, [0, 0, 1, 1, 2, 2])
    x0 = logits.argmax(-1).tolist()  # one first token per row
    store.queue({r: [x] for r, x in enumerate(x0)})
    seqs = [list(PROMPTS[r // 2]) + [x0[r]] for r in range(6)]
    g, g_draft = torch.Generator().manual_seed(0), torch.Generator().manual_seed(3)
    for cycle in range(4):
        requests = [BlockRequest(r, 60) for r in range(store.n_rows)]
        draws = generator_draws(g_draft, store.n_rows, store.device)
        blocks = draft_blocks(store, requests, block_size=block_size, temperature=t_d, eos=set(), draws=draws)
        for b in blocks:
            expect = scratch_logq(target, draft, seqs[b.row], b.tokens, t_d)
            torch.testing.assert_close(b.draft_logq, expect, atol=2e-4, rtol=1e-4)
        rows, tokens = [b.row for b in blocks], [b.tokens for b in blocks]
        _, states = store.score(rows, torch.tensor(tokens))
        kept = [(cycle + r) % (block_size + 1) for r in range(store.n_rows)]
        nexts = torch.randint(1, 300, (store.n_rows,), generator=g).tolist()
        store.commit(rows, tokens, kept, nexts, [b.fed for b in blocks], states)
        seqs = [s + b.tokens[:n] + [x] for s, b, n, x in zip(seqs, blocks, kept, nexts)]
        order = [1, 0, 3, 3, 5, 4] if cycle % 2 == 0 else list(range(6))
        store.fork(order)
        seqs = [list(seqs[r]) for r in order]


class _Enumerable:
    """``exact_target``'s view of a tiny HF model: next-token logits of a token list."""

    def __init__(self, model):
        self.model, self.vocab_size = model, model.config.vocab_size

    def next_logits(self, ids):
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0, -1].float()


def tiny_vocab_pair():
    target = llama(vocab_size=4, eos_token_id=EOS, seed=0, layers=2)
    with torch.no_grad():  # soften: the x25 head of `llama` is near-deterministic on 4 tokens
        target.lm_head.weight.mul_(0.08)
    return target, random_feature_draft(target, scale=2.0)


def test_sd_with_a_feature_draft_reproduces_the_target():
    target, draft = tiny_vocab_pair()
    runs, horizon = 3000, 4
    config = Config(
        block_size=2, max_new_tokens=horizon, draft_temperature=0.8, target_temperature=1.0, seed=1
    )
    out = speculative_sampling(
        RowStore(HFBatchedLM(target), HFBatchedLM(draft)), config, [EOS], [[1, 2]] * runs
    )
    exact, z = exact_target(_Enumerable(target), [1, 2], horizon)
    assert z == pytest.approx(1.0, abs=1e-5)
    assert sum(out.accepted) < sum(out.drafted)  # the draft differs: rejections happened
    assert chi_square_pvalue(Counter(map(tuple, out.token_ids)), exact) > 1e-3


def test_smcsd_with_a_feature_draft_is_properly_weighted():
    # E[Z_hat * sum_i W_i f(y_i)] = Z * E_target[f] for any N. Checked for f = 1 (log Z
    # unbiased), the first token and the length, each within 4 standard errors.
    target, draft = tiny_vocab_pair()
    runs, horizon = 1500, 4
    config = Config(
        n_particles=3,
        block_size=2,
        max_new_tokens=horizon,
        draft_temperature=1.0,
        target_temperature=1.0,
        ess_threshold=0.7,
        seed=3,
        cut=None,
    )
    store = RowStore(HFBatchedLM(target), HFBatchedLM(draft))
    results = run_rows([SMCSDModel([1, 2]) for _ in range(runs)], store, config, [EOS])
    assert sum(r.smc.n_resamples for r in results) > 0
    exact, z = exact_target(_Enumerable(target), [1, 2], horizon)
    tests = {"one": lambda y: 1.0, "length": len} | {
        f"first={v}": (lambda y, v=v: float(y[0] == v)) for v in range(4)
    }
    for name, f in tests.items():
        per_run = torch.tensor(
            [
                math.exp(r.smc.log_z)
                * sum(
                    w * f(p.token_ids)
                    for p, w in zip(
                        r.smc.particles,
                        torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles]), 0).tolist(),
                    )
                )
                for r in results
            ],
            dtype=torch.float64,
        )
        expect = sum(v * f(k) for k, v in exact.items())
        stderr = float(per_run.std() / math.sqrt(runs))
        assert abs(float(per_run.mean()) - expect) < 4 * stderr, (name, float(per_run.mean()), expect, stderr)


def test_every_method_runs_with_a_feature_draft():
    target = LoadedModel(llama(seed=0, layers=3), tokenizer(), "tiny-target", "random init")
    draft = LoadedModel(random_feature_draft(target.model), target.tokenizer, "feature", "random init")
    pair = SMCSD(target, draft)
    config = SMCConfig(n_particles=3, block_size=3, max_new_tokens=10, seed=1)
    assert pair.rows().reads_hidden
    for method in METHODS_WITH_A_DRAFT:
        out = pair.generate("The quick brown fox", method=method, config=config)
        assert 0 < len(out.token_ids) <= 10, method
    with pytest.raises(ValueError, match="reads the target's hidden states"):
        pair.generate(
            "The quick brown fox", method="hf_assisted", config=dataclasses.replace(config, n_particles=1)
        )


def test_a_feature_draft_known_not_to_pay_decodes_alone():
    # The pair's record says the draft does not pay: requests start without even prefilling it,
    # and committing blocks must leave the unprefilled feature draft's bookkeeping alone.
    target = LoadedModel(llama(seed=0, layers=3), tokenizer(), "tiny-target", "random init")
    draft = LoadedModel(random_feature_draft(target.model), target.tokenizer, "feature", "random init")
    pair = SMCSD(target, draft)
    pair.draft_record = DraftRecord(passed=0.0, failed=50.0)
    config = SMCConfig(n_particles=3, block_size=3, max_new_tokens=10, seed=1, cut=0.3)
    out = pair.generate("The quick brown fox", config=config)
    assert 0 < len(out.token_ids) <= 10 and not any(out.smc.draft_lengths)
    assert pair.draft_lm.stats.calls == 0  # never prefilled
