"""The `mla-func` command line.
"""

from mla_func.cli.commands import main

__all__ = ["main"]
