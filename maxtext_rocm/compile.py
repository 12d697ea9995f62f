"""`python -m maxtext_rocm.compile CONFIG.py[:VARIANT] --target=GPU:NODESxGPUS [--comm] [--config.KEY=VALUE ...]`:
the planner's command line. The planner itself is maxtext_rocm/planner/ (report.py reads this
command's arguments, compiles the step for faked GPU nodes and prints the fit and the traffic)."""

import sys

from maxtext_rocm.planner.report import main

if __name__ == "__main__":
    sys.exit(main())
