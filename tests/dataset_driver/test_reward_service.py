"""`[train] reward_service`: the drivers' rm_score and judge_score come from a running reward service."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load
from dataset_driver.config import TrainConfig
from dataset_driver.run import build_reward
from rewards.composite import Item
from rewards.reward_model import RewardModel, RewardModelConfig
from rewards.service import RemoteJudge, RemoteRewardModel
from tests.helpers import command_help
from tests.rewards.test_service import local_judge, serving
from tools.bench.judge_stand_in import chat_server


def test_build_reward_asks_the_service_and_loads_no_model_itself(tiny_reward_model) -> None:
    rm_dir = tiny_reward_model()
    items = [Item("What is 1+1?", "\\boxed{2}", "2", "math"), Item("What is 2+2?", "\\boxed{5}", "4", "math")]
    expected_rm = RewardModel(RewardModelConfig(rm_dir)).score([(i.prompt, i.response) for i in items])
    with (
        chat_server(lambda body, n: "Score: 1") as api,
        serving(RewardModel(RewardModelConfig(rm_dir)), local_judge(api.base_url)) as service,
    ):
        weighted = build_reward(
            TrainConfig(
                data="x.jsonl",
                reward_service=service.endpoint,
                reward_fn="math",
                weights={"rule_score": 0.5, "rm_score": 0.25, "judge_score": 0.25},
            )
        )
        assert isinstance(weighted.reward_model, RemoteRewardModel) and isinstance(weighted.judge, RemoteJudge)
        scored = weighted.score(items)
        # no weights: what the service hosts counts 1.0 each (and no reward function unless one is named)
        hosted = build_reward(TrainConfig(data="x.jsonl", reward_service=service.endpoint))
        assert hosted.weights == {"rm_score": 1.0, "judge_score": 1.0} and hosted.reward_fn is None
    assert [s.components["rm_score"] for s in scored] == pytest.approx(expected_rm, abs=1e-5)
    assert [s.components["judge_score"] for s in scored] == [1.0, 1.0] and len(api.requests) == 2
    assert [s.reward for s in scored] == pytest.approx([0.5 + 0.25 * expected_rm[0] + 0.25, 0.25 * expected_rm[1] + 0.25], abs=1e-5)


def test_a_weight_the_service_cannot_serve_and_a_model_loaded_twice_are_refused_at_start(tiny_reward_model) -> None:
    rm_dir = tiny_reward_model()
    with serving(RewardModel(RewardModelConfig(rm_dir))) as service:
        with pytest.raises(ValueError, match="reward weight judge_score is set but the reward service at .* hosts only rm_score"):
            build_reward(TrainConfig(data="x", reward_service=service.endpoint, weights={"judge_score": 1.0}))
    with pytest.raises(ValueError, match=r"\[train\] reward_model = 'rm' and reward_service = .*leave \[train\] reward_model empty"):
        TrainConfig(data="x", reward_service="tcp://127.0.0.1:5560", reward_model="rm")


def test_the_service_is_configured_in_the_same_file_as_train(tmp_path) -> None:
    from rewards.config import RewardServiceConfig

    path = tmp_path / "train.toml"
    path.write_text(
        '[train]\nreward_service = "tcp://127.0.0.1:5560"\nreward_service_timeout_s = 20\n'
        '[reward_service]\nbind = "tcp://127.0.0.1:5561"\nreward_model = "rm-dir"\njudge_model = "judge-1"\njudge_preset = "dialogue"\n'
    )
    train = load(TrainConfig, path)
    service = load(RewardServiceConfig, path)
    assert train.reward_service == "tcp://127.0.0.1:5560" and train.reward_service_timeout_s == 20.0
    assert (service.bind, service.reward_model, service.judge_config().preset) == ("tcp://127.0.0.1:5561", "rm-dir", "dialogue")
    path.write_text('[reward_service]\nreward_model = "rm-dir"\nbatch_size = 0\n')
    with pytest.raises(ConfigError, match="batch_size = 0"):
        load(RewardServiceConfig, path)
    help_text = command_help("train")
    assert "--reward-service STR" in help_text and "--reward-service-timeout-s" in help_text
