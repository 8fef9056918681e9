"""``python -m overlap_spec``: the same command line as ``overlap-spec``."""

import sys

from overlap_spec.harness.cli import main

sys.exit(main())
