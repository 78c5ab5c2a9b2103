"""Every code snippet of the docs and the README runs.

* The ```python blocks of each page run in order, in one namespace per page, as a reader
  would paste them. A block is skipped only when the line just before its fence is
  ``<!-- no-run -->`` (for code that needs what a test cannot have: a hub model, a GPU,
  your own files). Keep such blocks rare.
* A ``--8<-- "path"`` line in a block (pymdownx.snippets) runs the file it includes.
* Every ``smcsd ...`` command of a ```bash block must parse with the real argument parser,
  and every ``python path.py`` command must name an existing file.
* A ``print(...)`` whose comment begins ``# prints `` states its output: the line must print
  exactly that (the rest of the comment after `` — `` is prose). Seeds make it deterministic.
* Blocks that call ``smcsd serve`` at ``SERVE_URL`` call a live server of the embedded pair
  instead, started once on a free port.
* Pages that load the real model (``SMCSD.load``) or call the server are slow tests. ``SMCSD.load`` is cached
  per arguments for the whole session, so the model loads once however many pages use it.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from smcsd_ppl import SMCSD
from smcsd_ppl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")) + ["README.md"]
NO_RUN = "<!-- no-run -->"
SERVE_URL = "http://127.0.0.1:8000/v1"  # where the docs' snippets find `smcsd serve`
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
SNIPPET = re.compile(r"""^\s*--8<--\s+["']?(?P<path>[^"']+)["']?\s*$""")
STATED = re.compile(r"^\s*print\(.*\)\s*#\s*prints (?P<output>.+?)(\s+—\s.*)?$")


def code_blocks(text: str) -> list[tuple[str, int, str, bool]]:
    """(language, first line number, code, runnable) of every fenced block of a markdown page."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        language = (m["info"].strip().split() or [""])[0].strip("{.").lower()
        runnable = i == 0 or lines[i - 1].strip() != NO_RUN
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        blocks.append((language, start + 1, "\n".join(body), runnable))
        i += 1
    return blocks


def blocks_of(page: str, language: str) -> list[tuple[int, str, bool]]:
    """The page's blocks of one language (``--8<--`` includes resolved)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(line, _include(code), run) for lang, line, code, run in code_blocks(text) if lang == language]


def _include(code: str) -> str:
    out = []
    for line in code.splitlines():
        m = SNIPPET.match(line)
        out.append((ROOT / m["path"]).read_text(encoding="utf-8") if m else line)
    return "\n".join(out)


def _uses_model(page: str) -> bool:
    return any(
        "SMCSD.load(" in code or SERVE_URL in code for _, code, run in blocks_of(page, "python") if run
    )


def _python_pages() -> list:
    pages = [p for p in PAGES if blocks_of(p, "python")]
    return [pytest.param(p, marks=[pytest.mark.slow] if _uses_model(p) else []) for p in pages]


@functools.cache
def _load(*args, **kwargs) -> SMCSD:
    return _ORIGINAL_LOAD(*args, **kwargs)


_ORIGINAL_LOAD = SMCSD.load


@pytest.fixture
def shared_models(monkeypatch):
    """``SMCSD.load`` with one cached pair per distinct arguments, for the whole session."""
    monkeypatch.setattr(SMCSD, "load", staticmethod(_load))


@pytest.fixture(scope="session")
def served_url():
    """The ``/v1`` URL of ``smcsd serve`` on its own embedded pair, on a free port, for the session."""
    from smcsd_ppl.config import SMCConfig
    from smcsd_ppl.engine.client import Engine
    from smcsd_ppl.serving.app import build_app
    from smcsd_ppl.serving.server import BackgroundServer

    pair, config = _ORIGINAL_LOAD(), SMCConfig(n_particles=4, block_size=4)
    engine = Engine(pair.core, config)
    pair.use_engine(engine)
    app = build_app(engine, model_name=pair.target.name, defaults=config)
    with BackgroundServer(app) as server:
        yield server.url + "/v1"


class Printed:
    """``print`` for a snippet's namespace: prints, and keeps what each line of the snippet printed."""

    def __init__(self, filename: str):
        self.filename, self.lines = filename, defaultdict(list)

    def __call__(self, *args, sep=" ", end="\n", file=None, flush=False):
        frame = sys._getframe(1)
        if file is None and frame.f_code.co_filename == self.filename:
            self.lines[frame.f_lineno].append(sep.join(map(str, args)))
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)


