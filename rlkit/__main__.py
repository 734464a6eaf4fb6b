"""`python -m rlkit ...` (used with torchrun) behaves like the `rlkit` command."""

import sys

from rlkit.cli import main

# Guarded: vLLM starts its engine processes with spawn, which imports this module again.
if __name__ == "__main__":
    sys.exit(main())
