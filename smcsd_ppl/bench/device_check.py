"""One-shot device check: backend equivalence in bf16, then the methods side by side, on both forwards.

``smcsd device-check [--tiny] [--device cuda]`` (``check`` here) builds random-weight Llamas
of realistic shapes (an 8B target and a 1B draft; tiny ones with ``--tiny`` or on a CPU),
checks the batched backend against plain forwards on the device (left padding, holes, fork,
drop_tail, a token tree), times ``model.generate()``, AR, exact SD and SMC-SD (N=8, K=8,
128 tokens, EOS ignored) on the models' own forwards, then AR, the paper's SMC-SD and the
default method on ours (on CUDA each forward shape a replayed graph), alone and as 8
requests at once, and returns one report. SMC-SD's speed does not depend on how well random
models agree, so no weights are needed; acceptance and quality figures of random models mean
nothing and are not reported. On one H200 the full-size check is sized to finish within 8 minutes.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..api import SMCSD
from ..backends.fixed import ShapedLM
from ..backends.hf import HFBatchedLM
from ..backends.syncs import reads_per_cycle
from ..config import SMCConfig
from ..engine.worker import entered_on_torch_thread
from ..models import LoadedModel
from ..models.batched import backend_of
from .speed import HF_GENERATE, timed_run

VOCAB_8B = 128256
SHAPES = {  # Llama 3.1 8B and Llama 3.2 1B, and a tiny pair for CPUs and tests
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    # one head of 64: vLLM's CPU attention refuses smaller heads
    "tiny-target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=1),
    "tiny-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1),
}
TIMED = (
    HF_GENERATE,
    "ar",
    "sd",
    "smcsd_paper",
)  # the paper's SMC-SD: its speed does not depend on agreement
VLLM_TIMED = ("ar", "sd", "smcsd_paper")  # on the vLLM backend (HF generate() has no place there)
OURS_TIMED = ("ar", "smcsd_paper", "smcsd")  # on our forward: the default method too
SERVED = 8  # requests at once, as a server batches them
EOS = 2
BF16_TOL = 0.05  # max |a - b| / max |b| allowed between batched and plain bf16 logits


def build(shape: str, vocab: int, device: str, seed: int) -> LoadedModel:
    """A random-weight bf16 Llama of a named shape, created directly on ``device``."""
    kv_heads = 8 if shape in ("8b", "1b") else 1
    config = LlamaConfig(
        vocab_size=vocab,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=shape == "1b",
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # no fp32 copy of an 8B model on the way
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = EOS
    return LoadedModel(model, ID_TOKENIZER, f"random-{shape}", "random init")


class IdTokenizer:
    """Text for random-weight models: the token ids themselves (no vocabulary exists)."""

    eos_token_id = EOS
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The ids, space-separated."""
        return " ".join(str(int(i)) for i in ids)


ID_TOKENIZER = IdTokenizer()  # one instance: target and draft share it, as a pair must


def scratch(model, seq: list[int], n_last: int) -> torch.Tensor:
    """Logits after each of the last ``n_last`` tokens of ``seq`` (one row, no cache)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(torch.tensor([seq], device=device)).logits[0, -n_last:].float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute error relative to the largest reference logit."""
    return float((got.float().cpu() - want.float().cpu()).abs().max() / want.float().abs().max().cpu())