def run_block(code: str, where: str, namespace: dict) -> None:
    """Run one block; each ``print`` stating its output (``# prints ...``) must print exactly that."""
    namespace["print"] = printed = Printed(where)
    try:
        exec(compile(code, where, "exec"), namespace)
    except Exception as err:
        raise AssertionError(f"the python block at {where} failed: {err!r}") from err
    for number, text in enumerate(code.splitlines(), 1):
        if m := STATED.match(text):
            out = "\n".join(printed.lines[number])
            assert out == m["output"], (
                f"{where} (line {number}) prints {out!r}; its comment says {m['output']!r}"
            )


@pytest.mark.parametrize("page", _python_pages())
def test_python_snippets_run(page, shared_models, tmp_path, monkeypatch, capsys, request):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace = {"__name__": f"docs_snippet_{Path(page).stem.replace('-', '_')}"}
    for line, code, runnable in blocks_of(page, "python"):
        if not runnable:
            continue
        if SERVE_URL in code:
            code = code.replace(SERVE_URL, request.getfixturevalue("served_url"))
        run_block(code, f"{page}:{line}", namespace)


def test_a_stated_output_that_differs_fails_the_page():
    # The mutant the check exists for: an example's printed date changed under its comment.
    code = 'date = "1969-07-20"\nprint(date)  # prints 1969-07-20 — as the prompt says\n'
    run_block(code, "page.md:1", {})
    with pytest.raises(AssertionError, match="prints '2019-07-20'; its comment says '1969-07-20'"):
        run_block(code.replace('"1969', '"2019'), "page.md:1", {})
    assert STATED.match("print(x)  # prints {'a': 1}")["output"] == "{'a': 1}"
    assert not STATED.match("print(x)  # the log Z")


def _commands(code: str) -> list[list[str]]:
    """Simple commands of a shell block: continuations joined, split at ``&&``, ``;`` and ``|``."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                while command and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]):
                    command.pop(0)  # environment assignments: OMP_NUM_THREADS=1 smcsd ...
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def _shell_pages() -> list[str]:
    return [p for p in PAGES if blocks_of(p, "bash")]


@pytest.mark.parametrize("page", _shell_pages())
def test_shell_commands_parse(page):
    parser = build_parser()
    for line, code, _ in blocks_of(page, "bash"):
        for command in _commands(code):
            where = f"{page}:{line}: {shlex.join(command)}"
            if command[0] == "smcsd":
                try:
                    parser.parse_args(command[1:])
                except SystemExit as err:
                    assert err.code == 0, f"{where} does not parse"
            elif command[0] in ("python", "python3") and command[1].endswith(".py"):
                assert (ROOT / command[1]).is_file(), f"{where}: no such file"


def test_snippets_import_only_installed_packages():
    # A snippet must run anywhere the package is installed, not only from a checkout's root.
    local = {p.stem for p in ROOT.iterdir() if p.is_dir() or p.suffix == ".py"} - {"smcsd_ppl"}
    for page in PAGES:
        for line, code, runnable in blocks_of(page, "python"):
            if not runnable:
                continue
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    assert name.split(".")[0] not in local, f"{page}:{line} imports {name} from the checkout"


def test_no_run_marker_is_rare():
    skipped = [(p, line) for p in PAGES for line, _, run in blocks_of(p, "python") if not run]
    assert len(skipped) <= 5, f"too many blocks marked {NO_RUN}: {skipped}"


def test_block_parser():
    text = 'x\n<!-- no-run -->\n```python\na = 1\n```\n\n```python title="t"\nb = 2\n```\n'
    assert code_blocks(text) == [("python", 4, "a = 1", False), ("python", 8, "b = 2", True)]
    assert _commands("OMP_NUM_THREADS=1 smcsd a \\\n  --b 1 && pip x # c\n") == [
        ["smcsd", "a", "--b", "1"],
        ["pip", "x"],
    ]


def test_cli_page_holds_the_current_reference():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs_hooks.py")
    docs_hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_hooks)
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "## smcsd generate" in page  # readable without building the site
    assert docs_hooks.with_reference(page) == page, "run: python docs_hooks.py"


def test_readme_date_regex_accepts_only_real_months_and_days():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pattern = re.search(r'RegexConstraint\(\s*r"([^"]+)"', readme)[1]
    assert re.fullmatch(pattern, "1969-07-20")
    for bad in ("1986-26-22", "1969-00-10", "1969-07-32", "1969-7-20"):
        assert not re.fullmatch(pattern, bad), bad
