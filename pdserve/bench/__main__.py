"""`python -m pdserve.bench ...` = `pdserve bench ...`."""

import sys

from pdserve.bench.cli import main

sys.exit(main())
