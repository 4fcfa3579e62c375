"""The `rldyn` command line: one sub-command per job, each a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import sys

from rldynamics import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rldyn",
        description="rldynamics: RL training of language-model agents with training-dynamics diagnostics.",
    )
    parser.add_argument("--version", action="version", version=f"rldynamics {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
