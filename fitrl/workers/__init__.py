"""Worker groups: how the driver reaches roles, in one process or (later) across Ray actors."""
