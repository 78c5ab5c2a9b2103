"""Small surprises a new user met, each pinned: documented defaults, option prefixes, the cut's
range, strings given to ``run``, whole-word answer checks and the exactness plot's axis."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from smcsd_ppl import SMCConfig, SMCSDModel
from smcsd_ppl.bench.grammar_exact import ExactnessRow, plot_exactness
from smcsd_ppl.bench.quality import check_answer
from smcsd_ppl.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
DEFAULTS = SMCConfig()


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _documented(page: str, pattern: str) -> list[str]:
    found = re.findall(pattern, (DOCS / page).read_text(encoding="utf-8"))
    assert found, f"{page} no longer states its defaults as /{pattern}/; update this test"
    return found


def test_the_docs_state_the_defaults_of_the_code():
    generate = build_parser().parse_args(["generate", "x"])
    cli = {"n_particles": generate.particles, "block_size": generate.block_size}
    cli |= {
        "draft_temperature": generate.draft_temperature,
        "target_temperature": generate.target_temperature,
    }
    for name, value in cli.items():
        assert value == getattr(DEFAULTS, name), name
    [(n, k, t)] = _documented(
        "quickstart.md", r"N = (\d+) particles with blocks of K = (\d+) tokens at temperature (\d+(?:\.\d+)?)"
    )
    assert (int(n), int(k), float(t)) == (
        DEFAULTS.n_particles,
        DEFAULTS.block_size,
        DEFAULTS.target_temperature,
    )
    [(nk, t)] = _documented("cli.md", r"N = K = (\d+) and T_d = T_t = (\d+(?:\.\d+)?)")
    assert int(nk) == DEFAULTS.n_particles == DEFAULTS.block_size
    assert float(t) == DEFAULTS.draft_temperature == DEFAULTS.target_temperature
    table = dict(_documented("api.md", r"\n\| `(\w+)` \| ([^|]+?) \|"))
    for name, text in table.items():
        assert ast.literal_eval(text.strip().strip("`")) == getattr(DEFAULTS, name), name


def test_every_parser_refuses_option_prefixes():
    parser = build_parser()
    assert not any(p.allow_abbrev for p in _parsers(parser))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--particle", "8", "hello"])
    assert parser.parse_args(["generate", "--particles", "8", "hello"]).particles == 8


def test_a_tv_cut_lies_in_zero_one_and_the_nats_divergences_are_unbounded():
    with pytest.raises(ValueError, match=r"cut must be in \(0, 1\] for the tv divergence"):
        SMCConfig(cut=2)
    for bad in (0, -0.1):
        with pytest.raises(ValueError, match="cut must be a finite number > 0"):
            SMCConfig(cut=bad)
    SMCConfig(cut=1.0)
    SMCConfig(cut=2.0, cut_divergence="kl")
    SMCConfig(cut=2.0, cut_divergence="renyi2")
    SMCConfig(cut=None)


def test_run_names_smcsd_model_when_given_text(tiny_smcsd):
    for programs in (["What is 2 + 2?"], "What is 2 + 2?"):
        with pytest.raises(ValueError, match="run takes SMCSDModel programs, got a str") as info:
            tiny_smcsd.run(programs, SMCConfig(max_new_tokens=2))
        assert type(info.value) is ValueError and "\n" not in str(info.value)
    [out] = tiny_smcsd.run(SMCSDModel("The quick"), SMCConfig(n_particles=2, block_size=2, max_new_tokens=2))
    assert out.token_ids


def test_short_answers_match_whole_words():
    assert not check_answer("The most obvious planet on Earth is indeed Earth", "Mars")
    assert check_answer("Mars", "Mars")
    assert check_answer("It is Mars, the red one.", "Mars")
    assert check_answer("The answer: carbon dioxide!", "carbon dioxide")
    assert not check_answer("Marsupials live in Australia.", "Mars")
    assert check_answer("Paris-born", "Paris")  # a hyphen separates words


def test_the_exactness_plot_has_one_tick_per_power_of_two(tmp_path):
    ns = [1, 2, 4, 8, 16, 32, 64]
    rows = [ExactnessRow("smcsd_proposal, cut off", n, 1 / n, 0.5, 0.0, 10) for n in ns]
    fig = plot_exactness(rows, {"local_tv": 0.9, "noise": 0.05}, tmp_path / "plot.png")
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == ns and not list(ax.get_xticks(minor=True))
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [str(n) for n in ns] and len(set(labels)) == len(labels)
    assert (tmp_path / "plot.png").stat().st_size > 0
