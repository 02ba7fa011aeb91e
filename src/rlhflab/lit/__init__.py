"""Lightning modules: RL, SFT and reward-model stages, and the data they read."""