def equivalence(model, vocab: int, seed: int = 0, lm: HFBatchedLM | None = None) -> dict[str, float]:
    """Max relative logit error of each backend operation against plain forwards.

    ``lm``: the backend to check (default: the model's own forward); a backend that reads no
    token trees (``fixed.ShapedLM``) is checked without one.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 3, 6, 1)]
    lm = lm or HFBatchedLM(model)
    out = {"left_padding": 0.0}
    first = lm.prefill(prompts)
    for i, p in enumerate(prompts):
        out["left_padding"] = max(out["left_padding"], rel_err(first[i], scratch(model, p, 1)[0]))
    tokens = torch.randint(3, vocab, (4, 4), generator=g)
    valid = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    got = lm.extend(tokens, valid)
    seqs = [p + tokens[i][valid[i]].tolist() for i, p in enumerate(prompts)]
    out["holes"] = max(
        rel_err(got[i][valid[i]], scratch(model, s, int(valid[i].sum()))) for i, s in enumerate(seqs)
    )
    rows = [2, 0, 0, 1]
    lm.fork(torch.tensor(rows))
    seqs = [list(seqs[r]) for r in rows]
    tokens = torch.randint(3, vocab, (4, 3), generator=g)
    got = lm.extend(tokens)
    out["fork"] = max(rel_err(got[i], scratch(model, s + tokens[i].tolist(), 3)) for i, s in enumerate(seqs))
    drop = [1, 3, 0, 2]
    lm.drop_tail(torch.tensor(drop))
    seqs = [s + tokens[i, : 3 - d].tolist() for i, (s, d) in enumerate(zip(seqs, drop))]
    tokens = torch.randint(3, vocab, (4, 2), generator=g)
    got = lm.extend(tokens)
    out["drop_tail"] = max(
        rel_err(got[i], scratch(model, s + tokens[i].tolist(), 2)) for i, s in enumerate(seqs)
    )
    seqs = [s + tokens[i].tolist() for i, s in enumerate(seqs)]
    if not isinstance(lm, ShapedLM):
        out["tree"] = _tree_error(lm, model, seqs, g, vocab)
    return out


def _tree_error(lm: HFBatchedLM, model, seqs: list[list[int]], g: torch.Generator, vocab: int) -> float:
    """Tree nodes against their root-to-node paths, then the kept path against its sequence."""
    parents = torch.tensor([[-1, 0, 0, 1, 3]] * len(seqs))
    tokens = torch.randint(3, vocab, parents.shape, generator=g)
    got = lm.extend_tree(tokens, parents)
    err = 0.0
    for r, s in enumerate(seqs):
        for j, path in enumerate(([0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4])):
            err = max(err, rel_err(got[r, j], scratch(model, s + tokens[r, path].tolist(), 1)[0]))
    lm.keep_path(torch.tensor([[1, 1, 0, 1, 0]] * len(seqs), dtype=torch.bool))
    nxt = torch.randint(3, vocab, (len(seqs), 1), generator=g)
    after = lm.extend(nxt)[:, -1]
    for r, s in enumerate(seqs):
        want = scratch(model, s + tokens[r, [0, 1, 3]].tolist() + nxt[r].tolist(), 1)[0]
        err = max(err, rel_err(after[r], want))
    return err


def forward_ms(
    model, device: torch.device, cache: int = 128, repeats: int = 5, make=HFBatchedLM
) -> dict[str, float]:
    """Median ms of one target forward of 1 x 1 and 8 x 9 new positions after ``cache`` tokens.

    ``make``: the backend of ``model`` (default: its own forward).
    """
    out = {}
    for rows, t in ((1, 1), (8, 9)):
        lm = make(model)
        lm.prefill([list(range(3, 3 + cache))])
        lm.fork(torch.zeros(rows, dtype=torch.long))
        times = []
        for _ in range(repeats + 1):  # the first one warms up
            _sync(device)
            start = time.perf_counter()
            lm.extend(torch.full((rows, t), 5))
            _sync(device)
            times.append(time.perf_counter() - start)
            lm.drop_tail(torch.full((rows,), t))
        out[f"{rows}x{t}"] = round(1000 * statistics.median(times[1:]), 3)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_method(pair: SMCSD, method: str, prompt: list[int], config: SMCConfig) -> tuple[float, float]:
    """Tokens/s and tokens per target call of one run."""
    tokens_per_second, tokens_per_call, _ = timed_run(pair, method, prompt, config)
    return tokens_per_second, tokens_per_call


def host_reads(pair: SMCSD, method: str, prompt: list[int], config: SMCConfig) -> float:
    """Median host reads per cycle (between target forwards) of a short run."""
    short = dataclasses.replace(config, max_new_tokens=min(32, config.max_new_tokens))
    counter = reads_per_cycle(pair.target_lm, [pair.target.model, pair.draft.model])
    # Counted as an accelerator pays them: the reads a CPU takes because they are free there are off.
    owners = [
        (pair.rows(), "free_reads"),
        (pair.target_lm, "shares_twins"),
        (pair.draft_lm, "shares_twins"),
    ]
    saved = [(o, name, getattr(o, name)) for o, name in owners if hasattr(o, name)]
    for o, name, _ in saved:
        setattr(o, name, False)
    try:
        with entered_on_torch_thread(counter) as counts:
            pair.generate_ids([prompt], method=method, config=short)
    finally:
        for o, name, value in saved:
            setattr(o, name, value)
    return float(statistics.median(counts[1:] or counts or [0]))


def served(pair: SMCSD, method: str, prompt: list[int], config: SMCConfig) -> float:
    """Tokens/s of ``SERVED`` requests of ``method`` sent at once from as many threads (one batch)."""
    configs = [dataclasses.replace(config, seed=config.seed + i) for i in range(SERVED)]
    start = time.perf_counter()
    with ThreadPoolExecutor(SERVED) as pool:
        outs = list(pool.map(lambda c: pair.generate_ids([prompt], method=method, config=c)[0], configs))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def timings(
    pair: SMCSD, prompt: list[int], config: SMCConfig, repeats: int, methods: tuple[str, ...] = TIMED
) -> dict[str, dict]:
    """Every method: median tokens/s, tokens per target call and (HF backend) host reads per cycle."""
    warm = dataclasses.replace(config, max_new_tokens=16)
    for method in methods:
        run_method(pair, method, prompt, warm)
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for rep in range(repeats):  # interleaved, so machine noise hits every method alike
        for method in methods:
            runs[method].append(run_method(pair, method, prompt, dataclasses.replace(config, seed=rep)))
    out = {}
    for method, rs in runs.items():
        out[method] = {
            "tokens_per_s": round(statistics.median(r[0] for r in rs), 2),
            "tokens_per_target_call": round(statistics.median(r[1] for r in rs), 3),
        }
        if method != HF_GENERATE and pair.backend == "hf":
            out[method]["host_reads_per_cycle"] = host_reads(pair, method, prompt, config)
    ar = out["ar"]["tokens_per_s"]  # each backend's ratios are against its own AR
    for m in out.values():
        m["x_ar"] = round(m["tokens_per_s"] / ar, 3) if ar else None
    return out


@dataclasses.dataclass(frozen=True)
class CheckSettings:
    """What the device check runs.

    ``tiny``: tiny shapes (always on a CPU); ``backend="vllm"``: also time AR, SD and SMC-SD
    on vLLM engines over the same models.
    """

    tiny: bool = False
    max_new_tokens: int = 128
    prompt_tokens: int = 128
    repeats: int = 3
    backend: str = "hf"


def check(device: str | None = None, settings: CheckSettings = CheckSettings()) -> dict:
    """Run the whole check (on CUDA when there is one, else tiny on the CPU); the report as a dict."""
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = settings.tiny or device.type == "cpu"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    vocab = 512 if tiny else VOCAB_8B
    target = build("tiny-target" if tiny else "8b", vocab, str(device), seed=0)
    draft = build("tiny-draft" if tiny else "1b", vocab, str(device), seed=1)
    report = {"device": _device_name(device), "shapes": "tiny" if tiny else "8b target / 1b draft"}
    report["dtype"] = "bfloat16"
    errors = equivalence(target.model, vocab)
    report["equivalence_max_rel_err"] = {k: round(v, 5) for k, v in errors.items()}
    report["equivalence_ok"] = all(v <= BF16_TOL for v in errors.values())
    report["forward_ms"] = forward_ms(target.model, device)
    pair = SMCSD(target, draft, chat=False, forward="reference")
    n_new, g = settings.max_new_tokens, torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (settings.prompt_tokens,), generator=g).tolist()
    config = SMCConfig(n_particles=8, block_size=8, max_new_tokens=n_new, ignore_eos=True)
    report["config"] = {"n": 8, "k": 8, "max_new_tokens": n_new, "prompt_tokens": len(prompt)}
    report["methods"] = timings(pair, prompt, config, settings.repeats)
    report["ours"] = _ours(target, draft, prompt, config, settings.repeats)
    if settings.backend == "vllm":
        report["vllm"] = _on_vllm(target, draft, prompt, config, settings.repeats)
    report["peak_memory_bytes"] = _peak_memory(device)
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report


def _on_vllm(target: LoadedModel, draft: LoadedModel, prompt, config: SMCConfig, repeats: int) -> dict:
    """The same timings on vLLM engines (the models are written to disk once for them), or the error."""
    words = word_tokenizer(target.model.config.vocab_size)  # vLLM's engines load a tokenizer
    target, draft = dataclasses.replace(target, tokenizer=words), dataclasses.replace(draft, tokenizer=words)
    try:
        pair = SMCSD(target, draft, chat=False, backend="vllm")
        return timings(pair, prompt, config, repeats, methods=VLLM_TIMED)
    except Exception as err:  # report, not crash: the HF backend's figures stand
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def word_tokenizer(vocab: int):
    """A tokenizer whose token i is the word ``t<i>``: what random-weight models can be saved with."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"t{EOS}", unk_token="t0")


