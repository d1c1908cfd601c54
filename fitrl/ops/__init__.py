"""Tensor operations shared by roles (log-probs from logits, ...)."""
