"""RL math: advantage estimators, policy losses, KL estimators. Pure tensor functions only:
nothing here imports a model, a worker or a config loader."""
