"""`splitserve up` takes every flag `splitserve frontend` takes: its own (host,
ports, routing, trust flags...) or handed over as given."""

from __future__ import annotations

import argparse

from services.cli import add_engine_args
from services.frontend.config import build_parser as frontend_parser
from services.launcher import add_up_args, frontend_passthrough_argv


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)  # as `splitserve up` builds it
    add_up_args(p)
    return p


def test_every_frontend_flag_is_an_up_flag() -> None:
    up = up_parser()._option_string_actions
    missing = [o for a in frontend_parser()._actions for o in a.option_strings if o not in up]
    assert not missing


def test_given_frontend_flags_reach_the_frontend_and_parse_there() -> None:
    args = up_parser().parse_args(["--request-timeout", "30", "--max-migrations", "2", "--tool-call-parser",
                                   "llama3_json", "--max-waiting-requests", "8", "--queue-weight", "0.5"])
    argv = frontend_passthrough_argv(args)
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    assert pairs == {"--max-waiting-requests": "8", "--queue-weight": "0.5", "--request-timeout": "30.0",
                     "--max-migrations": "2", "--tool-call-parser": "llama3_json"}
    fe = frontend_parser().parse_args(["--decode", "127.0.0.1:1", *argv])
    assert (fe.request_timeout, fe.max_migrations, fe.tool_call_parser, fe.max_waiting_requests,
            fe.queue_weight) == (30.0, 2, "llama3_json", 8, 0.5)
    assert frontend_passthrough_argv(up_parser().parse_args([])) == []  # the frontend's own defaults


def test_every_flag_says_what_it_does_and_its_default() -> None:
    for action in up_parser()._actions:
        if action.option_strings and action.dest.startswith("frontend__"):
            assert action.help and "default" in action.help, action.option_strings


def every_parser() -> dict[str, argparse.ArgumentParser]:
    import importlib

    from services import cli

    parsers = {"frontend": frontend_parser()}
    for role in ("prefill", "decode"):
        parsers[role] = importlib.import_module(f"services.{role}.__main__").build_parser()
    for name in cli.BENCHMARKS:  # `splitserve bench NAME` hands its flags to benchmarks/NAME.py
        parsers[f"bench {name}"] = importlib.import_module(f"benchmarks.{name}").build_parser()

    def walk(prefix: str, p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if sub._actions[1:]:  # the service stubs hand their flags on
                        parsers[f"{prefix}{name}"] = sub
                    walk(f"{prefix}{name} ", sub)

    walk("", cli.build_parser())
    return parsers


def test_every_command_line_flag_has_help_and_shows_its_default() -> None:
    for name, parser in every_parser().items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[-1]
            assert action.help, f"splitserve {name} {flag}: no help"
            if action.default not in (None, False, argparse.SUPPRESS) and action.help != argparse.SUPPRESS:
                at = text.index(flag + " ", text.index("options:") if "options:" in text else 0)
                assert "default" in text[at:at + 400], f"splitserve {name} {flag}: help shows no default"


def test_kv_cache_dtype_reaches_both_workers_and_parses_there() -> None:
    from services.decode.__main__ import build_parser as decode_parser
    from services.launcher import engine_argv
    from services.prefill.__main__ import build_parser as prefill_parser

    argv = engine_argv(up_parser().parse_args(["--kv-cache-dtype", "fp8_e5m2"]))
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    for parser in (prefill_parser(), decode_parser()):
        assert parser.parse_args(argv).kv_cache_dtype == "fp8_e5m2"
