"""The import rules and invariants of docs/ARCHITECTURE.md hold in the code.

The rules are import-linter contracts in pyproject.toml ([tool.importlinter]);
a break prints the offending import chain.  The other tests keep the contracts
honest: the vocabulary rule names every engine module but the vocabulary, a
fresh frontend process loads no torch, and every invariant the code cites by
number is one the document states.
"""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import engine

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PRODUCT = ("engine", "kvtransfer", "services", "protos")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def contracts() -> dict[str, dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_the_import_rules_hold() -> None:
    res = run_python("import sys\nfrom importlinter.cli import lint_imports\n"
                     "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in res.stdout, res.stdout


def test_the_vocabulary_rule_names_every_other_engine_module() -> None:
    forbidden = set(contracts()["vocabulary"]["forbidden_modules"])
    others = {f"engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)} - {"engine.vocab"}
    assert others - forbidden == set(), "add these to the 'vocabulary' contract in pyproject.toml"
    assert "engine.vocab" not in forbidden and others


def test_the_frontend_process_loads_no_torch_and_only_the_engine_vocabulary() -> None:
    res = run_python("import sys\nimport services.frontend.app, services.frontend.__main__, services.index\n"
                     "print(' '.join(sorted(sys.modules)))")
    assert res.returncode == 0, res.stderr
    loaded = set(res.stdout.split())
    assert "services.frontend.app" in loaded
    heavy = {"torch", "triton", "transformers", "safetensors", "xgrammar", "ucxx", "kvtransfer"}
    assert loaded & heavy == set()
    engine_modules = {m for m in loaded if m == "engine" or m.startswith("engine.")}
    assert {m for m in engine_modules if m != "engine" and not m.startswith("engine.vocab")} == set()


def cited_invariants(text: str) -> set[int]:
    """Numbers cited as "invariant 3" or "invariants 3, 4 and 6"."""
    cited: set[int] = set()
    for match in re.finditer(r"\binvariants? (\d+(?:(?:, | and )\d+)*)", text):
        cited |= {int(n) for n in re.findall(r"\d+", match.group(1))}
    return cited


def test_every_cited_invariant_is_stated_in_the_architecture_doc() -> None:
    stated = {int(n) for n in re.findall(r"^(\d+)\. \*\*", DOC.read_text().split("## Invariants")[1],
                                         re.MULTILINE)}
    assert stated == set(range(1, len(stated) + 1)) and len(stated) >= 9
    cited: dict[int, list[str]] = {}
    for path in [*ROOT.glob("*/**/*.py"), *ROOT.glob("protos/*.proto")]:
        if path.parts[len(ROOT.parts)] not in (*PRODUCT, "tests", "benchmarks") or path.samefile(__file__):
            continue
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path}: cite docs/ARCHITECTURE.md, which a clone has"
        for n in cited_invariants(text):
            cited.setdefault(n, []).append(str(path.relative_to(ROOT)))
    assert cited, "no citation found: the pattern is wrong"
    assert {n: where for n, where in cited.items() if n not in stated} == {}
    readme = (ROOT / "README.md").read_text()
    assert "docs/ARCHITECTURE.md" in readme and "DESIGN.md" not in readme
