"""`python -m jaxrl.bench [flags]`: see `jaxrl/bench/__init__.py` for the flags of each runner."""

import sys

from jaxrl.bench.cli import main

sys.exit(main())
