"""The model's files as the frontend needs them: its tokenizer and config.json.

The frontend never imports torch (docs/ARCHITECTURE.md).  A GGUF that no
process has converted yet is converted once by `python -m engine.models.loader`
in a child process, as a worker would do it; after that it is a directory lookup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.vocab.models import converted_dir, is_converted, model_source


def model_dir(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face directory of `model` (None: the default); blocks while converting."""
    path = model_source(model)
    if path.is_dir():
        return path
    out = converted_dir(path)
    if not is_converted(out):
        subprocess.run([sys.executable, "-m", "engine.models.loader", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
    return out
