"""`ppoz train`: PPO on a prompt dataset. Dataset drivers are clients of the broker like any
environment: they send each prompt with `generate`, score the response with the configured reward
and send it back with `feedback`; the broker, actors and learner are the ones every mode uses."""
