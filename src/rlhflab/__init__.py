"""rlhflab: declarative RLHF experiments (Hydra + Lightning + MLflow)."""
