"""Rollouts: generators, the rollout carrier, buffers and weight sync."""
