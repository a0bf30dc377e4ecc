"""The Kea-like app simulator: a seeded screen graph, Kea-shaped prompts and actions, Kea-shaped rewards, tarpits."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from envs.base import DEFAULT_QUESTION, InvalidAction, Observation, StepResult, random_returns
from envs.kea_sim import ADVERT, BACK, KILL, LAUNCHER, LICENSES, OUTSIDE, SCREEN_NAMES, KeaSim, SimConfig, build_app

REPO_ROOT = Path(__file__).resolve().parents[2]
TASK = "You are a robot testing an Android app. Explore as many new screens as you can and stay inside the app."
INTENT = "IntentEvent(action=android.intent.action.MAIN, component=MainActivity)"
# Rewards that differ from each other and from the defaults, so a swapped rule shows; room for long walks.
RULES: dict[str, Any] = dict(reward_new_state=2.5, reward_seen_state=-0.125, penalty_outside=-7.0, penalty_kill=-3.0, horizon=64)
TOUCH = re.compile(r"(\d+): TouchEvent\(state=([0-9a-f]{32}), view=([0-9a-f]{32})\(([A-Za-z]+)/(Button|TextView|ImageButton)-(.+)\)\)")
PLAIN_TOUCH = re.compile(r"(\d+): TouchEvent\(view=([A-Za-z]+)/(Button|TextView|ImageButton)-(.+)\)")


def page(obs: Observation) -> str:
    """The prompt's "Current page:" (without the outside-the-app remark)."""
    found = re.findall(r"^Current page: (\S+)", obs["prompt"], re.M)
    assert len(found) == 1, obs["prompt"]
    return found[0]


def touch(obs: Observation, text: str) -> int:
    """Index of the candidate touching the widget labelled `text`."""
    for i, event in enumerate(obs["action"]):
        if event.startswith(f"{i}: TouchEvent(") and event.endswith(f"-{text}))"):
            return i
    raise AssertionError(f"no touch on {text!r} among {obs['action']}")


def named(obs: Observation, event: str) -> int:
    """Index of the candidate `event` (BACK, kill, the launcher's intent)."""
    found = [i for i, a in enumerate(obs["action"]) if a == f"{i}: {event}"]
    assert len(found) == 1, obs["action"]
    return found[0]


def ordinary(app: dict[str, Any]) -> set[str]:
    return {name for name in app if name in SCREEN_NAMES}


def paths_from_main(cfg: SimConfig) -> dict[str, list[str]]:
    """BFS over the app's widgets: a shortest path of widget labels from MainActivity to each reachable screen."""
    app = build_app(cfg)
    paths: dict[str, list[str]] = {"MainActivity": []}
    queue = deque(["MainActivity"])
    while queue:
        name = queue.popleft()
        for w in app[name].widgets:
            if w.target not in paths:
                paths[w.target] = paths[name] + [w.text]
                queue.append(w.target)
    return paths


def go(env: KeaSim, labels: list[str]) -> Observation:
    """Reset, then touch the widgets labelled `labels` in turn."""
    obs = env.reset()
    for label in labels:
        obs = env.step(touch(obs, label)).obs
    return obs


def trace(cfg: SimConfig, actions_seed: int, episodes: int = 3) -> list[Any]:
    """Everything the env says over a few episodes of seeded random actions."""
    env, rng = KeaSim(cfg), random.Random(actions_seed)
    out: list[Any] = []
    for episode in range(episodes):
        obs = env.reset(seed=episode)
        out.append(obs)
        finished = False
        while not finished:
            result = env.step(rng.randrange(len(obs["action"])))
            out.append((result.obs, result.reward, result.terminated, result.truncated, result.info))
            obs, finished = result.obs, result.truncated or result.terminated
    return out


# -- the app ---------------------------------------------------------------------------------------------------------


def test_same_config_same_app_prompts_and_rewards() -> None:
    cfg = SimConfig(seed=11, screens=10, horizon=15)
    assert build_app(cfg) == build_app(SimConfig(seed=11, screens=10, horizon=15))
    assert trace(cfg, 3) == trace(SimConfig(seed=11, screens=10, horizon=15), 3)


