"""The sharding backends: importing this package registers the built-in ones (FSDP2) with their
runtime (fitrl/distributed/sharding.py) and their memory planner (fitrl/memory/sharding.py).

Each backend keeps its whole footprint in its own folder (``fitrl/sharding/<name>/``): the only
code in fitrl that imports its primitives. docs/architecture.md, "Adding a sharding backend".
"""

from fitrl.sharding import fsdp2  # noqa: F401  (registers "fsdp2")
