"""Learner node: PPO on the trajectory segments the broker writes to Redis."""