def test_same_config_same_app_in_every_process() -> None:
    """A farm builds the app once per client process: string hashing must not leak into it."""
    code = (
        "import hashlib, json, random\n"
        "from envs.kea_sim import KeaSim, SimConfig\n"
        "env, rng, out = KeaSim(SimConfig(seed=5)), random.Random(1), []\n"
        "obs = env.reset()\n"
        "for _ in range(12):\n"
        "    r = env.step(rng.randrange(len(obs['action']))); obs = r.obs; out.append([obs, r.reward])\n"
        "print(hashlib.sha256(json.dumps(out).encode()).hexdigest())\n"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        # a fresh interpreter and 12 steps of the simulator: 0.2-0.5 s alone; x100
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env)
        assert done.returncode == 0, done.stderr
        digests.add(done.stdout.strip())
    here, rng, out = KeaSim(SimConfig(seed=5)), random.Random(1), []
    obs = here.reset()
    for _ in range(12):
        r = here.step(rng.randrange(len(obs["action"])))
        obs = r.obs
        out.append([obs, r.reward])
    assert digests == {hashlib.sha256(json.dumps(out).encode()).hexdigest()}


def test_different_seed_different_app() -> None:
    apps = [build_app(SimConfig(seed=seed)) for seed in range(8)]
    assert apps[0] != apps[1]
    assert len({json.dumps({n: [(w.kind, w.text, w.target) for w in s.widgets] for n, s in app.items()}) for app in apps}) == 8
    first = [KeaSim(SimConfig(seed=seed)).reset()["prompt"] for seed in range(8)]
    assert len(set(first)) > 1
    assert trace(SimConfig(seed=0), 3) != trace(SimConfig(seed=1), 3)


@pytest.mark.parametrize(
    "cfg",
    [
        SimConfig(),
        SimConfig(seed=3, screens=2, links_per_screen=1, external_links=0),
        SimConfig(seed=7, screens=16, links_per_screen=1),
        SimConfig(seed=9, screens=12, tarpits=False),
    ],
    ids=["default", "two-screens", "sixteen-one-link", "no-tarpits"],
)
def test_every_ordinary_screen_is_reachable_from_main(cfg: SimConfig) -> None:
    app = build_app(cfg)
    screens = ordinary(app)
    assert len(screens) == cfg.screens and "MainActivity" in screens
    assert (LICENSES in app, ADVERT in app) == (cfg.tarpits, cfg.tarpits)
    paths = paths_from_main(cfg)
    assert screens <= set(paths)
    env = KeaSim(cfg)
    for name in screens | ({LICENSES, ADVERT} if cfg.tarpits else set()):
        obs = go(env, paths[name])  # and the simulator takes the same path
        assert page(obs) == name
    external = [w for s in app.values() for w in s.widgets if w.target in OUTSIDE]
    assert len(external) == cfg.external_links
    assert all(len(s.widgets) >= cfg.links_per_screen for n, s in app.items() if n in screens)


# -- rewards ---------------------------------------------------------------------------------------------------------


def test_first_visit_pays_and_revisit_does_not() -> None:
    cfg = SimConfig(seed=2, **RULES)
    env = KeaSim(cfg)
    obs = env.reset()
    label = next(w.text for w in env.app["MainActivity"].widgets if w.target in SCREEN_NAMES)
    first = env.step(touch(obs, label))
    target = first.info["screen"]
    assert (first.reward, first.info["from"], first.info["outside"]) == (2.5, "MainActivity", False)
    assert f"Visited pages: MainActivity, {target}\n" in first.obs["prompt"]
    back = env.step(named(first.obs, BACK))
    assert (back.reward, back.info["screen"]) == (-0.125, "MainActivity")  # Main was seen at the start
    again = env.step(touch(back.obs, label))
    assert (again.reward, again.info["screen"]) == (-0.125, target)
    assert again.info["new_states"] == first.info["new_states"] == 2
    env.reset()  # a new episode forgets what was visited
    assert env.step(touch(env.reset(), label)).reward == 2.5


