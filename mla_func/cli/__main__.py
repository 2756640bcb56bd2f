"""`python -m mla_func.cli ARGS`: the `mla-func` command, where its script is not on PATH."""

import sys

from mla_func.cli.commands import main

sys.exit(main())
