import sys

from pdserve.chaos.cli import main

sys.exit(main())
