"""The learner serves its snapshots to other hosts (`[learner] weights_serve`): an actor's host fetches what the
learner published from it; off loopback it needs CURVE."""

from __future__ import annotations

import pytest
import torch

from common import weights
from common.shared_settings import PolicySpec, StoreSettings
from common.snapshot_serve import ServedSnapshots
from learner_node.config import LearnerConfig
from models.policy_model import policy_state_dict
from tests.learner_node.test_pending import make_learner


def test_an_actor_host_fetches_what_the_learner_published_from_its_server(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    store = StoreSettings(redis_url=redis_url, key_prefix=key_prefix, weights_dir=str(tmp_path / "snapshots"))
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path, weights_serve="tcp://127.0.0.1:*", store=store)
    try:
        assert learner.snapshot_server is not None
        ann = weights.latest(redis_client, key_prefix)
        assert ann is not None, "the learner's start published nothing"
        got = weights.fetch(None, key_prefix, ann, ServedSnapshots(learner.snapshot_server.endpoint))
        want = policy_state_dict(learner.lp.model)
        assert got.keys() <= want.keys() and all(torch.equal(got[name], want[name]) for name in got)
    finally:
        learner.close()


def test_serving_weights_off_loopback_needs_curve(tiny_models, redis_url) -> None:
    common = {"policy": PolicySpec(model=tiny_models["llama"]), "store": StoreSettings(redis_url=redis_url)}
    with pytest.raises(ValueError, match="reachable from other machines"):
        LearnerConfig(**common, weights_serve="tcp://0.0.0.0:5558")
    assert LearnerConfig(**common, weights_serve="tcp://127.0.0.1:5558").weights_serve