def external_screen(cfg: SimConfig) -> tuple[str, str]:
    """(screen, label) of the first widget that opens another app."""
    app = build_app(cfg)
    return next((n, w.text) for n in sorted(ordinary(app)) for w in app[n].widgets if w.target in OUTSIDE)


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_another_app_costs_every_step_until_back(seed: int) -> None:
    cfg = SimConfig(seed=seed, external_links=2, **RULES)
    screen, label = external_screen(cfg)
    env = KeaSim(cfg)
    obs = go(env, paths_from_main(cfg)[screen])
    result = env.step(touch(obs, label))
    assert result.reward == -7.0
    assert result.info["outside"] is True and result.info["screen"] in OUTSIDE
    assert f"Current page: {result.info['screen']} (outside the app)\n" in result.obs["prompt"]
    assert result.obs["action"] == [f"0: {BACK}", f"1: {KILL}"]  # another app's screen: nothing of ours to touch
    back = env.step(0)
    assert (back.reward, back.info["screen"], back.info["outside"]) == (-0.125, screen, False)


def test_back_on_main_leaves_for_the_launcher_and_an_intent_returns() -> None:
    env = KeaSim(SimConfig(seed=1, **RULES))
    obs = env.reset()
    out = env.step(named(obs, BACK))
    assert (out.reward, out.info["screen"], out.info["outside"]) == (-7.0, LAUNCHER, True)
    assert out.obs["action"] == [f"0: {INTENT}", f"1: {BACK}", f"2: {KILL}"]
    still = env.step(named(out.obs, BACK))  # BACK on the launcher stays there, and costs again
    assert (still.reward, still.info["screen"]) == (-7.0, LAUNCHER)
    home = env.step(named(still.obs, INTENT))
    assert (home.reward, home.info["screen"], home.info["outside"]) == (-0.125, "MainActivity", False)
    assert page(home.obs) == "MainActivity"
    assert env.step(named(home.obs, BACK)).info["screen"] == LAUNCHER  # and the app's first screen again


def test_kill_costs_and_restarts_on_main() -> None:
    cfg = SimConfig(seed=6, **RULES)
    env = KeaSim(cfg)
    deepest = max(paths_from_main(cfg).items(), key=lambda kv: len(kv[1]) if kv[0] in SCREEN_NAMES else -1)
    obs = go(env, deepest[1])
    assert len(deepest[1]) >= 2 and page(obs) == deepest[0]
    killed = env.step(named(obs, KILL))
    assert (killed.reward, killed.info["screen"], killed.info["from"]) == (-3.0, "MainActivity", deepest[0])
    after = env.step(named(killed.obs, BACK))  # the back stack went with the app
    assert after.info["screen"] == LAUNCHER
    again = env.step(named(after.obs, KILL))  # from the launcher too
    assert (again.reward, again.info["screen"]) == (-3.0, "MainActivity")


@pytest.mark.parametrize("tarpit", [LICENSES, ADVERT])
@pytest.mark.parametrize("seed", [0, 5])
def test_tarpit_touches_stay_inside_and_only_back_leaves(tarpit: str, seed: int) -> None:
    cfg = SimConfig(seed=seed, **RULES)
    env = KeaSim(cfg)
    path = paths_from_main(cfg)[tarpit]
    obs = go(env, path[:-1])
    entry = page(obs)
    result = env.step(touch(obs, path[-1]))
    assert (result.info["screen"], result.reward) == (tarpit, 2.5)  # a new state the first time, like any screen
    touches = [i for i, a in enumerate(result.obs["action"]) if "TouchEvent(" in a]
    assert len(touches) == 5 and len(result.obs["action"]) == 7
    for i in touches + touches[::-1]:  # every row or link, twice
        result = env.step(i)
        assert (result.info["screen"], result.reward) == (tarpit, -0.125)
        assert [a for a in result.obs["action"] if "TouchEvent(" in a] == [env.events[j] for j in touches]
    for _ in range(2 * len(touches) + 1):  # each touch opened the same screen again on the back stack
        if result.info["screen"] != tarpit:
            break
        result = env.step(named(result.obs, BACK))
    assert (result.info["screen"], result.reward) == (entry, -0.125)


