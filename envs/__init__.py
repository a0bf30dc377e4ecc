"""Environments that play against a PPOZ broker as ordinary protocol clients.

Each environment is a `TextEnv` (envs/base.py): it turns its state into a
protocol observation (prompt, question, candidate action strings) and takes
the index of the chosen candidate. `envs/runner.py` plays many of them in
parallel through the real client.
"""
