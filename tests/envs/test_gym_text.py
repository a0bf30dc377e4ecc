"""The gymnasium toy-text adapters: candidates map to gym actions, prompts show the state, episodes end as gym says."""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium
import pytest

from envs.base import InvalidAction, TextEnv, random_returns
from envs.gym_text import GYM_ENVS, CliffWalkingText, FrozenLakeText, GymTextEnv, TaxiText, latest_env_id, make_gym_env

ANSI_ESC = "\x1b"
REPO_ROOT = Path(__file__).resolve().parents[2]
STOPS = ("R", "G", "Y", "B")


def direct_env(env: GymTextEnv, **kwargs: Any) -> gymnasium.Env[Any, Any]:
    """The same gymnasium env, created directly (no adapter)."""
    return gymnasium.make(latest_env_id(env.base_id), **kwargs)


def agent_cell(env: GymTextEnv, prompt: str) -> tuple[int, int]:
    """(row, col) of the agent's mark in the prompt's grid, 0-based; fails unless exactly one mark."""
    if isinstance(env, TaxiText):
        grid = [line for line in prompt.splitlines() if line[:1] in ("|", "+")]
        marks = [(r - 1, (c - 1) // 2) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == "T"]
    else:
        grid = [line for line in prompt.splitlines() if re.fullmatch(r"[SFHGC.A]+", line)]
        marks = [(r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == "A"]
    assert len(marks) == 1, f"expected one agent mark, found {marks} in\n{prompt}"
    return marks[0]


def position(env: GymTextEnv, state: int) -> tuple[int, int]:
    """(row, col) of the agent decoded from the raw gym state."""
    if isinstance(env, TaxiText):
        row, col, _, _ = env.taxi.decode(state)
        return row, col
    ncol = 12 if isinstance(env, CliffWalkingText) else env.ncol  # type: ignore[attr-defined]
    return divmod(state, ncol)


def index(obs: dict[str, Any], name: str) -> int:
    return obs["action"].index(name)


@pytest.fixture(params=sorted(GYM_ENVS))
def env(request: pytest.FixtureRequest) -> Any:
    made = make_gym_env(request.param)
    yield made
    made.close()


# -- versions and registry ---------------------------------------------------------------------------------------------


def test_latest_env_id_takes_the_highest_registered_version() -> None:
    assert latest_env_id("FrozenLake") == "FrozenLake-v1"  # not FrozenLake8x8, not tabular/...
    assert latest_env_id("CliffWalking") == "CliffWalking-v1"  # not CliffWalkingSlippery-v1 or tabular/CliffWalking-v0
    gymnasium.register(id="Taxi-v99", entry_point="gymnasium.envs.toy_text.taxi:TaxiEnv")
    gymnasium.register(id="ppoztest/Taxi-v100", entry_point="gymnasium.envs.toy_text.taxi:TaxiEnv")
    try:
        assert latest_env_id("Taxi") == "Taxi-v99"  # a namespaced env is another env, whatever its version
        assert TaxiText().env_id == "Taxi-v99"
    finally:
        del gymnasium.registry["Taxi-v99"], gymnasium.registry["ppoztest/Taxi-v100"]
    assert latest_env_id("Taxi") == "Taxi-v4"
    with pytest.raises(ValueError, match="'NoSuchEnv'"):
        latest_env_id("NoSuchEnv")


def test_adapters_use_the_newest_version(env: GymTextEnv) -> None:
    assert env.env_id == latest_env_id(env.base_id)
    assert env.env.render_mode is None


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'pong'") as excinfo:
        make_gym_env("pong")
    for known in ("frozenlake", "cliffwalking", "taxi"):
        assert known in str(excinfo.value)


def test_make_gym_env_passes_options_and_defaults() -> None:
    assert (FrozenLakeText().max_steps, CliffWalkingText().max_steps, TaxiText().max_steps) == (20, 30, 50)
    lake = make_gym_env("frozenlake", max_steps=7, is_slippery=True, map_name="8x8")
    assert isinstance(lake, FrozenLakeText)
    assert (lake.max_steps, lake.is_slippery, len(lake.rows), lake.ncol) == (7, True, 8, 8)
    assert "slippery" in lake.reset(seed=0)["prompt"]
    assert "slippery" not in make_gym_env("frozenlake").reset(seed=0)["prompt"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_max_steps_is_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        make_gym_env("taxi", max_steps=bad)


def test_bad_map_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="'5x5'"):
        FrozenLakeText(map_name="5x5")


def test_no_pygame_and_no_warnings_in_a_fresh_interpreter() -> None:
    code = (
        "import sys; from envs.gym_text import GYM_ENVS, make_gym_env\n"
        "for name in GYM_ENVS:\n"
        "    env = make_gym_env(name); env.reset(seed=0); env.step(0); env.close()\n"
        "assert 'pygame' not in sys.modules, 'pygame was imported'\n"
    )
    # a fresh interpreter importing gymnasium and stepping each environment once: 1-2 s alone; x60
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr


# -- candidates are gym actions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_candidate_i_is_gym_action_i(env: GymTextEnv, seed: int) -> None:
    """Lock-step with a directly created gym env: same seed, same action indices, same states and rewards."""
    kwargs = {"is_slippery": True} if isinstance(env, FrozenLakeText) else {}
    adapter = make_gym_env(env.name, **kwargs)  # slippery too, so the seeded RNG must line up as well
    direct = direct_env(env, **kwargs)
    rng = random.Random(seed)
    obs = adapter.reset(seed=seed)
    state, _ = direct.reset(seed=seed)
    assert adapter.state == state
    for _ in range(40):
        action = rng.randrange(len(obs["action"]))
        result = adapter.step(action)
        state, reward, terminated, _, _ = direct.step(action)
        assert (result.info["state"], result.reward, result.terminated) == (state, reward, terminated)
        obs = result.obs
        if result.terminated or result.truncated:
            obs = adapter.reset(seed=seed + 100)
            state, _ = direct.reset(seed=seed + 100)
            assert adapter.state == state


def moved(env: GymTextEnv, prefix: list[str], name: str, seed: int = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """Position before and after the candidate called `name`, after playing the candidates in `prefix`."""
    obs = env.reset(seed=seed)
    for step in prefix:
        obs = env.step(index(obs, step)).obs
    assert env.state is not None
    before = position(env, env.state)
    result = env.step(index(obs, name))
    return before, position(env, result.info["state"])


@pytest.mark.parametrize(("name", "delta"), [("move left", (0, -1)), ("move down", (1, 0)), ("move right", (0, 1)), ("move up", (-1, 0))])
def test_frozenlake_candidate_names_move_as_named(name: str, delta: tuple[int, int]) -> None:
    env = FrozenLakeText()
    assert env.actions == ("move left", "move down", "move right", "move up")
    (row, col), after = moved(env, ["move right"], name)  # from (0, 1): every direction but up changes the cell
    assert after == (max(row + delta[0], 0), max(col + delta[1], 0))


@pytest.mark.parametrize(("name", "delta"), [("move up", (-1, 0)), ("move right", (0, 1)), ("move down", (1, 0)), ("move left", (0, -1))])
def test_cliffwalking_candidate_names_move_as_named(name: str, delta: tuple[int, int]) -> None:
    env = CliffWalkingText()
    assert env.actions == ("move up", "move right", "move down", "move left")
    (row, col), after = moved(env, ["move up"], name)  # from (2, 0): no cliff one step away
    assert after == (row + delta[0], max(col + delta[1], 0))


def find_seed(env: TaxiText, wanted: Any) -> int:
    """The first seed whose start state satisfies `wanted(row, col, passenger, destination)`."""
    for seed in range(2000):
        env.reset(seed=seed)
        assert env.state is not None
        if wanted(*env.taxi.decode(env.state)):
            return seed
    raise AssertionError("no such start state in 2000 seeds")


@pytest.mark.parametrize(
    ("name", "delta"), [("move south", (1, 0)), ("move north", (-1, 0)), ("move east", (0, 1)), ("move west", (0, -1))]
)
def test_taxi_candidate_names_move_as_named(name: str, delta: tuple[int, int]) -> None:
    env = TaxiText()
    seed = find_seed(env, lambda row, col, p, d: (row, col) == (2, 2))  # the centre: no walls around it
    (row, col), after = moved(env, [], name, seed=seed)
    assert after == (row + delta[0], col + delta[1])


def test_taxi_pick_up_and_drop_off_are_named_right() -> None:
    env = TaxiText()
    seed = find_seed(env, lambda row, col, p, d: (row, col) == env.taxi.locs[p])  # starts at the passenger
    obs = env.reset(seed=seed)
    wrong = env.step(index(obs, "drop off passenger"))  # nobody aboard: illegal
    assert wrong.reward == -10
    picked = env.step(index(wrong.obs, "pick up passenger"))
    assert picked.reward == -1
    assert env.taxi.decode(picked.info["state"])[2] == 4  # in the taxi
    assert "passenger aboard" in picked.obs["prompt"]


def test_taxi_delivery_pays_20_and_terminates() -> None:
    """Passenger at R, destination G: pick up at (0, 0); walls east of column 1 in rows 0 and 1, none in row 2."""
    env = TaxiText()
    seed = find_seed(env, lambda row, col, p, d: (row, col, p, d) == (0, 0, 0, 1))
    obs = env.reset(seed=seed)
    names = [
        "pick up passenger",
        "move south",
        "move south",
        "move east",
        "move east",
        "move east",
        "move east",
        "move north",
        "move north",
        "drop off passenger",
    ]
    rewards = []
    for name in names:
        result = env.step(index(obs, name))
        obs = result.obs
        rewards.append(result.reward)
    assert rewards == [-1] * 9 + [20]
    assert (result.terminated, result.truncated) == (True, False)


# -- prompts -----------------------------------------------------------------------------------------------------------


def test_prompts_mark_the_agent_and_carry_no_ansi(env: GymTextEnv) -> None:
    rng = random.Random(7)
    for episode in range(5):
        obs = env.reset(seed=episode)
        finished = False
        while True:
            assert env.state is not None
            prompt = obs["prompt"]
            assert ANSI_ESC not in prompt and ANSI_ESC not in obs["question"]
            assert len(prompt) < 600, f"prompt of {len(prompt)} characters"
            row, col = position(env, env.state)
            assert agent_cell(env, prompt) == (row, col)
            assert f"at row {row + 1}, column {col + 1}" in prompt
            assert f"Steps taken: {env.steps} of {env.max_steps}." in prompt
            assert obs["action"] == list(env.actions)
            if finished:
                break
            result = env.step(rng.randrange(len(obs["action"])))
            obs, finished = result.obs, result.terminated or result.truncated


def test_frozenlake_grid_is_the_map_apart_from_the_agent() -> None:
    env = FrozenLakeText()
    obs = env.reset(seed=0)
    obs = env.step(index(obs, "move down")).obs  # off the start cell, so S shows
    grid = [line for line in obs["prompt"].splitlines() if re.fullmatch(r"[SFHGA]+", line)]
    assert grid == ["SFFF", "AHFH", "FFFH", "HFFG"]


def test_cliffwalking_grid_matches_gymnasiums_cliff() -> None:
    env = CliffWalkingText()
    obs = env.reset(seed=0)
    obs = env.step(index(obs, "move up")).obs
    grid = [line for line in obs["prompt"].splitlines() if re.fullmatch(r"[SCG.A]+", line)]
    cliff = env.env.unwrapped._cliff  # type: ignore[attr-defined]
    assert [[ch == "C" for ch in line] for line in grid] == cliff.tolist()
    assert grid[3][0] == "S" and grid[3][-1] == "G" and grid[2][0] == "A"


def test_taxi_summary_names_passenger_and_destination() -> None:
    env = TaxiText()
    for seed in range(20):
        obs = env.reset(seed=seed)
        assert env.state is not None
        _, _, passenger, destination = env.taxi.decode(env.state)
        assert f"is empty; the passenger is at {STOPS[passenger]}; the destination is {STOPS[destination]}." in obs["prompt"]
        # the stops the taxi does not cover stay on the map
        grid = "".join(line for line in obs["prompt"].splitlines() if line[:1] == "|")
        assert sum(grid.count(stop) for stop in STOPS) >= 3


# -- episodes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_steps", [20, 6])
def test_frozenlake_goal_gives_1_and_terminates(max_steps: int) -> None:
    """With max_steps 6 the goal is reached on the last step: terminated, and not truncated."""
    env = FrozenLakeText(max_steps=max_steps)
    obs = env.reset(seed=0)
    rewards = []
    for name in ["move down", "move down", "move right", "move right", "move down", "move right"]:
        result = env.step(index(obs, name))
        rewards.append(result.reward)
        obs = result.obs
    assert rewards == [0, 0, 0, 0, 0, 1]
    assert (result.terminated, result.truncated) == (True, False)
    assert result.info["state"] == 15
    with pytest.raises(RuntimeError, match="ended"):
        env.step(0)


def test_frozenlake_hole_terminates_with_0() -> None:
    env = FrozenLakeText()
    obs = env.reset(seed=0)
    obs = env.step(index(obs, "move right")).obs
    result = env.step(index(obs, "move down"))  # (1, 1) is a hole
    assert (result.reward, result.terminated, result.truncated, result.info["state"]) == (0, True, False, 5)


@pytest.mark.parametrize("max_steps", [1, 3])
def test_max_steps_truncates(max_steps: int) -> None:
    env = FrozenLakeText(max_steps=max_steps)
    obs = env.reset(seed=0)
    for step in range(1, max_steps + 1):
        result = env.step(index(obs, "move left"))  # stays on the start cell
        obs = result.obs
        assert (result.terminated, result.truncated) == (False, step == max_steps)
    with pytest.raises(RuntimeError, match="ended"):
        env.step(0)
    env.reset(seed=0)  # a reset starts the count again
    assert env.steps == 0 and env.step(0).truncated == (max_steps == 1)


def test_max_steps_above_gymnasiums_own_time_limit() -> None:
    """Taxi with max_steps 250 (gymnasium's TimeLimit is 200) runs 250 steps, never terminating on moves alone."""
    env = TaxiText(max_steps=250)
    obs = env.reset(seed=0)
    for step in range(1, 251):
        result = env.step(index(obs, "move north" if step % 2 else "move south"))
        obs = result.obs
        assert (result.terminated, result.truncated) == (False, step == 250)


@pytest.mark.parametrize("bad", [-1, 4, "1", True, 1.0, None])
def test_invalid_actions_raise(bad: Any) -> None:
    env = FrozenLakeText()
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match=re.escape(repr(bad))):
        env.step(bad)
    assert env.steps == 0 and env.state == 0  # nothing happened
    env.step(3)  # still playable


def test_taxi_accepts_all_six_and_rejects_6() -> None:
    env = TaxiText()
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match="6"):
        env.step(6)
    env.step(5)


def test_step_before_reset_raises(env: GymTextEnv) -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(0)


def test_seeded_resets_are_deterministic(env: GymTextEnv) -> None:
    def play(seed: int) -> list[Any]:
        rng = random.Random(seed)
        obs = env.reset(seed=seed)
        trace: list[Any] = [obs]
        for _ in range(10):
            result = env.step(rng.randrange(len(obs["action"])))
            trace.append((result.obs, result.reward, result.terminated, result.truncated, result.info))
            obs = result.obs
            if result.terminated or result.truncated:
                break
        return trace

    assert play(5) == play(5)


def test_taxi_start_depends_on_seed() -> None:
    env = TaxiText()
    starts = set()
    for seed in range(10):
        first = env.reset(seed=seed)
        assert env.reset(seed=seed) == first
        starts.add(env.state)
    assert len(starts) > 1


def test_slippery_frozenlake_is_deterministic_per_seed() -> None:
    env = FrozenLakeText(is_slippery=True)

    def states(seed: int) -> list[int]:
        env.reset(seed=seed)
        out = []
        for _ in range(20):
            result = env.step(2)
            out.append(result.info["state"])
            if result.terminated or result.truncated:
                break
        return out

    assert states(1) == states(1)
    assert len({tuple(states(seed)) for seed in range(10)}) > 1  # and the slips do depend on the seed


# -- random baselines --------------------------------------------------------------------------------------------------


def returns(name: str, episodes: int = 200) -> list[float]:
    def make(_: int) -> TextEnv:
        return make_gym_env(name)

    return random_returns(make, episodes)


def test_random_baseline_frozenlake() -> None:
    rs = returns("frozenlake")
    assert set(rs) <= {0.0, 1.0}
    assert statistics.mean(rs) < 0.3


def test_random_baseline_cliffwalking() -> None:
    rs = returns("cliffwalking")
    assert all(-100 * 30 <= r <= -13 for r in rs)  # at least 13 steps to the goal, at most 30 cliff falls
    assert statistics.mean(rs) < -30  # the cliff is one step right of the start: falls are common


def test_random_baseline_taxi() -> None:
    rs = returns("taxi")
    assert all(-10 * 50 <= r <= 20 for r in rs)
    assert statistics.mean(rs) < -50  # a third of the candidates are pick-up/drop-off, mostly illegal (-10)
