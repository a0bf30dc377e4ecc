"""The learner never applies, publishes or checkpoints a non-finite update (issue 28).

Rewards are bounded where they enter (the broker, the gateway, the reward sources); these tests write the
poison straight into the stream, past those checks, because the learner is the last line: whatever reaches
it, an update whose loss, gradient or weights are not finite is undone whole, its transitions are counted as
dropped and acknowledged, and the weights stay the last good ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from broker.sessions import SegmentClose, Session
from broker.store import Batch, SessionStore
from common import learner_figures
from common.segments import RedisKeys, Segment, pack, unpack
from learner_node import checkpoint
from learner_node.optim import adam
from learner_node.update import _all_finite
from learner_node.worker import Learner, PoisonedInput
from tests.learner_node.test_async_ppo import learner_on
from tests.learner_node.test_generation_update import gen_transition
from tests.learner_node.test_resume import write_segments

N = 8  # transitions per rollout: two minibatches of 4, so an update takes several optimizer steps


def responses(rewards: list[float], offset: int = 0) -> list:
    """Responses of 1 to 7 tokens after prompts of 1 to 5: the shapes vary within each minibatch."""
    return [
        gen_transition(
            [5 + (i + offset) % 7 for _ in range(1 + (i + offset) % 5)],
            [8 + (i * 3 + offset) % 11 for _ in range(1 + (i * 5 + offset) % 7)],
            reward=r,
            version=0,
        )
        for i, r in enumerate(rewards)
    ]


def write_batch(redis_client, prefix: str, transitions: list, tag: str) -> None:
    """One-response segments of tasks named `tag`-i, closed by the broker's own store code into the stream
    (a second batch needs other task names: the learner skips a segment id it has trained)."""
    store = SessionStore(redis_client, RedisKeys(prefix), "learners")
    store.ensure_stream()
    batch = Batch()
    for i, t in enumerate(transitions):
        session = Session(f"{tag}-{i}", segment_len=1)
        batch.add("RPUSH", store.keys.open_segment(session.task_id), pack(t.to_wire()))
        store.stage_close(batch, session, SegmentClose(session.task_id, session.seq, "done", True, False, None, 1))
    store.apply(batch)


CLEAN = [1.0, -0.5, 0.25, 0.0, 2.0, -1.0, 0.5, 1.5]


def trainable(learner: Learner) -> dict[str, torch.Tensor]:
    heads = {f"value.{k}": v for k, v in learner.lp.value_head.state_dict().items()}
    heads.update({f"token.{k}": v for k, v in learner.lp.token_value_head.state_dict().items()})
    model = {name: p for name, p in learner.lp.model.named_parameters() if p.requires_grad}
    return {name: t.detach().clone() for name, t in {**model, **heads}.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def make(tiny_models, redis_url, redis_client, prefix, tmp_path, **overrides) -> Learner:
    settings = dict(policy_minibatch=4, value_minibatch=4, update_epochs=2, value_epochs=2)
    settings.update(overrides)
    return learner_on(tiny_models["llama"], "float32", redis_url, redis_client, prefix, tmp_path, N, **settings)


@pytest.mark.parametrize("poison", [1e300, -1e300, math.inf, math.nan])
def test_an_absurd_reward_in_the_stream_is_left_out_and_nothing_non_finite_is_kept(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path, poison
) -> None:
    write_batch(redis_client, key_prefix, responses([*CLEAN[:5], poison, *CLEAN[6:]]), "poison")
    learner = make(tiny_models, redis_url, redis_client, key_prefix, tmp_path)
    before = trainable(learner)
    published = redis_client.hgetall(learner.keys.weights_latest)
    metrics = learner.step()

    assert metrics is not None and metrics["charts/dropped_nonfinite"] == N
    assert_same(trainable(learner), before)  # every step of the update undone, not only the poisoned one
    assert learner.version == 0 and learner.updates == 0
    assert learner.counters["dropped_nonfinite"] == N and learner.counters["discarded_updates"] == 1
    assert learner.counters["segments_trained"] == 0
    assert learner.counters["transitions_stored"] == N and learner.counters["transitions_trained"] == 0
    assert redis_client.hgetall(learner.keys.weights_latest) == published  # nothing announced to the actors
    assert redis_client.xlen(learner.stream) == 0  # acknowledged: a restarted learner does not meet it again
    tensors, _, _, state = checkpoint.load(checkpoint.latest(learner.cfg.checkpoint_dir))
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    assert state["counters"]["dropped_nonfinite"] == N
    assert learner_figures.read_latest(redis_client, key_prefix)["counters/dropped_nonfinite"] == N  # what `ppoz status` shows


def test_after_a_discarded_update_training_goes_on_as_if_the_poisoned_batch_had_never_come(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """The weights after [poisoned batch, clean batch] equal those after [clean batch] alone, bit for bit: the
    optimizer's moments and step count are restored too, not only the parameters."""
    poisoned, clean = f"{key_prefix}:poisoned", f"{key_prefix}:clean"
    write_batch(redis_client, poisoned, responses([1e300, *CLEAN[1:]], offset=3), "poisoned")
    write_batch(redis_client, poisoned, responses(CLEAN), "clean")
    write_batch(redis_client, clean, responses(CLEAN), "clean")
    a = make(tiny_models, redis_url, redis_client, poisoned, tmp_path / "a")
    b = make(tiny_models, redis_url, redis_client, clean, tmp_path / "b")
    initial = trainable(b)
    assert_same(trainable(a), initial)
    a.step()
    a.step()
    b.step()
    assert a.version == b.version == 1 and a.counters["dropped_nonfinite"] == N
    after = trainable(a)
    assert_same(after, trainable(b))
    assert any(not torch.equal(after[name], initial[name]) for name in initial)  # a no-op update would pass the rest


