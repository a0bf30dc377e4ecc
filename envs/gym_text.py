"""Gymnasium's toy-text worlds (FrozenLake, CliffWalking, Taxi) as `TextEnv`s.

Why: they are small, fully known MDPs with published optimal returns, so a
PPOZ run on them shows whether the policy learns at all, long before it meets
a real GUI. Each adapter wraps the newest registered version of the gymnasium
env (`latest_env_id`; Taxi-v4 and CliffWalking-v1 in gymnasium 1.4, Taxi-v3
and CliffWalking-v0 before), created without a render mode.

The prompt is drawn here from the decoded state, not by gymnasium's `ansi`
render: that one marks the agent (and Taxi's passenger and destination) only
by ANSI colour codes, which a tokenised prompt would carry as escape bytes
while losing what they mean. A prompt holds a one-line task (goal, symbols,
rewards), the grid in plain characters, and one line of state summary and
step count; a few hundred characters, since a tiny byte-level model scores it.
Rows and columns in the summary count from 1 at the top left.

Candidate i is gym action i. Rewards and `terminated` are the env's own;
`truncated` is set when `max_steps` steps ran out without the env terminating.
`StepResult.info["state"]` is the raw gym state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, cast

import gymnasium
from gymnasium.envs.toy_text import CliffWalkingEnv, TaxiEnv

from envs.base import Observation, StepResult, TextEnv, check_action

# Read after the prompt (scoring concatenates prompt + question + candidate):
# "... I shall move left" reads as a sentence for every candidate below.
QUESTION = "\nWhich action should I choose next? I shall "


def latest_env_id(base: str) -> str:
    """The newest registered version of un-namespaced gymnasium env `base`, e.g. "Taxi" -> "Taxi-v4"."""
    versions = [
        spec.version for spec in gymnasium.registry.values() if spec.namespace is None and spec.name == base and spec.version is not None
    ]
    if not versions:
        raise ValueError(f"no versioned gymnasium env named {base!r} is registered")
    return f"{base}-v{max(versions)}"


class GymTextEnv(ABC):
    """A gymnasium toy-text env whose observations are prompts with the action names as candidates."""

    name: str
    base_id: ClassVar[str]  # gymnasium env name without version
    actions: ClassVar[tuple[str, ...]]  # candidate i is gym action i

    def __init__(self, max_steps: int, question: str = QUESTION, **gym_kwargs: Any) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"`max_steps` must be a positive int, got {max_steps!r}")
        self.max_steps = max_steps
        self.question = question
        self.env_id = latest_env_id(self.base_id)
        # gymnasium's own TimeLimit is set to ours, so its default (100 or 200) never cuts in first.
        self.env: gymnasium.Env[Any, Any] = gymnasium.make(self.env_id, max_episode_steps=max_steps, **gym_kwargs)
        if self.env.action_space.n != len(self.actions):  # type: ignore[attr-defined]
            raise RuntimeError(f"{self.env_id} has {self.env.action_space} actions, this adapter names {len(self.actions)}")
        self.state: int | None = None  # raw gym state; None until the first reset
        self.steps = 0
        self._ended = False

    def reset(self, seed: int | None = None) -> Observation:
        state, _ = self.env.reset(seed=seed)
        self.state, self.steps, self._ended = int(state), 0, False
        return self._observation()

    def step(self, action: int) -> StepResult:
        if self.state is None:
            raise RuntimeError(f"{self.name}: step() called before reset()")
        if self._ended:
            raise RuntimeError(f"{self.name}: step() called after the episode ended; call reset() first")
        action = check_action(action, len(self.actions))
        state, reward, terminated, gym_truncated, _ = self.env.step(action)
        self.state = int(state)
        self.steps += 1
        terminated = bool(terminated)
        truncated = not terminated and (bool(gym_truncated) or self.steps >= self.max_steps)
        self._ended = terminated or truncated
        return StepResult(self._observation(), float(reward), terminated, truncated, {"state": self.state})

    def close(self) -> None:
        self.env.close()

    def _observation(self) -> Observation:
        assert self.state is not None  # internal: only called after reset
        prompt = "\n".join(
            [
                self._task(),
                *self._grid(self.state),
                f"{self._summary(self.state)} Steps taken: {self.steps} of {self.max_steps}.",
            ]
        )
        return {"prompt": prompt, "question": self.question, "action": list(self.actions)}

    @abstractmethod
    def _task(self) -> str:
        """One line: the goal, what the grid's symbols mean, the rewards."""

    @abstractmethod
    def _grid(self, state: int) -> list[str]:
        """The grid as plain-text rows with the agent marked."""

    @abstractmethod
    def _summary(self, state: int) -> str:
        """One sentence on where things are."""


def _at(row: int, col: int) -> str:
    return f"row {row + 1}, column {col + 1}"


