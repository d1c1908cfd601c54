"""Roles (policy, reference) composed from pieces: a model, a training engine, a rollout engine."""

# The sharding backends register before any role runs: the roles ask a model whether it is sharded
# (fitrl/distributed/sharding.py, ``backend_of``), which only a registered backend can answer.
import fitrl.sharding  # noqa: E402,F401
