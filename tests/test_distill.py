"""Distillation on tiny models: data collection, training, resume, saved drafts, metrics, CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tiny import TEXT, llama, tokenizer

from smcsd_ppl import SMCSD, SMCConfig
from smcsd_ppl.cli import main
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.distill import (
    CollectSettings,
    DistillConfig,
    collect,
    distill,
    forward_cost,
    load_examples,
    match_metrics,
    smc_metrics,
)
from smcsd_ppl.distill.data import greedy_examples
from smcsd_ppl.models import LoadedModel
from smcsd_ppl.models.drafts import MANIFEST, draft_modules, is_draft_dir, load_draft, resolve_draft, student
from smcsd_ppl.models.feature_draft import feature_student
from smcsd_ppl.text import encode_prompt

PROMPTS = [line.strip() for line in TEXT.splitlines() if line.strip()]


def target() -> LoadedModel:
    return LoadedModel(llama(seed=0, layers=4), tokenizer(), "tiny-target", "random init")


def prompt_ids(lm: LoadedModel) -> list[list[int]]:
    return [encode_prompt(lm.tokenizer, p)[:12] for p in PROMPTS]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    lm = target()
    out = tmp_path_factory.mktemp("data")
    eos = [lm.tokenizer.eos_token_id]
    settings = CollectSettings(max_new_tokens=10, temperature=1.0, top_k=8, batch_size=3)
    collect(lm.model, prompt_ids(lm), out, eos_ids=eos, settings=settings)
    return out


# What the shipped draft must keep reaching on a slice of the short-answer task: measured 0.27
# agreement there (0.31 / 0.29 on the whole task, docs/draft-model-card.md), while its untrained
# start (the target's layers 0-3) gets about 0.05; below these the shipped weights are broken.
AGREEMENT_FLOOR, ACCEPTANCE_FLOOR = 0.20, 0.20

CONFIG = DistillConfig(layers=2, steps=6, batch_tokens=64, lr=3e-3, warmup=1, save_every=3, eval_every=3)


def own_weights(draft_dir) -> dict[str, torch.Tensor]:
    modules = draft_modules(load_draft(draft_dir, target()).model)
    return {f"{name}.{k}": v for name, m in modules.items() for k, v in m.state_dict().items()}


def test_collect_writes_shards_with_topk(data):
    examples = load_examples(data)
    assert len(examples) == len(PROMPTS)
    for e in examples:
        assert 0 < e.start < len(e.ids) <= 12 + 10
        assert e.top_ids.shape == e.top_logp.shape == (len(e.ids) - 1, 8)
        assert bool((e.top_logp[:, :-1] >= e.top_logp[:, 1:]).all())  # sorted, most likely first
        assert bool((e.top_logp <= 0).all())


def test_collect_resumes_and_refuses_other_settings(data, tmp_path):
    lm = target()
    eos = [lm.tokenizer.eos_token_id]
    settings = CollectSettings(max_new_tokens=10, temperature=1.0, top_k=8, batch_size=3)
    kwargs = dict(eos_ids=eos, settings=settings)
    for shard in data.glob("shard-*.pt"):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    (tmp_path / "meta.json").write_text((data / "meta.json").read_text())
    (tmp_path / "shard-00001.pt").unlink()  # as if killed before this shard was written
    collect(lm.model, prompt_ids(lm), tmp_path, **kwargs)
    redone, original = load_examples(tmp_path), load_examples(data)
    assert all(
        torch.equal(a.ids, b.ids) and torch.equal(a.top_ids, b.top_ids) for a, b in zip(redone, original)
    )
    with pytest.raises(ValueError, match="other max_new_tokens"):
        shorter = dataclasses.replace(settings, max_new_tokens=5)
        collect(lm.model, prompt_ids(lm), tmp_path, eos_ids=eos, settings=shorter)


@pytest.mark.parametrize("kind", ["layers", "features"])
def test_distill_resumes_exactly_after_interruption(data, tmp_path, kind):
    lm, train = target(), load_examples(data)
    config = dataclasses.replace(CONFIG, kind=kind)
    whole = distill(lm, train, tmp_path / "whole", config, held_out=train[:2])

    def stop_after_4(p):
        if p.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(lm, train, tmp_path / "cut", config, held_out=train[:2], on_progress=stop_after_4)
    # the checkpoint of step 3 is on disk; the resumed run redoes step 4 and goes on to 6
    resumed = distill(lm, train, tmp_path / "cut", config, held_out=train[:2])
    a, b = own_weights(whole), own_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 3, 6]  # the lines after the checkpoint were dropped, then redone
    assert {"agreement", "acceptance_T1", "tokens"} <= set(log[-1])
    manifest = json.loads((resumed / MANIFEST).read_text())
    assert manifest["trained"]["steps"] == 6 and manifest["kind"] == kind
    assert manifest["source_layers"] == [0, 1]


def test_resume_with_other_settings_is_refused(data, tmp_path):
    lm, train = target(), load_examples(data)
    distill(lm, train, tmp_path, DistillConfig(layers=2, steps=3, batch_tokens=64, save_every=3))
    with pytest.raises(ValueError, match="other settings"):
        distill(lm, train, tmp_path, DistillConfig(layers=2, steps=3, batch_tokens=64, save_every=3, lr=1e-3))


@pytest.mark.parametrize("kind", ["layers", "features"])
def test_training_reduces_the_loss_and_raises_agreement(data, tmp_path, kind):
    lm, train = target(), load_examples(data)
    start = student(lm, [0, 1]) if kind == "layers" else feature_student(lm.model, [0, 1])
    before = match_metrics(lm.model, start.eval(), train)
    config = DistillConfig(
        kind=kind, layers=2, steps=60, batch_tokens=128, lr=3e-3, warmup=2, save_every=60, eval_every=60
    )
    losses = []
    distill(lm, train, tmp_path, config, on_progress=lambda p: losses.append(p.loss))
    after = match_metrics(lm.model, load_draft(tmp_path / "draft", lm).model, train)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert after["agreement"] > before["agreement"] and after["acceptance_T1"] > before["acceptance_T1"]


def test_match_metrics_of_the_target_itself_are_one_and_cost_is_timed():
    lm = target()
    examples = greedy_examples(
        lm.model, prompt_ids(lm)[:3], eos_ids=[lm.tokenizer.eos_token_id], max_new_tokens=6
    )
    m = match_metrics(lm.model, lm.model, examples)
    assert m["agreement"] == 1.0 and m["acceptance_T1"] == pytest.approx(1.0) and m["positions"] > 0
    other = match_metrics(lm.model, llama(seed=5, layers=1), examples)
    assert other["acceptance_T1"] < 0.99
    for draft in (student(lm, [0]), feature_student(lm.model, [0, 1])):
        cost = forward_cost(lm.model, draft.eval(), context=16, repeats=3)
        assert (
            cost["draft_ms"] > 0
            and cost["target_ms"] > 0
            and cost["ratio"] == cost["draft_ms"] / cost["target_ms"]
        )


def test_saved_draft_loads_and_runs_sd_smcsd(data, tmp_path):
    lm, train = target(), load_examples(data)
    draft_dir = distill(lm, train, tmp_path, DistillConfig(layers=2, steps=2, batch_tokens=64, save_every=2))
    assert is_draft_dir(draft_dir)
    draft = resolve_draft(str(draft_dir), lm, device="cpu", dtype="fp32")
    assert draft.model.model.embed_tokens is lm.model.model.embed_tokens  # shared, not shipped
    assert not any(p.requires_grad for p in draft.model.parameters())
    size = sum(f.stat().st_size for f in draft_dir.iterdir())
    assert (
        size < sum(p.numel() for p in draft.model.model.layers.parameters()) * 2 + 10_000
    )  # bf16 layers only
    pair = SMCSD(lm, draft)
    config = SMCConfig(n_particles=3, block_size=3, max_new_tokens=8, seed=1)
    for method in ("smcsd", "sd"):
        out = pair.generate(PROMPTS[0], method=method, config=config)
        assert 0 < len(out.token_ids) <= 8


def test_draft_for_another_target_is_refused(data, tmp_path):
    lm, train = target(), load_examples(data)
    draft_dir = distill(lm, train, tmp_path, DistillConfig(layers=1, steps=1, batch_tokens=64, save_every=1))
    wider = LoadedModel(llama(seed=0, layers=2, vocab_size=len(tokenizer()) + 5), tokenizer(), "other", "x")
    with pytest.raises(ValueError, match="was distilled for"):
        load_draft(draft_dir, wider)
    with pytest.raises(ValueError, match="does not hold a readable distilled draft"):
        load_draft(tmp_path / "nowhere", lm)


@pytest.mark.parametrize("bad", [{"layers": 0}, {"steps": 0}, {"lr": float("nan")}, {"warmup": -1}])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        DistillConfig(**bad)


def test_draft_as_deep_as_the_target_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="no smaller than the target"):
        distill(target(), load_examples(data), tmp_path, DistillConfig(layers=4, steps=1))


def test_cli_distill_resume_and_eval_draft(tmp_path, capsys):
    lm = target()
    model_dir = tmp_path / "target"
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "c"}) + "\n" for p in PROMPTS))
    out = tmp_path / "run"
    args = [
        "distill",
        "--target",
        str(model_dir),
        "--dtype",
        "fp32",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
    ]
    args += ["--gen-tokens", "6", "--gen-batch", "4", "--top-k", "4", "--layers", "1", "--steps", "4"]
    args += ["--batch-tokens", "64", "--save-every", "2", "--eval-prompts", str(prompts), "--eval-limit", "2"]
    assert main(args) == 0
    assert (out / "curve.png").stat().st_size > 1000
    first = own_weights_of(out / "draft", model_dir)
    assert main(args) == 0  # a finished run resumes to the same draft without redoing anything
    assert torch.equal(first, own_weights_of(out / "draft", model_dir))
    assert (
        main(
            ["eval-draft", "--target", str(model_dir), "--dtype", "fp32", "--draft", str(out / "draft")]
            + ["--prompts", str(prompts), "--max-new-tokens", "4", "--json", "--limit", "2"]
        )
        == 0
    )
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["prompts"] == 2  # --limit counts all prompts
    # distill recorded its training prompts in the draft, so measuring on them warns
    assert "warning: 2 of these 2 prompts are in the draft's training data" in captured.err
    # The command measures what the library measures on the same prompts, models and greedy tokens.
    pair = SMCSD.load(str(model_dir), str(out / "draft"), dtype="fp32")
    examples = greedy_examples(
        pair.target.model,
        [pair.encode(p) for p in PROMPTS[:2]],
        eos_ids=pair.eos_token_ids,
        max_new_tokens=4,
    )
    want = match_metrics(pair.target.model, pair.draft.model, examples)
    assert result["positions"] == want["positions"] > 0
    for key in ("agreement", "acceptance_T1", "acceptance_T0.7", "pass_T1", "pass_T0.7"):
        assert result[key] == pytest.approx(want[key], abs=1e-6), key
    assert result["cost_ratio"] == pytest.approx(result["cost_draft_ms"] / result["cost_target_ms"])
    # SMC-SD with the draft proposing, default settings, the same budget: what the library measures
    smc = smc_metrics(pair, PROMPTS[:2], SMCConfig(max_new_tokens=4, proposal="draft"))
    assert {k: v for k, v in result.items() if k.startswith("smc_")} == smc
    assert smc["smc_tokens_per_target_call"] > 0 and smc["smc_cycles"] >= 2
    # --save-record writes the pooled evidence into the manifest; a loaded pair then starts from it.
    save = ["eval-draft", "--target", str(model_dir), "--dtype", "fp32", "--draft", str(out / "draft")]
    save += ["--prompts", str(prompts), "--max-new-tokens", "4", "--json", "--limit", "2", "--save-record"]
    assert main(save) == 0
    record = DraftRecord.from_json(json.loads((out / "draft" / MANIFEST).read_text())["record"])
    assert (record.passed, record.failed, record.row_cost) == (smc["smc_passed"], smc["smc_failed"], 0.05)
    assert SMCSD.load(str(model_dir), str(out / "draft"), dtype="fp32").draft_record == record
    assert main(save) == 0  # measured from nothing again, not from the record it wrote
    assert DraftRecord.from_json(json.loads((out / "draft" / MANIFEST).read_text())["record"]) == record
    manifest = json.loads((out / "draft" / MANIFEST).read_text())
    (out / "draft" / MANIFEST).write_text(json.dumps(manifest | {"record": {"passed": "many"}}))
    with pytest.raises(ValueError, match="ships a bad draft record"):
        SMCSD.load(str(model_dir), str(out / "draft"), dtype="fp32")
    tuned = tmp_path / "tuned"
    chi2 = [*args[: args.index("--out")], "--out", str(tuned), *args[args.index("--out") + 2 :]]
    assert main([*chi2, "--objective", "chi2", "--objective-temperature", "0.7", "--cut", "0.4"]) == 0
    recorded = json.loads((tuned / "draft" / MANIFEST).read_text())["config"]
    assert (recorded["objective"], recorded["objective_temperature"], recorded["cut"]) == ("chi2", 0.7, 0.4)


def own_weights_of(draft_dir, model_dir) -> torch.Tensor:
    from smcsd_ppl.models import load_model

    lm = load_model(str(model_dir), dtype="fp32")
    return torch.cat([p.flatten() for p in load_draft(draft_dir, lm).model.model.layers.parameters()])


@pytest.mark.slow
def test_shipped_default_draft_is_small_loaded_by_default_and_agrees_with_the_target():
    from smcsd_ppl.batch import load_prompts
    from smcsd_ppl.models.drafts import SHIPPED_DRAFT, WEIGHTS

    assert (SHIPPED_DRAFT / WEIGHTS).stat().st_size <= 40 * 2**20
    pair = SMCSD.load()
    assert pair.draft.source.startswith("distilled draft") and not pair.draft.is_slice
    texts = [p.text for p in load_prompts("short_answer")[::16]]
    examples = greedy_examples(
        pair.target.model, [pair.encode(t) for t in texts], eos_ids=pair.eos_token_ids, max_new_tokens=24
    )
    metrics = match_metrics(pair.target.model, pair.draft.model, examples)
    assert metrics["agreement"] >= AGREEMENT_FLOOR and metrics["acceptance_T1"] >= ACCEPTANCE_FLOOR


def test_eval_draft_defaults_to_held_out_prompts_and_honours_limit(tmp_path, capsys):
    lm = target()
    model_dir = tmp_path / "target"
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    argv = ["eval-draft", "--target", str(model_dir), "--dtype", "fp32", "--draft", "layers:1"]
    assert main([*argv, "--limit", "3", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] == 3
    assert main([*argv, "--limit", "1", "--save-record"]) == 2  # a layer slice has no manifest
    assert "not one" in capsys.readouterr().err


def test_a_pair_starts_from_the_record_it_is_given_shipped_none_or_a_file(tmp_path):
    from smcsd_ppl.cli.loading import draft_record

    lm = target()
    lm.model.save_pretrained(tmp_path / "target")
    lm.tokenizer.save_pretrained(tmp_path / "target")
    record = DraftRecord(3.0, 1.0, row_cost=0.05)
    (tmp_path / "record.json").write_text(json.dumps(record.as_json()))
    assert draft_record("shipped") is None and draft_record("none") == DraftRecord()
    assert draft_record(str(tmp_path / "record.json")) == record
    given = SMCSD.load(str(tmp_path / "target"), "layers:1", dtype="fp32", draft_record=record)
    assert given.draft_record == record
    assert SMCSD.load(str(tmp_path / "target"), "layers:1", dtype="fp32").draft_record == DraftRecord()


def test_shipped_draft_knows_its_training_prompts():
    from smcsd_ppl.batch import load_prompts
    from smcsd_ppl.distill import builtin_prompts
    from smcsd_ppl.distill.overlap import training_overlap
    from smcsd_ppl.models.drafts import SHIPPED_DRAFT

    assert training_overlap(SHIPPED_DRAFT, builtin_prompts()) > 500  # the builtin set is training data
    assert training_overlap(SHIPPED_DRAFT, [p.text for p in load_prompts("short_answer")]) == 0


# --- the weight objectives (distill/objectives.py) ---------------------------------------------


def bucketed(p: torch.Tensor, q: torch.Tensor, top_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full distributions [P, V] merged to their values at ``top_ids`` plus one bucket for the rest."""
    pt, qt = p.gather(1, top_ids), q.gather(1, top_ids)
    return torch.cat([pt, 1 - pt.sum(1, keepdim=True)], 1), torch.cat([qt, 1 - qt.sum(1, keepdim=True)], 1)


