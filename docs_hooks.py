"""MkDocs hook: render the ``smcsd`` CLI reference from the argument parser at build time.

``docs/cli.md`` holds the line ``<!-- cli-reference -->``; this hook replaces it with the
help of ``smcsd`` and of each subcommand, from ``smcsd_ppl.cli.build_parser()``, so the page
always matches the installed command line.
"""

from __future__ import annotations

import argparse

MARKER = "<!-- cli-reference -->"
WIDTH = 100


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the marker of the CLI page with the rendered help texts."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())


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
