"""Entry point of the ``ddpscope`` command: builds the parser and dispatches.

Each subcommand is a small class in its own module with ``name``, ``help``,
``add_arguments(parser)`` and ``run(args) -> int``. Adding one (watch, report,
replay) means writing the module and adding a line to ``COMMANDS``. The
modules are imported to build the parser, so they keep heavy imports (textual,
the analysis code) inside ``run``: ``ddpscope --help`` and ``ddpscope run``
stay fast, and nothing here pulls in torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence
from typing import Protocol

import ddpscope


class Command(Protocol):
    #: Subcommand name, as typed on the command line.
    name: str
    #: One line for ``ddpscope --help``.
    help: str
    #: Longer text for ``ddpscope NAME --help``.
    description: str
    #: Text after the options in ``ddpscope NAME --help`` (examples).
    epilog: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


#: "module:Class" of every subcommand, in the order --help lists them.
COMMANDS: tuple[str, ...] = (
    "ddpscope.cli.run:RunCommand",
    "ddpscope.cli.dump:DumpCommand",
    "ddpscope.cli.report:ReportCommand",
    "ddpscope.cli.compare:CompareCommand",
    "ddpscope.cli.export:ExportCommand",
    "ddpscope.cli.watch:WatchCommand",
    "ddpscope.cli.replay:ReplayCommand",
    "ddpscope.cli.relay:RelayCommand",
    "ddpscope.cli.keys:KeysCommand",
)


def _load(target: str) -> Command:
    module, _, cls = target.partition(":")
    command: Command = getattr(importlib.import_module(module), cls)()
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpscope",
        description="See inside PyTorch DistributedDataParallel runs.",
    )
    parser.add_argument("--version", action="version", version=f"ddpscope {ddpscope.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for target in COMMANDS:
        command = _load(target)
        p = sub.add_parser(
            command.name,
            help=command.help,
            # Raw formatting keeps the epilog's example lines; wrap the prose ourselves.
            description=textwrap.fill(command.description, width=79),
            epilog=command.epilog or None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(p)
        p.set_defaults(_command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse errors give 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, --version, usage errors: keep main() returning
        return exc.code if isinstance(exc.code, int) else 2
    command: Command = args._command
    try:
        return command.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ddpscope dump ... | head`: the reader went away, which is not an error.
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
