"""Rewards for generation-mode training: functions (verl's signature and built-ins), a local reward
model, an LLM judge over a chat-completions API, and weighted compositions of them. They run in the
dataset drivers (clients), never in the learner."""
