"""`python -m heteroflow` runs the CLI."""

import sys

from heteroflow.cli import main

sys.exit(main())
