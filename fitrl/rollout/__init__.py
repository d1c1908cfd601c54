"""Rollout engines behind one interface: ``generate(prompts, sampling) -> Batch``."""
