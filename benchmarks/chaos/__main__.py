import sys

from benchmarks.chaos.run import main

sys.exit(main())
