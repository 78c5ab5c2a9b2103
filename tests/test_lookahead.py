"""The one-step lookahead twist reads the target's law after each block's end (fast tier).

Its twist must be log Phi-hat(y): the mass the target's next-token law after the whole prefix
y (the bonus included) puts on what the constraint allows next. The law the bonus was drawn
from (one token earlier) is not a stand-in: on JSON it scored a string's closing quote by the
string's own law and steered particles away from closing anything.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from helpers import run_rows

from smcsd_ppl.bench import grammar_exact as ge
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference import lookahead, structure
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.potentials.twist import FutureValidity, lm_step


class Recording(SMCSDModel):
    """Records each twist with the prefix it was given at."""

    seen: list[tuple[tuple[int, ...], float]] = []

    def twist(self, amt):
        Recording.seen.append((tuple(self.main_context.generated), amt))
        super().twist(amt)


def run_mock(grammar: str, program, twist: str, runs: int):
    """``runs`` requests of ``program`` on a mock grammar (seed 0) under ``twist``: (target, constraint)."""
    language, pair = ge.GRAMMARS[grammar]
    target, draft = pair(0)
    constraint = language()
    Recording.seen = []
    config = SMCConfig(
        n_particles=2, block_size=2, draft_temperature=1.0, target_temperature=0.7,
        max_new_tokens=ge.HORIZON, seed=3, twist=twist,
    )  # fmt: skip
    programs = [program(list(ge.PROMPT), constraint) for _ in range(runs)]
    run_rows(programs, RowStore(target, draft), config, [ge.EOS])
    return target, constraint


def one_step(target, constraint, y) -> float:
    """The valid mass of the target's law (T = 0.7) after the prefix y."""
    law = torch.log_softmax(target.next_logits(list(ge.PROMPT) + list(y)).double() / 0.7, -1)
    return float(torch.logsumexp(law[constraint.next_mask([y])[0]], -1))


@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_the_lookahead_twist_is_the_valid_mass_of_the_law_after_the_block(grammar):
    target, constraint = run_mock(grammar, Recording, "lookahead", 20)
    assert len(Recording.seen) >= 20
    for y, amt in Recording.seen:
        assert amt == pytest.approx(one_step(target, constraint, y), abs=1e-5), y


@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_reading_the_whole_structure_gives_the_exact_phi_and_tilt(grammar, monkeypatch):
    # With room for every continuation, the structure read is the whole bounded language: its
    # estimate is Phi itself, at each block's end (and a context's start), and so is its tilt
    # after each token the next lead or a drafted token may be, along every path it followed.
    monkeypatch.setattr(structure.grow, "__defaults__", (structure.WIDTH, 10_000))
    reads, read_structure = [], lookahead.read_structure

    def recording(store, rows, ends, *args, **kwargs):
        logits, out = read_structure(store, rows, ends, *args, **kwargs)
        reads.extend((e.context, structured) for e, structured in zip(ends, out) if structured)
        return logits, out

    monkeypatch.setattr(lookahead, "read_structure", recording)
    target, constraint = run_mock(grammar, Recording, "structure", 60)
    exact = FutureValidity(constraint, lm_step(target, ge.PROMPT, temperature=0.7), ge.HORIZON)
    assert len(reads) >= 10 and sum(len(tilts) > 1 for _, (_, tilts) in reads) >= 10
    for y, amt in Recording.seen:
        assert amt == pytest.approx(exact.log_phi(y), abs=1e-5), y
    for y, (value, tilts) in reads:
        assert value == pytest.approx(exact.log_phi(y), abs=1e-5), y
        for path, tilt in tilts.items():
            z = (*y, *path)
            assert dict(tilt) == pytest.approx({t: exact.log_phi((*z, t)) for t, _ in tilt}, abs=1e-5), z
            allowed = constraint.next_mask([z])[0].nonzero().flatten().tolist()
            assert {t for t, _ in tilt} == set(allowed) - {ge.EOS}, z


def test_a_wide_mask_is_read_one_token_ahead(monkeypatch):
    # Nothing narrow enough to follow: the structure twist is the one-step lookahead, no tree forward.
    monkeypatch.setattr(structure.grow, "__defaults__", (0, structure.NODES))
    target, constraint = run_mock("dyck", Recording, "structure", 10)
    assert Recording.seen
    for y, amt in Recording.seen:
        assert amt == pytest.approx(one_step(target, constraint, y), abs=1e-5), y


