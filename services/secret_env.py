"""Secrets from the environment: `NAME` itself, or the file `NAME_FILE` names
(how compose secrets and Kubernetes secret volumes hand them over, so that
they appear in no image, no argv and no `docker inspect`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def secret_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of $NAME, else the contents of the file $NAME_FILE names
    (stripped); None when neither is set.  An unreadable or empty file is an
    error (SystemExit naming the variable), not 'no secret'."""
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value:
        return value
    path = env.get(f"{name}_FILE")
    if not path:
        return None
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise SystemExit(f"{name}_FILE={path}: cannot read it: {e}") from None
    if not value:
        raise SystemExit(f"{name}_FILE={path}: the file is empty")
    return value


def redis_password() -> str | None:
    """For Redis URLs without one: $SPLITSERVE_REDIS_PASSWORD or its _FILE."""
    return secret_from_env("SPLITSERVE_REDIS_PASSWORD")
