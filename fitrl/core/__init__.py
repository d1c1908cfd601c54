"""The ground floor: what every other fitrl package may import, importing nothing of fitrl above it.

``errors`` (the exceptions that end a run with one line), ``registry`` (named choices with
did-you-mean), ``device`` (``trainer.device`` to a torch device) and ``padding`` (the column
layout helpers shared by rollout, log-probs and the critic). See docs/architecture.md.
"""
