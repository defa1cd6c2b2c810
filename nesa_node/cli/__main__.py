"""`python -m nesa_node.cli ...`: the same as the `nesa-node` command."""

import contextlib
import sys

from nesa_node.cli import main

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
