"""fitrl: reinforcement-learning post-training that knows its memory.

Kept import-light on purpose: importing ``fitrl`` must not pull torch or transformers,
so the CLI answers ``--help`` and config errors in milliseconds.
"""

__version__ = "0.1.0"
