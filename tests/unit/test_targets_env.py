"""benchmarks.targets starts its peers (vLLM, llama.cpp) without the OpenMP
setting the engine's import makes for its own kernels: under a passive wait
llama.cpp's decode ran at a third of its speed, which made its figures wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os
import benchmarks.targets as t
import engine
print(json.dumps({"here": os.environ.get("OMP_WAIT_POLICY"),
                  "peers": t.peer_environ().get("OMP_WAIT_POLICY", "unset")}))
"""


def probe(policy: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_peers_do_not_inherit_the_engines_openmp_setting() -> None:
    seen = probe(None)
    assert seen["here"] == "PASSIVE", "the engine's import sets a passive wait for its own kernels"
    assert seen["peers"] == "unset", "the peers got the engine's setting"


def test_the_peers_keep_a_setting_the_user_made() -> None:
    assert probe("ACTIVE") == {"here": "ACTIVE", "peers": "ACTIVE"}
