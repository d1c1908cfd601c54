"""Model helpers: tiny locally-built causal LMs for tests and demos."""