def _ours(
    target: LoadedModel, draft: LoadedModel, prompt: list[int], config: SMCConfig, repeats: int
) -> dict:
    """Our forward beside the models' own: equivalence, forward times, methods alone and served.

    On CUDA it is ``compiled`` (each forward shape a replayed CUDA graph); on a CPU ``auto``,
    whose parts run as they are unless built already (building them takes a minute).
    """
    device = next(target.model.parameters()).device
    forward = "compiled" if device.type == "cuda" else "auto"
    out = {"forward": forward}
    vocab = target.model.config.vocab_size
    errors = equivalence(target.model, vocab, lm=backend_of(target.model, forward))
    out["equivalence_max_rel_err"] = {k: round(v, 5) for k, v in errors.items()}
    out["forward_ms"] = forward_ms(target.model, device, make=lambda m: backend_of(m, forward))
    pair = SMCSD(target, draft, chat=False, forward=forward)
    out["methods"] = timings(pair, prompt, config, repeats, methods=OURS_TIMED)
    for method in ("ar", "smcsd"):  # the served AR, one particle, runs as the engine's request too
        rate = statistics.median(served(pair, method, prompt, config) for _ in range(repeats))
        out.setdefault("served", {})[f"{method} x{SERVED}"] = round(rate, 2)
    graphs = getattr(pair.target_lm, "graphs", None)
    out["graphs_captured"] = 0 if graphs is None else len(graphs.graphs)
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # the process's peak RSS
