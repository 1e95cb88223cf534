import sys

from benchmarks.chaos.cli import main

sys.exit(main())
