"""Worker groups: how the driver reaches roles, in one process (``group.py``) or one Ray actor per
rank (``ray_group.py``, with ``ray_placement``, ``ray_actor`` and ``ray_failures``)."""
