"""Memory strategies: how policy, reference, reward and value share weights."""
