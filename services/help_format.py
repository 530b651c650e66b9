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
