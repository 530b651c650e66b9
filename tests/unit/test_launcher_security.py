"""`splitserve up` hands the frontend its trust flags: keys through the environment only."""

from __future__ import annotations

import argparse

import pytest

from services.launcher import add_up_args, cmd_up, frontend_env, frontend_security_argv


def up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(list(argv))


def test_keys_go_to_the_environment_never_to_argv() -> None:
    args = up_args("--api-key", "sk-flag", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                   "--cache-isolation", "tenant")
    argv = frontend_security_argv(args)
    assert argv == ["--cache-isolation", "tenant", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
    env = frontend_env(args, {"PATH": "/bin", "SPLITSERVE_API_KEY": "sk-env"})
    assert env["SPLITSERVE_API_KEY"] == "sk-flag,sk-env" and env["PATH"] == "/bin"
    assert not any("sk-" in a for a in argv)


def test_bad_trust_flags_stop_up_before_it_starts_anything(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert cmd_up(up_args("--cache-isolation", "tenant")) == 2  # no key to tell tenants apart
    assert "cache_isolation" in capsys.readouterr().err
