import sys

from maxtext_rocm.eval.cli import main

sys.exit(main())