def test_the_structure_twist_runs_on_the_hf_backend_under_a_json_schema(tiny_smcsd, monkeypatch):
    # On a real backend (and a real grammar engine) the trees are read in the bonus's forward.
    from test_grammar import SCHEMA

    from smcsd_ppl.potentials import JsonSchemaConstraint

    trees = []
    read = RowStore.next_logits_and_trees
    monkeypatch.setattr(
        RowStore, "next_logits_and_trees", lambda self, rows, t: trees.append(t) or read(self, rows, t)
    )
    tok = tiny_smcsd.tokenizer
    schema = JsonSchemaConstraint(SCHEMA, tok, tiny_smcsd.eos_token_ids)  # finite: every output ends
    config = SMCConfig(n_particles=4, block_size=4, max_new_tokens=100, seed=1, twist="structure")
    out = tiny_smcsd.run([SMCSDModel("x", schema) for _ in range(2)], config)
    assert trees and any(nodes for t in trees for nodes, _ in t)
    for g in out:
        jsonschema.validate(json.loads(g.text), SCHEMA)


def test_a_tree_past_the_context_falls_back_to_one_token_ahead(tiny_smcsd):
    from test_grammar import SCHEMA

    from smcsd_ppl.backends.hf import HFBatchedLM
    from smcsd_ppl.inference import lookahead
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import JsonSchemaConstraint

    model = tiny_smcsd.target.model
    store = RowStore(HFBatchedLM(model), HFBatchedLM(model))
    store.start([[5] * (store.target.max_length - 4)], [0])  # 4 columns left: no room for a tree
    schema = JsonSchemaConstraint(SCHEMA, tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids)
    end = RowConstraint(schema, "proposal", (), lookahead=True, structure=True)
    assert len(structure.grow([end])[0].tokens) > 5
    logits, read = lookahead.read_structure(store, [0], [end], torch.ones(1), 1.0)
    assert read == [None] and torch.equal(logits, store.next_logits([0]).float())


def test_a_forced_text_is_read_along_its_canonical_tokens(default_smcsd):
    # Every split of a forced phrase is allowed, so its mask is wide; the tree still reads the
    # phrase, one canonical token per node, up to where the grammar ends it.
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import RegexConstraint

    tok, eos = default_smcsd.tokenizer, default_smcsd.eos_token_ids  # a real vocabulary: wide masks
    phrase = " is a cat on the mat"
    language = RegexConstraint(f"(Mercury{phrase}|Venus|Mars)", tok, eos)
    context = tuple(tok.encode("Mercury", add_special_tokens=False))
    canonical = tok.encode(phrase, add_special_tokens=False)
    assert language.forced_tokens(context) == canonical and language.forced_tokens(()) == []
    start = RowConstraint(language, "proposal", context, lookahead=True, structure=True)
    tree = structure.grow([start], nodes=len(canonical))[0]  # room for the phrase alone
    assert tree.forced[0] and tree.path(len(tree.tokens) - 1) == canonical
    log_law = torch.log_softmax(torch.randn(len(tree.tokens), language.vocab_size, dtype=torch.float64), -1)
    value, tilts = structure.log_phi(tree, log_law, eos)
    tilt = tilts[()]  # the lead's
    path = sum(float(log_law[j, t]) for j, t in enumerate(canonical))  # node j reads token j + 1
    end = torch.logsumexp(log_law[len(canonical), list(eos)], 0).item()
    # Every split of the phrase is tilted as the phrase read: the lead is steered toward none.
    assert value == pytest.approx(path + end) and set(dict(tilt).values()) == {
        value - float(log_law[0, canonical[0]])
    }


