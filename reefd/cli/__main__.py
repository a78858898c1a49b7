"""`python -m reefd.cli`: the same as the `reefctl` console script."""

import sys

from reefd.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
