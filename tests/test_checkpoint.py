"""A vLLM pair's models as files (``models.checkpoint``): the head and the drafts without PyTorch models.

No vLLM needed: the files are checked against the models ``SMCSD.load`` builds on the HF backend.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from smcsd_ppl.models.checkpoint import draft_files, engine_parts, load_files
from smcsd_ppl.models.drafts import resolve_draft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target_files():
    """The embedded target as files (the default dtype), as ``SMCSD.load(backend="vllm")`` reads it."""
    return load_files(None, device="cpu", dtype="auto")


def test_the_head_is_the_built_models_head(default_smcsd, target_files):
    parts = engine_parts(target_files)
    model = default_smcsd.target.model
    assert torch.equal(parts.head, model.get_output_embeddings().weight)  # tied: the embeddings
    assert parts.bias is None and parts.max_length == model.config.max_position_embeddings
    assert parts.n_params == sum(p.numel() for p in model.parameters())
    assert (
        target_files.model is None
        and target_files.tokenizer.get_vocab() == default_smcsd.tokenizer.get_vocab()
    )


@pytest.mark.parametrize("spec", [None, "layers:3"])
def test_a_draft_written_from_files_holds_the_draft_built_in_memory(
    default_smcsd, target_files, tmp_path, spec
):
    """The shipped distilled draft and a layer slice, written from checkpoints: same tensors and config."""
    files = draft_files(spec, target_files, tmp_path)
    built = resolve_draft(spec, default_smcsd.target, device="cpu", dtype="bfloat16")
    assert (files.name, files.source, files.is_slice) == (built.name, built.source, built.is_slice)
    written = load_file(Path(files.path) / "model.safetensors")
    want = {k: v for k, v in built.model.state_dict().items() if k != "lm_head.weight"}  # tied: not saved
    assert written.keys() == want.keys()
    assert all(torch.equal(written[k], want[k]) for k in want)
    config = AutoConfig.from_pretrained(files.path)
    assert config.to_diff_dict() == built.model.config.to_diff_dict()
    assert engine_parts(files).n_params == sum(p.numel() for p in built.model.parameters())
    again = draft_files(spec, target_files, tmp_path)
    assert again.path == files.path and len(list(tmp_path.glob("vllm/*"))) == 1  # written once


def test_a_draft_of_another_target_or_a_scaled_head_is_refused(target_files, tmp_path):
    with pytest.raises(ValueError, match="slice size must be"):
        draft_files("layers:30", target_files, tmp_path)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "smcsd_draft.json").write_text(
        json.dumps({"target": "x", "fingerprint": {}, "source_layers": [0]})
    )
    with pytest.raises(ValueError, match="was distilled for 'x'"):
        draft_files(str(draft), target_files, tmp_path)
    capped = tmp_path / "capped"
    capped.mkdir()
    config = json.loads((Path(target_files.path) / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps(config | {"final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match="final_logit_softcapping"):  # as Gemma 2's
        engine_parts(dataclasses.replace(target_files, path=str(capped)))
