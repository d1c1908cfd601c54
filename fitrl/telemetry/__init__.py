"""Measuring memory and time: per-phase timers and memory readings."""
