"""MkDocs hook: the ``smcsd`` CLI reference, rendered from the argument parser.

``docs/cli.md`` holds the help of ``smcsd`` and of each subcommand, from
``smcsd_ppl.cli.build_parser()``, between the lines ``START`` and ``END``, so that the page
reads fully outside the built site too. The hook renders it afresh at build time, and
``python docs_hooks.py`` rewrites the file (a test checks that it is current).
"""

from __future__ import annotations

import argparse
from pathlib import Path

START = "<!-- cli-reference:start -->"
END = "<!-- cli-reference:end -->"
WIDTH = 100


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Render the CLI reference of the CLI page from the parser."""
    if START not in markdown:
        return markdown
    return with_reference(markdown)


def with_reference(markdown: str) -> str:
    """``markdown`` with the text between ``START`` and ``END`` replaced by ``cli_reference()``."""
    head, rest = markdown.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + START + "\n\n" + cli_reference() + "\n" + END + tail


def cli_reference() -> str:
    """Markdown: the top-level help, then one section per subcommand."""
    from smcsd_ppl.cli import build_parser

    parser = build_parser()
    parts = ["## smcsd", "", _help_block(parser)]
    for name, sub, summary in _subcommands(parser):
        parts += ["", f"## smcsd {name}", ""]
        if summary:
            parts += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
        parts.append(_help_block(sub))
    return "\n".join(parts) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of every subcommand, in the order they were added."""
    out = []
    for action in parser._actions:  # argparse keeps subcommands only in this (stable) private list
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return out


def _help_block(parser: argparse.ArgumentParser) -> str:
    """``parser.format_help()`` at a fixed width, without colour, in a text fence."""
    cls = parser.formatter_class
    parser.formatter_class = lambda prog: cls(prog, width=WIDTH)
    if hasattr(parser, "color"):  # Python >= 3.14 may colour help for terminals
        parser.color = False
    try:
        text = parser.format_help()
    finally:
        parser.formatter_class = cls
    return "```text\n" + text.rstrip() + "\n```"


if __name__ == "__main__":
    page = Path(__file__).resolve().parent / "docs" / "cli.md"
    page.write_text(with_reference(page.read_text(encoding="utf-8")), encoding="utf-8")
