"""The driver: the RL loop as dataflow, its logging and validation."""
