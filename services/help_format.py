"""What every command's flags share: --help that shows each flag's default next to
what it does, --host, and flags given again as argv (for a process `up` starts)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it
    or there is none to say (no value, or off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def with_defaults(parser: argparse.ArgumentParser) -> None:
    """This parser and every subcommand's print defaults in --help."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                with_defaults(sub)


def add_host_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                 listener: str = "this service") -> None:
    """--host, the same for every command: loopback unless told otherwise."""
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address {listener} listens on (0.0.0.0: every interface)")


def given_argv(args: argparse.Namespace, dests: Iterable[str], switches: Iterable[str] = ()) -> list[str]:
    """The flags among `dests` that were given a value (not None) and the `switches`
    (store_true flags) that are on, as argv again: what `up` passes to a process."""
    out: list[str] = []
    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None:
            out += [f"--{dest.replace('_', '-')}", str(value)]
    return out + [f"--{dest.replace('_', '-')}" for dest in switches if getattr(args, dest, False)]
