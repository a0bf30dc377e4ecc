"""The policy loss is an option of the config ([learner] policy_loss for candidate choices, [generation] policy_loss
for generated responses), validated by name against core_algos' registry; the defaults are the choices the code
made by the kind of batch before it was an option."""

from __future__ import annotations

import pytest

from learner_node import config, core_algos
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.update import LossSettings


def test_the_names_a_config_may_give_are_the_registry_s() -> None:
    assert config.POLICY_LOSSES == tuple(core_algos.POLICY_LOSSES)


def test_the_defaults_are_clipped_for_candidates_and_dual_clip_for_generation() -> None:
    assert LossSettings.candidates(UpdateConfig()).policy_loss == "clipped"
    assert LossSettings.generation(UpdateConfig(), GenerationConfig()).policy_loss == "dual-clip"


def test_the_config_chooses_each_kind_s_policy_loss() -> None:
    assert LossSettings.candidates(UpdateConfig(policy_loss="dual-clip")).policy_loss == "dual-clip"
    gen = LossSettings.generation(UpdateConfig(policy_loss="dual-clip"), GenerationConfig(policy_loss="clipped"))
    assert gen.policy_loss == "clipped" and gen.clip.dual_c == GenerationConfig().clip_ratio_c  # the bound stays configured


@pytest.mark.parametrize("make", [lambda: UpdateConfig(policy_loss="ppo2"), lambda: GenerationConfig(policy_loss="ppo2")])
def test_an_unknown_policy_loss_is_refused_naming_the_choices(make) -> None:
    with pytest.raises(ValueError, match="`policy_loss` must be one of clipped, dual-clip, got 'ppo2'"):
        make()
