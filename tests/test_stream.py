"""Streaming what is settled: the tokens every surviving particle shares, which the output extends."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from smcsd_ppl import SMCConfig, SMCSDModel
from smcsd_ppl.batch import run as batch
from smcsd_ppl.batch.run import generate_one
from smcsd_ppl.cli import main
from smcsd_ppl.ends import tokens_reaching
from smcsd_ppl.engine.client import ServeRequest
from smcsd_ppl.potentials import Constraint
from smcsd_ppl.text import IncrementalText, TextStream, whole_characters

CONFIG = SMCConfig(
    n_particles=4, block_size=3, max_new_tokens=12, draft_temperature=1.0, target_temperature=1.0
)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_text_stream_hands_out_each_piece_once():
    pieces = {1: "ab", 2: "c", 3: "\ufffd", 4: "é"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids).replace("\ufffdé", "é"))
    assert [stream.update(ids) for ids in ([1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1])] == [
        "ab",
        "c",
        "",
        "é",
        "",
    ]
    assert stream.text == "abcé" and stream.tokens == 4


@pytest.mark.parametrize("fixture", ["tiny_smcsd", "eos_smcsd"])
def test_settled_tokens_only_grow_and_every_output_extends_them(fixture, request):
    pair, longest = request.getfixturevalue(fixture), 0
    for seed in range(4):
        seen: list[tuple[int, ...]] = []
        programs = [SMCSDModel("The quick brown fox")]
        [out] = pair.run(
            programs,
            dataclasses.replace(CONFIG, seed=seed),
            on_cycle=lambda i, s=seen: s.append(i.settled(0)),
        )
        assert seen and all(b[: len(a)] == a for a, b in zip(seen, seen[1:])), seen
        assert tuple(out.token_ids[: len(seen[-1])]) == seen[-1] or not out.text
        longest = max(longest, len(seen[-1]))
    assert longest >= 2  # something settles


def test_streaming_returns_what_generate_returns(tiny_smcsd):
    shown: list[tuple[int, ...]] = []
    for seed in range(3):
        cfg = dataclasses.replace(CONFIG, seed=seed)
        plain = tiny_smcsd.generate("Once upon a time", config=cfg)
        streamed = generate_one(tiny_smcsd, "Once upon a time", cfg, on_settled=shown.append)
        assert streamed.token_ids == plain.token_ids and streamed.text == plain.text
    assert shown


@pytest.fixture(scope="module")
def models(tiny_smcsd, tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("target")
    tiny_smcsd.target.model.save_pretrained(path)
    tiny_smcsd.target.tokenizer.save_pretrained(path)
    return ["--target", str(path), "--draft", "layers:1", "--dtype", "fp32", "--threads", "1"]


def test_the_cli_streams_the_final_text(models, capsys):
    argv = ["generate", "-n", "4", "-k", "3", "--max-new-tokens", "12", "--target-temperature", "1", *models]
    assert main([*argv, "--json", "The quick brown fox"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert main([*argv, "The quick brown fox"]) == 0
    out = capsys.readouterr().out
    assert out == text + "\n" if text else out.startswith("[empty output")


def test_ctrl_c_keeps_the_settled_text_and_says_where_it_stopped(models, capsys, monkeypatch, tiny_smcsd):
    ids = tiny_smcsd.tokenizer("The quick brown fox jumps")["input_ids"]

    def interrupted(*args, on_settled=None, **kwargs):
        on_settled(tuple(ids[:2]))
        on_settled(tuple(ids))
        raise KeyboardInterrupt

    monkeypatch.setattr(batch, "generate_one", interrupted)
    monkeypatch.setattr(sys, "argv", ["smcsd", "generate", *models, "--max-new-tokens", "8", "Hi"])
    assert main() == 130  # as the console script runs it
    captured = capsys.readouterr()
    assert captured.out == tiny_smcsd.decode(ids) + "\n"
    assert f"interrupted after {len(ids)} settled tokens" in captured.err
    with pytest.raises(KeyboardInterrupt):  # called from Python, the Ctrl-C is the caller's
        main(["generate", *models, "--max-new-tokens", "8", "Hi"])
    assert capsys.readouterr().out == tiny_smcsd.decode(ids) + "\n"  # once the text was kept


class Spells(Constraint):
    """Only ``ids``, in order, then EOS: the output is fixed, so the budget alone decides where it ends."""

    def __init__(self, ids, vocab_size, eos):
        super().__init__(vocab_size, eos)
        self.ids = list(ids)

    def next_mask(self, contexts):
        out = torch.zeros(len(contexts), self.vocab_size, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if list(c) == self.ids[: len(c)]:
                out[i, self.ids[len(c)] if len(c) < len(self.ids) else list(self.eos_token_ids)] = True
        return out


def test_a_budget_cut_inside_an_emoji_holds_its_bytes_back(tiny_smcsd):
    pair = tiny_smcsd
    ids = pair.tokenizer("Hi 🌍")["input_ids"]
    whole = len(pair.tokenizer("Hi ")["input_ids"])  # the emoji's bytes come in the tokens after these
    assert len(ids) - whole >= 2 and pair.tokenizer.decode(ids[: whole + 1]) == "Hi \ufffd"
    spells = Spells(ids, pair.target_lm.vocab_size, pair.eos_token_ids)
    for budget in range(whole + 1, len(ids) + 1):  # cut after 1, 2, ... of the emoji's tokens, then none
        [out] = pair.run([SMCSDModel("Say hi", spells)], dataclasses.replace(CONFIG, max_new_tokens=budget))
        assert out.token_ids[:budget] == ids[:budget]
        assert out.text == ("Hi 🌍" if budget == len(ids) else "Hi ")


@pytest.mark.parametrize("method", ["smcsd", "sd"])
def test_quiet_leaves_standard_error_empty_and_the_text_whole(models, capsys, method):
    argv = ["generate", "--method", method, "--max-new-tokens", "8", *models, "Hi"]
    assert main(argv) == 0
    loud = capsys.readouterr()
    assert main([*argv, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert loud.err.count("\n") >= 4 and quiet.err == "" and quiet.out == loud.out


def test_incremental_text_is_the_whole_decoding_at_each_step(tiny_smcsd):
    """Fed a token or a block at a time, it says what decoding everything says, reading only the end."""
    core = tiny_smcsd.core
    ids = tiny_smcsd.tokenizer("Crème brûlée 🌍 and naïve café, " * 6)["input_ids"]
    for step in (1, 3, 7):
        text = IncrementalText(core.decode_bytes)
        for end in range(step, len(ids) + step, step):
            before = text.decoded
            assert text.update(ids[:end]) == core.decode(ids[:end]) or core.decode(ids[:end]).startswith(
                text.text
            )
            assert text.decoded - before <= 2 * (step + IncrementalText.LOOKBACK + 4)  # never the whole
        assert text.text == core.decode(ids)
    text = IncrementalText(core.decode_bytes)
    text.update(ids[:20])
    assert text.update(ids[:5]) == core.decode(ids[:5])  # every particle died: decoded again


def test_decoding_per_cycle_does_not_grow_with_the_output(tiny_smcsd, monkeypatch):
    """The ticket's settled text costs the new tokens' decoding per cycle, not the whole output's."""
    per_cycle, extend = [], IncrementalText.extend

    def counted(self, new):
        before = self.decoded
        out = extend(self, new)
        per_cycle.append((len(self.ids), self.decoded - before))
        return out

    monkeypatch.setattr(IncrementalText, "extend", counted)
    config = SMCConfig(n_particles=4, block_size=3, max_new_tokens=110, ignore_eos=True, seed=1, cut=None)
    out = tiny_smcsd.engine.submit(ServeRequest([5, 6, 7], config)).wait(timeout=300)
    late = [n for length, n in per_cycle if length > 60]
    assert len(out.token_ids) == 110 and late and max(late) < 40, per_cycle


def test_a_stop_cut_keeps_the_tokens_its_text_needs_and_no_more():
    # One character per token, but "€" takes two tokens whose first decodes to U+FFFD alone.
    pieces = ["a", "b", "\ufffd", "\u20ac", "c", "d"]

    def decode(ids):
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffd\u20ac", "\u20ac")  # the two halves make one character

    ids = list(range(6))
    assert whole_characters(decode(ids)) == "ab\u20accd"
    text_of = lambda prefix: whole_characters(decode(prefix))  # noqa: E731 - as the ticket reads it
    assert [tokens_reaching(text_of, ids, n) for n in range(6)] == [0, 1, 2, 4, 5, 6]
