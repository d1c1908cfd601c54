"""fitrl: reinforcement-learning post-training that knows its memory.

Kept import-light on purpose: importing ``fitrl`` must not pull torch or transformers,
so the CLI answers ``--help`` and config errors in milliseconds.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``fitrl.train`` and ``fitrl.GRPOConfig``: the Python API (fitrl/api.py), imported on first
    use. By module name, not an import statement: every layer reads this package's ``__version__``,
    and a static import of the top layer here would make each of them import upward (pyproject.toml,
    the layers contract)."""
    if name in ("train", "GRPOConfig"):  # GRPOConfig: TRL's names for fitrl.train(args=...)
        import importlib

        return getattr(importlib.import_module("fitrl.api"), name)
    raise AttributeError(f"module 'fitrl' has no attribute {name!r}")
