import sys

from maxtext_rocm.checkpoint.cli import main

sys.exit(main())