class _WalkerText(GymTextEnv):
    """A grid walker whose state is row * ncol + col: the agent drawn over the map (`rows`)."""

    AGENT = "A"
    rows: list[str]
    ncol: int

    def _grid(self, state: int) -> list[str]:
        row, col = divmod(state, self.ncol)
        rows = list(self.rows)
        rows[row] = rows[row][:col] + self.AGENT + rows[row][col + 1 :]
        return rows

    def _summary(self, state: int) -> str:
        row, col = divmod(state, self.ncol)
        return f"You are at {_at(row, col)}."


class FrozenLakeText(_WalkerText):
    """FrozenLake: walk over the ice from S to G without falling into a hole. State = row * ncol + col."""

    name = "frozenlake"
    base_id = "FrozenLake"
    actions = ("move left", "move down", "move right", "move up")

    def __init__(self, max_steps: int = 20, is_slippery: bool = False, map_name: str = "4x4", question: str = QUESTION) -> None:
        if map_name not in ("4x4", "8x8"):
            raise ValueError(f"`map_name` must be '4x4' or '8x8', got {map_name!r}")
        # Not slippery by default: every move does what it says, so a policy can learn the path quickly.
        super().__init__(max_steps, question, is_slippery=is_slippery, map_name=map_name)
        self.is_slippery = is_slippery
        lake = cast(Any, self.env.unwrapped)  # FrozenLakeEnv: desc is an array of single-byte cells
        self.rows = [b"".join(row).decode() for row in lake.desc]
        self.ncol = len(self.rows[0])

    def _task(self) -> str:
        slip = " The ice is slippery: a move may go sideways." if self.is_slippery else ""
        return (
            "Frozen lake: walk from S to the goal G. F is ice, H is a hole, A is you. "
            f"Reaching G gives reward 1; G or a hole ends the episode.{slip}"
        )


class CliffWalkingText(_WalkerText):
    """CliffWalking: walk from S (bottom left) to G (bottom right) along a cliff. State = row * 12 + col."""

    name = "cliffwalking"
    base_id = "CliffWalking"
    actions = ("move up", "move right", "move down", "move left")

    def __init__(self, max_steps: int = 30, question: str = QUESTION) -> None:
        super().__init__(max_steps, question)
        self.nrow, self.ncol = (int(n) for n in cast(CliffWalkingEnv, self.env.unwrapped).shape)
        # gymnasium's layout: start bottom left, goal bottom right, the cliff between them.
        bottom = "S" + "C" * (self.ncol - 2) + "G"
        self.rows = ["." * self.ncol] * (self.nrow - 1) + [bottom]

    def _task(self) -> str:
        return (
            "Cliff walking: walk from S to the goal G. C is the cliff, . is ground, A is you. "
            "Each step gives -1; stepping into the cliff gives -100 and sends you back to S."
        )


class TaxiText(GymTextEnv):
    """Taxi: pick the passenger up at one stop and drop them off at another. decode(state) = row, col, passenger, destination."""

    name = "taxi"
    base_id = "Taxi"
    actions = ("move south", "move north", "move east", "move west", "pick up passenger", "drop off passenger")
    TAXI = "T"
    STOPS = ("R", "G", "Y", "B")  # gymnasium's locs order; passenger index 4 = in the taxi

    def __init__(self, max_steps: int = 50, question: str = QUESTION) -> None:
        super().__init__(max_steps, question)
        self.taxi = cast(TaxiEnv, self.env.unwrapped)
        self.rows = [b"".join(row).decode() for row in self.taxi.desc]

    def _task(self) -> str:
        return (
            "Taxi: drive to the passenger, pick them up, drive to the destination, drop them off. "
            "R, G, Y, B are stops, T is the taxi, | is a wall. "
            "Each step gives -1, a delivery +20, a wrong pick-up or drop-off -10."
        )

    def _grid(self, state: int) -> list[str]:
        row, col, _, _ = self.taxi.decode(state)
        rows = list(self.rows)
        x = 2 * col + 1  # the map's cells sit at odd columns, between walls or ':'
        rows[1 + row] = rows[1 + row][:x] + self.TAXI + rows[1 + row][x + 1 :]
        return rows

    def _summary(self, state: int) -> str:
        row, col, passenger, destination = self.taxi.decode(state)
        if passenger == len(self.STOPS):
            where = "has the passenger aboard"
        else:
            where = f"is empty; the passenger is at {self.STOPS[passenger]}"
        return f"The taxi is at {_at(row, col)} and {where}; the destination is {self.STOPS[destination]}."


GYM_ENVS: dict[str, Callable[..., TextEnv]] = {
    "frozenlake": FrozenLakeText,
    "cliffwalking": CliffWalkingText,
    "taxi": TaxiText,
}


def make_gym_env(name: str, **options: Any) -> TextEnv:
    """The adapter registered as `name` in GYM_ENVS, built with `options` (e.g. max_steps=10, is_slippery=True)."""
    try:
        factory = GYM_ENVS[name]
    except KeyError:
        raise ValueError(f"unknown gym env {name!r}; known: {', '.join(sorted(GYM_ENVS))}") from None
    return factory(**options)
