"""The scripts under test live in benchmarks/, a folder of scripts (not a package, not in the
wheel) that import each other as siblings: it goes first on the path, as running one does."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