# -- episodes --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("horizon", [1, 5])
def test_episode_is_truncated_exactly_at_the_horizon(horizon: int) -> None:
    env = KeaSim(SimConfig(seed=3, horizon=horizon))
    for _ in range(2):  # and again after a reset
        obs = env.reset()
        for t in range(1, horizon + 1):
            result = env.step(len(obs["action"]) - 1 if t % 2 else 0)
            assert (result.terminated, result.truncated) == (False, t == horizon)
            obs = result.obs
        with pytest.raises(RuntimeError, match="reset"):
            env.step(0)


def test_step_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        KeaSim().step(0)


@pytest.mark.parametrize("bad", [-1, 6, "0", True, 1.0, None])
def test_invalid_actions_raise_and_change_nothing(bad: Any) -> None:
    env = KeaSim()
    obs = env.reset()
    assert len(obs["action"]) == 6  # the default app's MainActivity: four widgets, BACK, kill
    with pytest.raises(InvalidAction, match=re.escape(repr(bad))):
        env.step(bad)
    result = env.step(0)
    assert env.t == 1 and result.obs["prompt"].count("\n- ") == 1


# -- prompts and actions ---------------------------------------------------------------------------------------------


def history(obs: Observation) -> list[str]:
    lines = obs["prompt"].splitlines()
    start, end = lines.index("History of actions:"), next(i for i, line in enumerate(lines) if line.startswith("Current page: "))
    return lines[start + 1 : end]


def check_prompt(env: KeaSim, obs: Observation, seen: list[str]) -> None:
    """The prompt's parts in Kea's order; `seen`: the app's screens in order of first visit."""
    lines = obs["prompt"].splitlines()
    assert obs["prompt"].endswith("\n")
    assert lines[0] == TASK
    assert lines[1] == f"Visited pages: {', '.join(seen)}"
    assert lines[2] == "History of actions:"
    here = page(obs)
    assert here == env.stack[-1]
    views = next(line for line in lines if line.startswith("Views: "))
    for w in env.app[here].widgets:
        assert f"<{w.kind.lower()}>{w.text}</{w.kind.lower()}>" in views
    if not env.app[here].widgets:
        assert views == "Views: <none/>"
    actions = lines.index("Actions:")
    assert lines[actions + 1 :] == obs["action"]  # the numbered actions are exactly the candidates
    assert lines[actions - 1] == views
    assert obs["question"] == DEFAULT_QUESTION


@pytest.mark.parametrize("limit", [0, 3])
def test_prompt_has_keas_parts_and_history_grows_by_one(limit: int) -> None:
    env = KeaSim(SimConfig(seed=4, horizon=9, history_limit=limit))
    rng = random.Random(0)
    obs = env.reset()
    seen = ["MainActivity"]
    check_prompt(env, obs, seen)
    assert history(obs) == []
    done_steps: list[str] = []
    for t in range(1, 10):
        chosen = rng.randrange(len(obs["action"]))
        event = obs["action"][chosen].split(": ", 1)[1]
        result = env.step(chosen)
        obs, here = result.obs, result.info["screen"]
        if here not in seen and not result.info["outside"]:
            seen.append(here)
        done_steps.append(f"- {event} -> {here}")
        check_prompt(env, obs, seen)
        assert history(obs) == (done_steps[-limit:] if limit else done_steps)
        assert len(history(obs)) == (min(t, limit) if limit else t)


