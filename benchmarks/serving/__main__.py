"""`python -m benchmarks.serving ...` = `pdserve bench ...`."""
import sys

from benchmarks.serving.cli import main

sys.exit(main())
