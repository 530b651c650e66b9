"""--help that shows every flag's default next to what the flag does."""

from __future__ import annotations

import argparse


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