def test_action_strings_have_keas_shapes() -> None:
    cfg = SimConfig(seed=0)
    env = KeaSim(cfg)
    state_of: dict[str, str] = {}
    for labels in paths_from_main(cfg).values():
        obs = go(env, labels)
        here = page(obs)
        actions = obs["action"]
        widgets = env.app[here].widgets
        touches = [TOUCH.fullmatch(a) for a in actions[: len(widgets)]]
        assert all(touches), actions
        for i, (m, w) in enumerate(zip(touches, widgets)):
            assert m is not None
            assert (int(m[1]), m[4], m[5], m[6]) == (i, here.split("/")[-1], w.kind, w.text)
        states = {m[2] for m in touches if m is not None}
        assert len(states) <= 1  # one state hash per screen
        if states:
            assert state_of.setdefault(here, states.pop()) not in {v for k, v in state_of.items() if k != here}
        views = [m[3] for m in touches if m is not None]
        texts = [w.text for w in widgets]
        assert len(set(views)) == len(set(texts))  # a view hash per widget label
        rest = actions[len(widgets) :]
        expected = ([INTENT] if here == LAUNCHER else []) + [BACK, KILL]
        assert rest == [f"{len(widgets) + i}: {e}" for i, e in enumerate(expected)]
    assert len(state_of) >= 8


def test_action_strings_without_hashes() -> None:
    env = KeaSim(SimConfig(seed=0, event_hashes=False))
    obs = env.reset()
    plain = [PLAIN_TOUCH.fullmatch(a) for a in obs["action"][:-2]]
    assert all(plain) and obs["action"][-2:] == [f"4: {BACK}", f"5: {KILL}"], obs["action"]
    assert "state=" not in obs["prompt"]
    hashed = KeaSim(SimConfig(seed=0)).reset()
    assert len(obs["prompt"]) < len(hashed["prompt"])
    long = [TOUCH.fullmatch(a) for a in hashed["action"][:-2]]
    assert [m[4] for m in plain if m] == [m[6] for m in long if m] and len(long) == len(plain) == 4  # the same widgets


# -- configuration ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("screens", 1),
        ("screens", 17),
        ("screens", "8"),
        ("links_per_screen", 0),
        ("links_per_screen", 9),
        ("external_links", -1),
        ("external_links", 9),
        ("horizon", 0),
        ("horizon", 2.5),
        ("horizon", True),
        ("history_limit", -1),
        ("seed", None),
        ("tarpits", "no"),
        ("event_hashes", 1),
        ("reward_new_state", "1"),
        ("penalty_outside", float("nan")),
        ("penalty_kill", True),
    ],
)
def test_bad_config_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field}={re.escape(repr(value))}: "):
        SimConfig(**{field: value})


def test_config_accepts_its_edges() -> None:
    SimConfig(screens=2, links_per_screen=1, external_links=0, horizon=1, history_limit=0)
    SimConfig(screens=16, links_per_screen=8, external_links=16, reward_new_state=1, penalty_kill=0)


# -- the random baseline -----------------------------------------------------------------------------------------------

UNSAFE = ("-Share)", "-Open in browser)", "-Open source licenses)", "-Sponsored banner)", KILL)


def careful(obs: Observation, rng: random.Random) -> int:
    """Random among the touches that keep the app in front and out of the tarpits; leave a tarpit or other app by BACK."""
    here, actions = page(obs), obs["action"]
    if here == LAUNCHER:
        return named(obs, INTENT)
    if here in (LICENSES, ADVERT) or here in OUTSIDE:
        return named(obs, BACK)
    return rng.choice([i for i, a in enumerate(actions) if "TouchEvent(" in a and not a.endswith(UNSAFE)])


def careful_returns(cfg: SimConfig, episodes: int) -> list[float]:
    env, rng, returns = KeaSim(cfg), random.Random(0), []
    for _ in range(episodes):
        obs, total, finished = env.reset(), 0.0, False
        while not finished:
            result: StepResult = env.step(careful(obs, rng))
            total, obs, finished = total + result.reward, result.obs, result.truncated
        returns.append(total)
    return returns


@pytest.mark.parametrize("seed", [0, 3])
def test_random_policy_gets_stuck_where_a_careful_one_does_not(seed: int) -> None:
    cfg = SimConfig(seed=seed)
    random_mean = statistics.mean(random_returns(lambda i: KeaSim(cfg), 300))
    careful_mean = statistics.mean(careful_returns(cfg, 300))
    assert 0 < random_mean < careful_mean - 1.5, (random_mean, careful_mean)
    assert careful_mean > 2 * random_mean
    assert careful_mean < cfg.horizon * cfg.reward_new_state  # sanity: no more than a new screen per step
