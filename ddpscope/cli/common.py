"""Small pieces the subcommands share: exit statuses, error text, argument types.

Kept free of heavy imports: every subcommand module imports this to build
the parser.
"""

from __future__ import annotations

import argparse

#: Exit status for input that cannot be read (report, dump, export, compare, replay).
EXIT_UNREADABLE = 3


def describe_error(exc: BaseException) -> str:
    """One line for an error reading input: the file and the reason."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value
