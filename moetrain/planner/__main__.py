"""`python -m moetrain.planner CONFIG ...`: the same as `moetrain plan CONFIG ...`."""
import sys

from moetrain.planner.cli import main

sys.exit(main())
