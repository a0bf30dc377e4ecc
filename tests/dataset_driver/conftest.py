"""The stack the driver tests drive: a real broker, an LLM actor serving a tiny words model, Redis."""

from __future__ import annotations

import pytest

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from models.policy_model import ModelSpec, load_policy
from tests.helpers import actors_ready, wait_for


@pytest.fixture(scope="module")
def words_llm(tiny_model):
    return load_policy(ModelSpec(model=tiny_model("llama", tokenizer="words"), device="cpu", lora_rank=0))


@pytest.fixture
def stack(start_broker, start_actor, make_client, words_llm):
    model, tokenizer = words_llm
    broker = start_broker(segment_len=4)
    start_actor(broker.backend, credits=8, policy=LLMPolicy(model, tokenizer, SamplingConfig(seed=1)))
    client = make_client(broker.frontend, deadline=60)  # a few tokens of the tiny model on an actor thread: 0.05-0.5 s; x100
    wait_for(lambda: actors_ready(client, 1), what="the actor to register")
    return broker
