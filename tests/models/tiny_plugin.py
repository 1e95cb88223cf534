"""Test helpers for the example out-of-tree architecture (examples/tiny_arch)."""

from __future__ import annotations

from pathlib import Path

EXAMPLE_ROOT = Path(__file__).resolve().parents[2] / "examples" / "tiny_arch"
"""On sys.path (or PYTHONPATH), `import tiny_arch` finds the example plugin package."""


def write_entry_point_dist(site: Path) -> Path:
    """A minimal installed-distribution record under `site` declaring the example's
    `pdserve.model_plugins` entry point — what `pip install examples/tiny_arch` would leave,
    without touching the shared virtualenv. Put `site` on sys.path / PYTHONPATH."""
    dist = site / "pdserve_tiny_arch-0.1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pdserve-tiny-arch\nVersion: 0.1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[pdserve.model_plugins]\ntiny_arch = tiny_arch:register\n"
    )
    return site
