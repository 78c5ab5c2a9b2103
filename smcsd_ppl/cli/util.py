"""Helpers of the ``smcsd`` command line: help layout, user errors, prompts, progress.

This module imports only the standard library, so that ``smcsd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

PROG = "smcsd"

# What a user's mistake raises (a bad value, an unusable path, text that is not UTF-8).
# main() turns these into one line and exit status 2; anything else is a bug and keeps its traceback.
# ArgumentTypeError: a type check (cut_value) also runs outside argparse, on comma lists.
USER_ERRORS = (ValueError, OSError, argparse.ArgumentTypeError)


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default in its help, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


# Flags people bring from vLLM, llama.cpp and the OpenAI API, and ours that mean the same: a
# misspelling's nearest name would mislead (--temperature is nearest --draft-temperature).
FOREIGN_FLAGS = {
    "--temperature": "--target-temperature",
    "--temp": "--target-temperature",
    "--max-tokens": "--max-new-tokens",
    "--max-completion-tokens": "--max-new-tokens",
    "--n-predict": "--max-new-tokens",
    "--n": "--particles",
    "--num-particles": "--particles",
    "--n-particles": "--particles",
    "--served-model-name": "--model-name",
    "--tensor-parallel-size": "--tensor-parallel",
    "--draft-model": "--draft",
    "--speculative-model": "--draft",
    "--num-speculative-tokens": "--block-size",
    "--draft-max": "--block-size",
}


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` using ``HelpFormatter`` (subcommands included), whose errors are one line.

    Options must be spelled out: a prefix or a misspelling (``--particle``) is refused at once,
    with the nearest option named, before the word after it could be taken for the prompt.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """``ArgumentParser.parse_known_args``, after refusing any option this parser does not know."""
        args = sys.argv[1:] if args is None else list(args)
        self._refuse_unknown_options(args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        """Exit with status 2 and one line (the usage is one ``--help`` away)."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def _refuse_unknown_options(self, args: list[str]) -> None:
        known = list(self._option_string_actions)
        for word in args:
            if word == "--":
                return
            if not _looks_like_an_option(word):
                if self._subparsers is not None:
                    return  # the subcommand's name: what follows is its own parser's to judge
                continue
            name = word.split("=", 1)[0] if word.startswith("--") else word[:2]  # -n4 is -n 4
            if name not in known:
                self.error(f"unrecognized option {name} ({_hint(name, known, self.prog)})")


def _hint(name: str, known: list[str], prog: str) -> str:
    """Our flag for a flag another tool spells differently, else the nearest name, else ``--help``."""
    ours = FOREIGN_FLAGS.get(name)
    if ours in known:
        return f"{prog} calls it {ours}"
    near = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {near[0]}?" if near else f"{prog} --help lists the options"


def _looks_like_an_option(word: str) -> bool:
    """Whether argparse reads ``word`` as an option (not '-', a negative number or words with a space)."""
    return word.startswith("-") and word != "-" and not re.match(r"-\.?\d", word) and " " not in word


def user_error(err: BaseException) -> str:
    """One line saying what went wrong, without the exception's type."""
    if isinstance(err, OSError) and err.strerror:
        where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
        text = f"{where}: {err.strerror}" if where else err.strerror
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())  # a message must stay on one line


QUIET = {"on": False}  # --quiet: standard error says nothing but errors


def err(msg: str) -> None:
    """Print a line on standard error (unless ``--quiet``; errors go through ``say_error``)."""
    if not QUIET["on"]:
        print(msg, file=sys.stderr)


def say_error(msg: str) -> None:
    """Print an error's line on standard error, ``--quiet`` or not."""
    print(msg, file=sys.stderr)


def check_threads(threads: int | None) -> None:
    """Refuse a thread count below 1 or above the CPU cores this process may use."""
    from ..config import check_threads as check

    check(threads, "--threads")


def read_prompt(text: str) -> str:
    """The prompt argument, or standard input for ``-``; checked before any model loads."""
    from ..text import check_prompt

    if text == "-":
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"standard input is not UTF-8 text (byte {e.start})") from e
    return check_prompt(text)


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any model loads, an output that is not a regular file we can write.

    Records are appended and resumed, so a device or pipe (``/dev/stdout``) cannot serve.
    """
    p = Path(path)
    if p.exists():
        if not p.is_file():
            raise ValueError(f"{flag} {path}: not a regular file; give the path of a JSONL file")
        if not os.access(p, os.R_OK | os.W_OK):
            raise ValueError(f"{flag} {path}: permission denied")
        return
    check_output_dir(p.parent, flag)


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """Refuse a directory that cannot be created or written to."""
    p = Path(path).absolute()
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: permission denied in {existing}")


def csv(text: str, kind: type, flag: str) -> list:
    """Comma-separated values of one type, at least one."""
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from e
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


@contextmanager
def status(msg: str):
    """Say on standard error what is about to take a while."""
    err(msg + " ...")
    yield


@contextmanager
def progress(total: int, unit: str):
    """A progress bar on a terminal's stderr that appears only when work takes more than a moment.

    It leaves no trace once done; where stderr is a file or a pipe there is none (its redraws
    would stay in the log).
    """
    from tqdm import tqdm

    quiet = QUIET["on"] or not sys.stderr.isatty()
    with tqdm(total=total, unit=unit, delay=1.0, leave=False, file=sys.stderr, disable=quiet) as bar:

        def update(n: int) -> None:
            bar.update(max(0, min(n, total) - bar.n))

        yield update


def twist_value(text: str) -> str | None:
    """``--twist``'s value: a twist's name (``config.TWIST_NAMES``), or ``off``."""
    from ..config import TWIST_NAMES

    name = text.strip().lower()
    if name in ("off", "none"):
        return None
    if name not in TWIST_NAMES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(TWIST_NAMES)} or 'off', got {text!r}")
    return name


def logit_bias_value(text: str) -> tuple[tuple[int, float], ...]:
    """``--logit-bias``'s value: ``ID:BIAS`` pairs, comma-separated."""
    try:
        pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return tuple((int(token), float(bias)) for token, bias in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID:BIAS pairs, comma-separated, got {text!r}") from None


def cut_value(text: str) -> float | None:
    """``--cut``'s value: a number, or ``off`` for the paper's uncut algorithm."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None
