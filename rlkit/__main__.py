"""`python -m rlkit ...` (used with torchrun) behaves like the `rlkit` command."""

import sys

from rlkit.cli import main

sys.exit(main())
