"""Synthetic on-policy data for learner tests, scored by the actor's own policy code."""

from __future__ import annotations

import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from common.segments import CandidateObservation, Segment, Transition

BANDIT = {"prompt": "Pick the best colour.", "question": " Answer: ", "action": ["red", "green", "blue"]}


def on_policy_segments(model, tokenizer, n: int, version: int = 0, seed: int = 0, normalisation: str = "token"):
    """n one-step bandit episodes sampled by the actor's policy code from `model` (reward 1 for "green")."""
    actor = LLMPolicy(model, tokenizer, SamplingConfig(normalisation=normalisation, seed=seed), "packed")
    actor.policy_version = version
    segments = []
    with torch.no_grad():
        choices = actor.choose_batch([{"job": i, "task_id": f"t{i}", "obs": BANDIT} for i in range(n)])
    for i, choice in enumerate(choices):
        t = Transition(
            obs=CandidateObservation.from_wire(BANDIT),
            action=choice.action,
            logprob=choice.logprob,
            probs=choice.probs,
            policy_version=version,
            reward=1.0 if choice.action == 1 else 0.0,
            done=True,
            truncated=False,
            mode="step",
        )
        segments.append(
            Segment(seg_id=f"t{i}:0", task_id=f"t{i}", seq=0, reason="done", done=True, truncated=False, next_obs=None, transitions=[t])
        )
    return segments
