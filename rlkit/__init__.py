"""rlkit: composable command-line stages for RL post-training of language models.

Importing this package is cheap: no torch, transformers or pyarrow at import time.
"""

__version__ = "0.1.0"