def chi2_direct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum p^2/q - 1 per row: the textbook formula, float64."""
    return (p.double() ** 2 / q.double()).sum(-1) - 1


def pair_logits(seed: int, rows: int = 5, vocab: int = 9, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale, torch.randn(rows, vocab, generator=gen) * scale


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_weight_objectives_equal_the_direct_formulas_on_the_whole_vocabulary(temperature):
    from smcsd_ppl.distill.objectives import weight_loss

    target_logits, draft_logits = pair_logits(0, scale=1.0)  # chi^2 under CHI2_CAP
    top_logp, top_ids = torch.log_softmax(target_logits, -1).topk(target_logits.shape[1], -1)  # k = V
    p = torch.softmax(target_logits / temperature, -1)
    q = torch.softmax(draft_logits / temperature, -1)
    chi2 = chi2_direct(p, q)
    got = weight_loss(draft_logits, top_ids, top_logp, "chi2", temperature=temperature, cut=None)
    assert float(got) == pytest.approx(float(chi2.mean()), rel=1e-5)
    got = weight_loss(draft_logits, top_ids, top_logp, "renyi2", temperature=temperature)
    assert float(got) == pytest.approx(float(chi2.log1p().mean()), rel=1e-5)


def test_the_target_tail_outside_the_top_k_is_one_bucket_on_both_sides():
    from smcsd_ppl.distill.objectives import weight_loss

    # The target keeps 30% of its mass outside its top 3, where the draft puts 1%: the
    # bucket's term 0.3^2 / 0.01 = 9 dominates.
    p = torch.tensor([[0.4, 0.2, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.39, 0.3, 0.3, 0.004, 0.003, 0.003]], dtype=torch.float64)
    top_ids = torch.tensor([[0, 1, 2]])
    top_logp = p.log().gather(1, top_ids)
    got = float(weight_loss(q.log().float(), top_ids, top_logp, "chi2", cut=None))
    want = float(chi2_direct(*bucketed(p, q, top_ids)))
    assert got == pytest.approx(want, rel=1e-5)
    # the mutants this value tells apart: no tail, the top-k renormalized, chi^2(q || p)
    no_tail = float((p[:, :3] ** 2 / q[:, :3]).sum() - 1)
    renormalized = float(chi2_direct(p[:, :3] / p[:, :3].sum(), q[:, :3] / q[:, :3].sum()))
    reversed_ = float(chi2_direct(*reversed(bucketed(p, q, top_ids))))
    assert min(abs(want - m) for m in (no_tail, renormalized, reversed_)) > 1.0
    # merging tokens can only lower chi^2: the bucket gives a lower bound of the full one
    assert want <= float(chi2_direct(p, q))


def test_at_any_temperature_the_bucket_is_exact_when_the_tails_have_one_shape():
    from smcsd_ppl.distill.objectives import weight_loss

    p = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.3, 0.05, 0.03, 0.02]], dtype=torch.float64)  # its tail: half p's
    top_ids = torch.tensor([[0, 1, 2]])
    for t in (1.0, 0.7, 0.3, 1.5):
        p_t, q_t = p ** (1 / t) / (p ** (1 / t)).sum(), q ** (1 / t) / (q ** (1 / t)).sum()
        got = weight_loss(
            q.log().float(), top_ids, p.log().gather(1, top_ids), "chi2", temperature=t, cut=None
        )
        assert float(got) == pytest.approx(float(chi2_direct(p_t, q_t)), rel=1e-4), t


def test_weight_objectives_vanish_exactly_where_the_draft_is_the_target():
    from smcsd_ppl.distill.objectives import weight_loss

    target_logits, draft_logits = pair_logits(1)
    top_logp, top_ids = torch.log_softmax(target_logits, -1).topk(4, -1)
    for name in ("chi2", "renyi2"):
        for t in (1.0, 0.6):
            same = weight_loss(target_logits, top_ids, top_logp, name, temperature=t, cut=None)
            other = weight_loss(draft_logits, top_ids, top_logp, name, temperature=t, cut=None)
            assert abs(float(same)) < 1e-5 and float(other) > 0.1, (name, t)
    # equal on the top-k but not in the tail: the bucket sees it
    in_top = torch.zeros_like(target_logits, dtype=torch.bool).scatter(1, top_ids, True)
    noise = torch.randn(target_logits.shape, generator=torch.Generator().manual_seed(3))
    tail_off = torch.where(in_top, target_logits, target_logits + 3 * noise)
    assert float(weight_loss(tail_off, top_ids, top_logp, "chi2", cut=None)) > 1e-3


@pytest.mark.parametrize("name", ["chi2", "renyi2"])
def test_the_gradient_raises_q_where_p_over_q_is_large(name):
    from smcsd_ppl.distill.objectives import weight_loss

    target_logits, draft_logits = pair_logits(2, rows=1, vocab=6)
    top_logp, top_ids = torch.log_softmax(target_logits, -1).topk(6, -1)
    p, q = torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)
    ratio = p / q
    worst = int(ratio.argmax())
    logits = draft_logits.clone().requires_grad_()
    loss = weight_loss(logits, top_ids, top_logp, name, cut=None)
    loss.backward()
    # the logit gradient is c (q - r), r ~ p^2/q: a logit rises exactly where p/q > sqrt(1 + chi^2)
    rises = ratio > (p**2 / q).sum().sqrt()
    assert torch.equal(logits.grad < 0, rises) and bool(rises[0, worst])
    stepped = (logits - 0.01 * logits.grad).detach()
    assert float(torch.softmax(stepped, -1)[0, worst]) > float(torch.softmax(draft_logits, -1)[0, worst])
    assert float(weight_loss(stepped, top_ids, top_logp, name, cut=None)) < float(loss.detach())


def test_chi2_counts_variance_where_the_cut_keeps_and_renyi2_where_it_cuts():
    from smcsd_ppl.distill.objectives import position_losses

    p = torch.tensor([[0.5, 0.3, 0.2], [0.8, 0.1, 0.1]])
    q = torch.tensor([[0.45, 0.3, 0.25], [0.1, 0.1, 0.8]])  # TV 0.05: kept; TV 0.7: cut
    chi2 = chi2_direct(p, q).float()
    got = position_losses(p.log(), q.log(), "chi2", cut=0.3)
    assert torch.allclose(got, torch.stack([chi2[0], chi2[1].log1p()]), rtol=1e-5)
    assert torch.allclose(position_losses(p.log(), q.log(), "chi2", cut=None), chi2, rtol=1e-5)
    assert torch.allclose(position_losses(p.log(), q.log(), "renyi2", cut=0.3), chi2.log1p(), rtol=1e-5)
    # Renyi-2 at a cut position: where the cut fires, chi^2 may not decide the step
    assert float(got[1]) < float(chi2[1])


def test_weight_objectives_stay_finite_where_the_draft_misses_the_target():
    from smcsd_ppl.distill.objectives import CHI2_CAP, chi2_of, weight_loss

    target_logits = torch.tensor([[8.0, 0.0, 0.0, 0.0, -5.0, -5.0]])
    draft_logits = torch.tensor([[-150.0, 30.0, 0.0, 0.0, 0.0, 0.0]]).requires_grad_()  # q ~ e^-180 there
    top_logp, top_ids = torch.log_softmax(target_logits, -1).topk(3, -1)
    for name in ("chi2", "renyi2"):
        loss = weight_loss(draft_logits, top_ids, top_logp, name, cut=None)
        (grad,) = torch.autograd.grad(loss, draft_logits)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()) and float(grad[0, 0]) < 0, name
    r = torch.tensor([0.5, float(torch.log1p(torch.tensor(CHI2_CAP))), 1000.0])
    chi2 = chi2_of(r)
    assert float(chi2[0]) == pytest.approx(float(torch.expm1(r[0])))
    assert float(chi2[1]) == pytest.approx(CHI2_CAP)
    assert torch.isfinite(chi2[2]) and float(chi2[2]) > CHI2_CAP


@pytest.mark.parametrize(
    "bad", [{"name": "kl2"}, {"temperature": 0.001}, {"temperature": float("nan")}, {"cut": 2.0}]
)
def test_bad_objectives_raise(bad):
    from smcsd_ppl.distill import Objective

    with pytest.raises(ValueError):
        Objective(**bad)
    renamed = {"name": "objective", "temperature": "objective_temperature"}
    settings = {renamed.get(k, k): v for k, v in bad.items()}
    with pytest.raises(ValueError):
        DistillConfig(**settings)


@pytest.mark.parametrize("objective", ["chi2", "renyi2"])
def test_weight_objectives_train_the_draft_toward_the_target(data, tmp_path, objective):
    from smcsd_ppl.distill import Objective
    from smcsd_ppl.distill.losses import kd_loss

    lm, train = target(), load_examples(data)
    start = student(lm, [0, 1]).eval()
    before = match_metrics(lm.model, start, train)
    config = DistillConfig(
        layers=2,
        steps=40,
        batch_tokens=128,
        lr=1e-3,
        warmup=2,
        save_every=40,
        eval_every=40,
        objective=objective,
    )
    draft_dir = distill(lm, train, tmp_path, config)
    draft = load_draft(draft_dir, lm).model
    after = match_metrics(lm.model, draft, train)
    with torch.no_grad():
        cost = {
            m: float(kd_loss(m, train, autocast=False, objective=Objective(objective))[0])
            for m in (start, draft)
        }
    assert cost[draft] < 0.2 * cost[start]
    assert after["acceptance_T1"] > before["acceptance_T1"] and after["pass_T1"] > before["pass_T1"]
    manifest = json.loads((draft_dir / MANIFEST).read_text())
    assert manifest["config"]["objective"] == objective and manifest["config"]["cut"] == 0.3
    other = "renyi2" if objective == "chi2" else "chi2"
    with pytest.raises(ValueError, match="other settings"):
        distill(lm, train, tmp_path, dataclasses.replace(config, objective=other))


def test_a_kl_run_records_what_it_recorded_before_the_weight_objectives(data, tmp_path):
    lm, train = target(), load_examples(data)
    draft_dir = distill(lm, train, tmp_path, DistillConfig(layers=1, steps=1, batch_tokens=64, save_every=1))
    recorded = json.loads((draft_dir / MANIFEST).read_text())["config"]
    # a KL run's settings keep their old keys, so that its checkpoints from before resume
    assert not {"objective", "objective_temperature", "cut", "cut_divergence"} & set(recorded)


def test_init_draft_fine_tunes_a_layer_draft_and_keeps_its_training_prompts(data, tmp_path):
    from smcsd_ppl.distill.overlap import record_training_prompts, training_overlap

    lm, train = target(), load_examples(data)
    moved = DistillConfig(layers=2, steps=3, batch_tokens=64, lr=3e-2, warmup=0, save_every=3)
    first = distill(lm, train, tmp_path / "kl", moved)  # far from the target's own layers
    record_training_prompts(first, ["an earlier prompt"])
    config = DistillConfig(
        steps=1, batch_tokens=64, lr=1e-9, save_every=1, objective="chi2", init_draft=str(first)
    )
    tuned = distill(lm, train, tmp_path / "chi2", config)
    a, b = own_weights(first), own_weights(tuned)
    fresh = {
        f"{n}.{k}": v
        for n, m in draft_modules(student(lm, [0, 1])).items()
        for k, v in m.state_dict().items()
    }

    def distance(x: dict) -> float:
        return max(float((x[k].float() - a[k].float()).abs().max()) for k in a)

    assert a.keys() == b.keys() == fresh.keys()
    assert distance(b) < 0.01 * distance(fresh)  # it started from the draft, not from the target's layers
    assert json.loads((tuned / MANIFEST).read_text())["source_layers"] == [0, 1]
    record_training_prompts(tuned, ["a new prompt"])
    assert training_overlap(tuned, ["an earlier prompt", "a new prompt", "held out"]) == 2


def fake_generation(tokens: int, calls: int, ess, particles, lengths, passed: float, failed: float):
    from smcsd_ppl.config import DraftRecord
    from smcsd_ppl.results import Generation, RunStats, SMCInfo

    stats = RunStats("smcsd", tokens, 1.0, calls, 0, 0.0, 0.0)
    smc = SMCInfo(0.0, [], list(ess), list(particles), 0.0, 0, draft_lengths=list(lengths))
    smc.draft_record = DraftRecord(passed, failed)
    return Generation("", [0] * tokens, "smcsd", stats, smc=smc)


def test_smc_summary_pools_requests_and_cycles():
    from smcsd_ppl.distill.evaluate import smc_summary

    outs = [
        fake_generation(12, 4, [6.0, 4.0, 1.0], [8, 8, 1], [4, 2, 0], passed=6, failed=2),
        fake_generation(6, 5, [8.0, 1.0, 1.0, 1.0], [8, 1, 1, 1], [4, 0, 0, 0], passed=1, failed=3),
    ]
    got = smc_summary(outs)
    assert got["smc_tokens_per_target_call"] == pytest.approx(18 / 9)
    assert got["smc_ess_fraction"] == pytest.approx((0.75 + 0.5 + 1.0) / 3)  # cycles of one particle left out
    assert got["smc_cycles"] == 7 and got["smc_target_alone"] == pytest.approx(4 / 7)
    assert got["smc_draft_length"] == pytest.approx(10 / 3) and got["smc_lengths"] == {"0": 4, "2": 1, "4": 2}
    assert got["smc_pass_rate"] == pytest.approx(7 / 12)
    paper = smc_summary([fake_generation(9, 2, [5.0], [8], [], passed=0, failed=0)])  # no cut, no schedule
    assert paper["smc_target_alone"] is None and paper["smc_pass_rate"] is None
    assert paper["smc_ess_fraction"] == pytest.approx(5 / 8)