def test_the_room_left_reads_the_other_splits_of_a_forced_text(default_smcsd):
    # A split the model goes on from counts as its canonical sibling does, one it does not go on
    # from hardly at all: the canonical path alone is a lower bound, every split's mass an upper one.
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import RegexConstraint

    tok, eos = default_smcsd.tokenizer, default_smcsd.eos_token_ids
    phrase = " is a cat on the mat"
    language = RegexConstraint(f"(Mercury{phrase}|Venus|Mars)", tok, eos)
    context = tuple(tok.encode("Mercury", add_special_tokens=False))
    canonical = tok.encode(phrase, add_special_tokens=False)
    tree = structure.grow([RowConstraint(language, "proposal", context, lookahead=True, structure=True)])[0]
    assert tree.path(len(canonical)) == canonical  # the phrase first, then the splits in the room left
    splits = [j for j, b in enumerate(tree.beside) if b >= 0]
    at_root = [j for j in splits if tree.parents[j] == 0]
    assert at_root and len(tree.tokens) - 1 == structure.NODES and not any(tree.followed[j] for j in splits)
    log_law = torch.log_softmax(torch.randn(len(tree.tokens), language.vocab_size, dtype=torch.float64), -1)
    for j in splits:  # the model goes on from no split...
        log_law[j, tree.masks[j]] = -60.0
    goes_on = at_root[0]  # ...but one: all its mass on what continues the phrase
    log_law[goes_on, tree.masks[goes_on]] = -math.log(int(tree.masks[goes_on].sum()))
    value, tilts = structure.log_phi(tree, log_law, eos)
    tilt = tilts[()]  # the lead's
    rest = sum(float(log_law[j, t]) for j, t in enumerate(canonical) if j > 0)
    rest += torch.logsumexp(log_law[len(canonical), list(eos)], 0).item()
    split = tree.tokens[goes_on]
    both = torch.logsumexp(log_law[0, [canonical[0], split]], 0).item()
    assert value == pytest.approx(both + rest)
    assert dict(tilt)[split] == pytest.approx(rest) and dict(tilt)[canonical[0]] == pytest.approx(rest)
    assert all(dict(tilt)[tree.tokens[j]] < rest - 50 for j in at_root if j != goes_on)


def test_a_context_s_first_token_is_read_word_by_word(default_smcsd):
    # The first token's mask holds every split of three words: each word is read from its own
    # first token, a split shared by two words ("M") on its own, and each split is tilted as the
    # word it begins.
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import RegexConstraint

    tok, eos = default_smcsd.tokenizer, default_smcsd.eos_token_ids
    language = RegexConstraint("(Mercury is a cat|Venus|Mars)", tok, eos)
    allowed = set(language.next_mask([()])[0].nonzero().flatten().tolist()) - set(eos)
    assert len(allowed) > structure.WIDTH  # too wide to follow every split
    first = {w: tok.encode(w, add_special_tokens=False)[0] for w in ("Mercury", "Venus", "Mars")}
    (m,) = tok.encode("M", add_special_tokens=False)
    assert language.word_start((), m) == m and language.word_start((), first["Venus"]) == first["Venus"]
    tree = structure.grow([RowConstraint(language, "proposal", (), lookahead=True, structure=True)])[0]
    read = {tree.tokens[j] for j, p in enumerate(tree.parents) if p == 0}
    assert read == {*first.values(), m} and set(tree.aliases[0]) == allowed
    log_law = torch.log_softmax(torch.randn(len(tree.tokens), language.vocab_size, dtype=torch.float64), -1)
    _, tilts = structure.log_phi(tree, log_law, eos)
    tilt = tilts[()]  # the lead's
    (v,) = tok.encode("V", add_special_tokens=False)
    assert dict(tilt)[v] == dict(tilt)[first["Venus"]] and set(dict(tilt)) == allowed


def test_with_room_each_split_is_read_on_its_own(default_smcsd):
    # Before a context's first token there is room for every split and the text it forces, so
    # "M" of "Marseille" (which the model writes "Mar" first) is read, not tilted as "Mar" is.
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import RegexConstraint

    tok, eos = default_smcsd.tokenizer, default_smcsd.eos_token_ids
    language = RegexConstraint("(Paris of frogs|Lyon|Marseille)", tok, eos)
    allowed = set(language.next_mask([()])[0].nonzero().flatten().tolist()) - set(eos)
    start = RowConstraint(language, "proposal", (), lookahead=True, structure=True)
    tree = structure.grow([start], nodes=structure.FIRST_NODES)[0]
    below = {tree.tokens[j]: j for j, p in enumerate(tree.parents) if p == 0}
    assert below.keys() == allowed and tree.aliases[0] == {t: t for t in allowed}
    (m,), mar = (
        tok.encode("M", add_special_tokens=False),
        tok.encode("Marseille", add_special_tokens=False)[0],
    )
    assert m != mar and {m, mar} <= allowed
    log_law = torch.log_softmax(torch.randn(len(tree.tokens), language.vocab_size, dtype=torch.float64), -1)
    log_law[below[m], language.next_mask([[m]])[0]] = -60.0  # the model seldom goes on from "M"
    _, tilts = structure.log_phi(tree, log_law, eos)
    tilt = tilts[()]  # the lead's
    assert dict(tilt).keys() == allowed and dict(tilt)[m] < -55 < dict(tilt)[mar]
    # Without the room, each split is tilted as the word it begins.
    words = structure.grow([start])[0]
    assert len(words.tokens) < len(tree.tokens)
    log_law = torch.log_softmax(torch.randn(len(words.tokens), language.vocab_size, dtype=torch.float64), -1)
    _, tilts = structure.log_phi(words, log_law, eos)
    tilt = tilts[()]  # the lead's
    assert dict(tilt)[m] == dict(tilt)[mar]


