"""``python -m sacplan`` runs the command line interface (see :mod:`sacplan.cli`)."""

import sys

from sacplan.cli import main

if __name__ == "__main__":
    sys.exit(main())
