"""Roles (policy, reference) composed from pieces: a model, a training engine, a rollout engine."""