def test_a_nan_gradient_once_discards_exactly_that_update_and_the_next_one_applies(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    write_batch(redis_client, key_prefix, responses(CLEAN), "first")
    write_batch(redis_client, key_prefix, responses(CLEAN, offset=1), "second")
    learner = make(tiny_models, redis_url, redis_client, key_prefix, tmp_path, warmup_updates=0, value_epochs=1)
    lora = next(p for name, p in learner.lp.model.named_parameters() if p.requires_grad and "lora_B" in name)
    calls = 0

    def nan_on_the_second_backward(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return torch.full_like(grad, math.nan) if calls == 2 else grad

    lora.register_hook(nan_on_the_second_backward)
    steps: list[int] = []
    learner.policy_opt.register_step_post_hook(lambda *_: steps.append(1))
    before = trainable(learner)

    first = learner.step()
    assert first is not None and first["charts/dropped_nonfinite"] == N
    assert len(steps) == 1  # the first minibatch's step was applied before the second's gradient came out NaN ...
    assert_same(trainable(learner), before)  # ... and undone with it
    assert learner.policy_opt.state_dict()["state"] == {}  # Adam's moments and step count: as before its first step
    assert learner.version == 0 and learner.discarded_in_row == 1

    second = learner.step()
    assert second is not None and "charts/dropped_nonfinite" not in second
    assert learner.version == 1 and learner.discarded_in_row == 0 and learner.counters["transitions_trained"] == N
    after = trainable(learner)
    assert all(bool(torch.isfinite(t).all()) for t in after.values())
    assert any(not torch.equal(after[name], before[name]) for name in before)


def test_an_update_undone_mid_way_restores_adam_moments_that_earlier_updates_built(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """[clean, NaN gradient after one applied step, clean] ends bit for bit where [clean, clean] does: the
    moments and step counts the first update left are restored as they were, not as the undone steps left them."""
    poisoned, clean = f"{key_prefix}:poisoned", f"{key_prefix}:clean"
    for prefix in (poisoned, clean):
        write_batch(redis_client, prefix, responses(CLEAN), "first")
    write_batch(redis_client, poisoned, responses(CLEAN, offset=2), "poisoned")
    for prefix in (poisoned, clean):
        write_batch(redis_client, prefix, responses(CLEAN, offset=1), "second")
    a = make(tiny_models, redis_url, redis_client, poisoned, tmp_path / "a", warmup_updates=0, value_epochs=1)
    b = make(tiny_models, redis_url, redis_client, clean, tmp_path / "b", warmup_updates=0, value_epochs=1)
    lora = next(p for name, p in a.lp.model.named_parameters() if p.requires_grad and "lora_B" in name)
    steps: list[int] = []
    a.policy_opt.register_step_post_hook(lambda *_: steps.append(1))
    a.step()
    assert a.version == 1 and len(steps) > 1
    first_update = len(steps)
    fired: list[int] = []

    def nan_after_one_step(grad: torch.Tensor) -> torch.Tensor:
        if len(steps) == first_update + 1 and not fired:
            fired.append(1)
            return torch.full_like(grad, math.nan)
        return grad

    lora.register_hook(nan_after_one_step)
    second = a.step()
    assert second is not None and second["charts/dropped_nonfinite"] == N and len(steps) == first_update + 1
    a.step()
    b.step()
    b.step()
    assert a.version == b.version == 2
    assert_same(trainable(a), trainable(b))


def test_updates_non_finite_in_a_row_stop_the_learner_naming_the_reward(tiny_models, redis_url, redis_client, key_prefix, tmp_path) -> None:
    write_batch(redis_client, key_prefix, responses([*CLEAN[:7], 3e300]), "first")
    write_batch(redis_client, key_prefix, responses([*CLEAN[:7], 3e300], offset=2), "second")
    learner = make(tiny_models, redis_url, redis_client, key_prefix, tmp_path, max_discarded_updates=2)
    learner.step()
    with pytest.raises(PoisonedInput, match=r"2 updates in a row were not finite.*reward 3e\+300 of task 'second-7'"):
        learner.step()
    assert redis_client.xlen(learner.stream) == 0 and learner.counters["dropped_nonfinite"] == 2 * N


def test_the_candidate_path_leaves_out_a_poisoned_choice_too(tiny_models, redis_url, redis_client, key_prefix, tmp_path) -> None:
    write_segments(redis_client, key_prefix, 4)
    raw = redis_client.xrange(f"{key_prefix}:segments")
    first_id, fields = raw[0]
    transitions = unpack(fields[b"transitions"])
    transitions[0]["reward"] = 1e300
    redis_client.xdel(f"{key_prefix}:segments", first_id)
    redis_client.xadd(f"{key_prefix}:segments", {**fields, b"transitions": pack(transitions)})
    assert Segment.from_entry(redis_client.xrange(f"{key_prefix}:segments")[-1][1]).transitions[0].reward == 1e300
    learner = learner_on(tiny_models["llama"], "float32", redis_url, redis_client, key_prefix, tmp_path, 4, policy_minibatch=2)
    before = trainable(learner)
    metrics = learner.step()
    assert metrics is not None and metrics["charts/dropped_nonfinite"] == 4
    assert_same(trainable(learner), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_after_each_step_finds_one_nan_or_inf_among_many_parameters_and_passes_absurd_finite_ones(dtype) -> None:
    """The check that a step overflowed no parameter (learner_node/update.py, `_all_finite`): a max-abs norm per
    tensor, so a finite 3e38 passes (an L2 norm would overflow to inf and discard a sound update)."""
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in [(7, 5), (3,), (0,), (4, 4, 2), (1,)]]
    assert _all_finite(params) and _all_finite([params[2]])  # an empty parameter alone, too
    params[3].data[2, 1, 0] = 3e38  # bfloat16 holds it too (its max is 3.39e38, as float32's)
    params[3].data[0, 0, 1] = -3e38
    assert _all_finite(params)
    for bad in (math.nan, math.inf, -math.inf):
        params[-1].data[0] = bad  # the last parameter, one element
        assert not _all_finite(params), bad
        params[-1].data[0] = 0.5


def test_the_learners_adam_is_fused_on_cpu_and_steps_as_adam_does() -> None:
    torch.manual_seed(0)
    shapes = [(16, 8), (8,), (3, 5, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    fused, reference = adam(ours, 3e-3), torch.optim.Adam(plain, lr=3e-3, eps=1e-5, foreach=False)
    assert fused.defaults["fused"] and fused.defaults["eps"] == 1e-5
    for step in range(5):
        for a, b in zip(ours, plain):
            grad = torch.randn(a.shape) * 10.0 ** (step - 2)  # gradients from 1e-2 to 1e2
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        reference.step()
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
