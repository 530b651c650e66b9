"""python -m services.frontend --decode host:port[,...] [--prefill host:port[,...]] ...
(also `splitserve frontend ...`)."""

from __future__ import annotations

import faulthandler
import signal
import sys

from services.frontend.app import run
from services.frontend.config import parse_config


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 PID`: every thread's Python stack to stderr (a stop that hangs, a stuck request).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        config = parse_config(argv)
    except ValueError as e:
        print(f"frontend: {e}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
