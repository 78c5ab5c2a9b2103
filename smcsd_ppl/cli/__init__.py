"""The ``smcsd`` command line: the only part of the package that prints."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