def test_a_tree_opens_where_its_read_stops_at_free_text(default_smcsd):
    # ``finite`` reads only trees that do not open: every path they follow ends the output or
    # runs past the read's budget, none stops at more choices than the read follows.
    from smcsd_ppl.inference.blocks import RowConstraint
    from smcsd_ppl.potentials import RegexConstraint

    tok, eos = default_smcsd.tokenizer, default_smcsd.eos_token_ids

    def tree(pattern: str, text: str = "", nodes: int = structure.NODES) -> structure.Tree:
        context = tuple(tok.encode(text, add_special_tokens=False)) if text else ()
        end = RowConstraint(RegexConstraint(pattern, tok, eos), "proposal", context, True, True, finite=True)
        return structure.grow([end], nodes=nodes)[0]

    assert not tree("(Paris of frogs|Lyon|Marseille)", nodes=structure.FIRST_NODES).opens  # every path ends
    budget = tree("(Mercury is a cat|Venus|Mars)", nodes=structure.FIRST_NODES)  # the budget ends it
    assert not budget.opens and len(budget.tokens) - 1 == structure.FIRST_NODES
    ahead = tree("(Lyon|Marseille), because [a-z ]+[.]", "Lyon")  # a forced text, then free text
    assert ahead.opens and len(ahead.tokens) > 2
    inside = tree("Answer: [a-z ]+[.]", "Answer: it")  # free text at the end itself
    assert inside.opens and len(inside.tokens) == 1


def test_the_finite_twist_reads_and_twists_only_where_the_tree_does_not_open(monkeypatch):
    # On a mock every mask is narrow; with one choice the most a node follows (and a wider mask
    # counted free text), the trees open wherever brackets may still open or close. ``finite``
    # reads the others alone, each to the exact Phi (its rest is forced, within the room), and
    # twists nothing at the ends it leaves unread, whose bonus the next verify reads.
    monkeypatch.setattr(structure.grow, "__defaults__", (1, structure.NODES))
    monkeypatch.setattr(structure, "WORDS", 1)
    asked, reads, read_structure = [], [], lookahead.read_structure
    grow_trees = lookahead.grow_trees

    def growing(store, ends, *args):
        trees = grow_trees(store, ends, *args)
        asked.extend((e.context, t.opens) for e, t in zip(ends, trees))
        return trees

    def recording(store, rows, ends, *args, **kwargs):
        reads.extend(e.context for e in ends)
        return read_structure(store, rows, ends, *args, **kwargs)

    monkeypatch.setattr(lookahead, "grow_trees", growing)
    monkeypatch.setattr(lookahead, "read_structure", recording)
    target, constraint = run_mock("dyck", Recording, "finite", 60)
    closed = {y for y, opens in asked if not opens}
    assert closed and any(opens for _, opens in asked) and set(reads) == closed
    exact = FutureValidity(constraint, lm_step(target, ge.PROMPT, temperature=0.7), ge.HORIZON)
    assert Recording.seen and {y for y, _ in Recording.seen} <= closed
    for y, amt in Recording.seen:
        assert amt == pytest.approx(exact.log_phi(y), abs=1e-5), y


def test_without_token_trees_the_finite_twist_reads_nothing(monkeypatch):
    # On a backend that cannot read a tree (vLLM) nothing ahead is known to be finite: no end is
    # read or twisted, where ``structure`` falls back to one token ahead.
    monkeypatch.setattr(lookahead, "_reads_trees", lambda store: False)
    run_mock("dyck", Recording, "finite", 20)
    assert Recording.seen == []
    run_mock("dyck", Recording, "structure", 20)
    assert Recording.seen
