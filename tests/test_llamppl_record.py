"""``smc_standard(..., json_file=...)`` writes LLaMPPL's SMC record, entry for entry."""

from __future__ import annotations

import asyncio
import json

import llamppl
import numpy as np
import pytest
from llamppl_side import TheirMockLM, mock_lm

import smcsd_ppl.llamppl as ours


def program(Model, LMContext, lm, draw: bool):
    """Three tokens per particle, observed (fixed ones, or drawn with numpy), then done."""

    class Three(Model):
        def __init__(self):
            super().__init__()
            self.context = LMContext(lm, [0, 1])

        async def step(self):
            token = int(np.random.choice(3)) if draw else self.context.token_count % 3
            await self.observe(self.context.next_token(), token)
            if self.context.token_count == 3:
                self.finish()

        def __str__(self):
            return str(self.context)

    return Three()


def records(tmp_path, draw: bool, ess_threshold: float, n: int = 4):
    lm = mock_lm()
    np.random.seed(0)
    asyncio.run(
        ours.smc_standard(
            program(ours.Model, ours.LMContext, lm, draw), n, ess_threshold, json_file=tmp_path / "a"
        )
    )
    theirs = program(llamppl.Model, llamppl.LMContext, TheirMockLM(lm.pair.target_lm), draw)
    with np.errstate(divide="ignore"):
        asyncio.run(llamppl.smc_standard(theirs, n, ess_threshold, json_file=str(tmp_path / "b")))
    return json.loads((tmp_path / "a").read_text()), json.loads((tmp_path / "b").read_text())


def test_a_run_without_resampling_writes_llamppls_record(tmp_path):
    mine, theirs = records(tmp_path, draw=False, ess_threshold=0.0)
    assert [(e["step"], e["mode"], sorted(e)) for e in mine] == [
        (e["step"], e["mode"], sorted(e)) for e in theirs
    ]
    for a, b in zip(mine, theirs):
        assert [p["contents"] for p in a["particles"]] == [p["contents"] for p in b["particles"]]
        for key in ("logweight", "weight_incr"):
            assert [float(p[key]) for p in a["particles"]] == pytest.approx(
                [float(p[key]) for p in b["particles"]], abs=1e-4
            )


@pytest.mark.parametrize("ess_threshold", [1.0, 0.5])
def test_resampling_entries_name_each_particles_ancestor(tmp_path, ess_threshold):
    mine, theirs = records(tmp_path, draw=True, ess_threshold=ess_threshold, n=6)
    for record in (mine, theirs):  # the same shape of record from both libraries
        assert record[0]["mode"] == "init" and [e["step"] for e in record] == list(range(1, len(record) + 1))
        assert {e["mode"] for e in record[1:]} <= {"smc_step", "resample"}
        assert all(set(p) == {"contents", "logweight", "weight_incr"} for e in record for p in e["particles"])
    assert any(e["mode"] == "resample" for e in mine) if ess_threshold == 1.0 else True
    for before, entry in zip(mine, mine[1:]):
        n = len(entry["particles"])
        ancestors = entry.get("ancestors", list(range(n)))
        assert sorted(entry) == sorted(
            ["step", "mode", "particles"] + (["ancestors"] if "ancestors" in entry else [])
        )
        for i, a in enumerate(ancestors):  # a particle's text extends its ancestor's
            text, parent = entry["particles"][i]["contents"], before["particles"][a]["contents"]
            assert text.startswith(parent) and len(text) > len(parent)
            incr = float(entry["particles"][i]["logweight"]) - float(before["particles"][a]["logweight"])
            if entry["mode"] == "smc_step":
                assert float(entry["particles"][i]["weight_incr"]) == pytest.approx(incr, abs=1e-6)


def test_visualization_dir_holds_the_record(tmp_path):
    lm = mock_lm()
    asyncio.run(
        ours.smc_standard(program(ours.Model, ours.LMContext, lm, False), 2, visualization_dir=tmp_path)
    )
    [written] = list(tmp_path.iterdir())
    assert written.name.startswith("Three-") and written.suffix == ".json"
    assert json.loads(written.read_text())[0]["mode"] == "init"


def test_json_file_is_read_inside_visualization_dir(tmp_path):
    lm = mock_lm()
    go = ours.smc_standard(
        program(ours.Model, ours.LMContext, lm, False), 2, visualization_dir=tmp_path, json_file="run.json"
    )
    asyncio.run(go)
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
