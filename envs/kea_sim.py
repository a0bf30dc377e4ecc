"""A Kea-like app-exploration simulator: an Android app as a graph of screens.

What it imitates (../shared/FIELD-NOTES.md, section 1), so that the policy
sees the same kind of input a real Kea farm sends:
- prompts built like Kea's: task instructions, the pages visited so far, a
  history of completed steps that grows through the episode, the current
  screen's views, the numbered actions; the question is Kea's;
- action strings like Kea's events: `3: TouchEvent(state=<32 hex>,
  view=<32 hex>(CartActivity/Button-Checkout))`, `KeyEvent(name=BACK)`,
  `KillAppEvent()`;
- Kea-shaped rewards: a bonus for reaching a screen state not seen in this
  episode, nothing for a state seen before, a penalty for every step the app
  is out of the foreground and for killing the app;
- UI tarpits that random exploration gets stuck in: a licence list whose every
  row reopens the same list and an advert whose every link reloads it; only
  BACK leaves them. Some widgets open another app (a share sheet, a browser),
  and BACK from the app's first screen leaves it for the launcher.

An episode is `horizon` steps and ends truncated (Kea's own runs never end;
the broker closes their segments by length). Everything is derived from the
seed: the same `SimConfig` gives the same app, prompts and rewards.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

from envs.base import DEFAULT_QUESTION, Observation, StepResult, check_action

SCREEN_NAMES = [
    "MainActivity",
    "SearchActivity",
    "CartActivity",
    "ProductActivity",
    "SettingsActivity",
    "ProfileActivity",
    "OrdersActivity",
    "WishlistActivity",
    "CheckoutActivity",
    "HelpActivity",
    "CategoryActivity",
    "ReviewsActivity",
    "NotificationsActivity",
    "AddressActivity",
    "PaymentActivity",
    "CouponsActivity",
]
WIDGET_WORDS = ["Shopping list", "Deals", "Details", "More", "Open", "Next", "Browse", "Account", "History", "Info"]
LICENSES = "LicensesActivity"
ADVERT = "AdWebViewActivity"
OUTSIDE = ("com.android.chooser/ChooserActivity", "com.android.browser/BrowserActivity")
LAUNCHER = "com.android.launcher/Launcher"

BACK = "KeyEvent(name=BACK)"
KILL = "KillAppEvent()"


@dataclass(frozen=True)
class SimConfig:
    """The app and the episode; validated on construction."""

    seed: int = 0  # the app's layout (screens, links, tarpits)
    screens: int = 8  # ordinary screens, tarpits and other apps not counted
    links_per_screen: int = 3  # widgets leading to other screens of the app
    tarpits: bool = True  # a licence list and an advert, each entered from one ordinary screen
    external_links: int = 2  # widgets that open another app
    horizon: int = 12  # steps per episode
    history_limit: int = 0  # steps of history in the prompt; 0 = all of the episode, as Kea does
    event_hashes: bool = True  # Kea's state=/view= hashes in action strings (long, like Kea's)
    reward_new_state: float = 1.0
    reward_seen_state: float = 0.0
    penalty_outside: float = -0.5  # every step that ends with the app out of the foreground
    penalty_kill: float = -0.3

    def __post_init__(self) -> None:
        # Options arrive from the command line as JSON values or plain strings (`ppoz play --env-option`):
        # check the types first, so "tarpits=no" or "horizon=2.5" is refused by name, not half-accepted.
        for name in ("seed", "screens", "links_per_screen", "external_links", "horizon", "history_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: must be an int")
        for name in ("tarpits", "event_hashes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")
        for name in ("reward_new_state", "reward_seen_state", "penalty_outside", "penalty_kill"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: must be a finite number")
        if not 2 <= self.screens <= len(SCREEN_NAMES):
            raise ValueError(f"screens={self.screens}: must be between 2 and {len(SCREEN_NAMES)}")
        if not 1 <= self.links_per_screen <= 8:
            raise ValueError(f"links_per_screen={self.links_per_screen}: must be between 1 and 8")
        if not 0 <= self.external_links <= self.screens:
            raise ValueError(f"external_links={self.external_links}: must be between 0 and screens ({self.screens})")
        if self.horizon < 1:
            raise ValueError(f"horizon={self.horizon}: must be at least 1")
        if self.history_limit < 0:
            raise ValueError(f"history_limit={self.history_limit}: must be 0 (all) or more")


def demo_app(seed: int = 0) -> SimConfig:
    """The app `ppoz demo` and `ppoz bench rag` play: 8 screens, 10-step episodes, and a bounded history and no
    event hashes, so prompts stay near 750 tokens for a byte-level tiny model on a CPU (Kea's full shapes are the defaults)."""
    return SimConfig(seed=seed, screens=8, horizon=10, history_limit=3, event_hashes=False)


@dataclass(frozen=True)
class Widget:
    kind: str  # Button, TextView, ImageButton
    text: str
    target: str  # the screen it opens


@dataclass
class Screen:
    name: str
    widgets: list[Widget] = field(default_factory=list)

    @property
    def outside(self) -> bool:
        return "/" in self.name  # another app's activity


def _hex(*parts: object) -> str:
    return hashlib.md5("|".join(map(str, parts)).encode()).hexdigest()


def build_app(cfg: SimConfig) -> dict[str, Screen]:
    """The screen graph for `cfg.seed`: every ordinary screen reachable from MainActivity."""
    rng = random.Random(cfg.seed)
    names = ["MainActivity"] + rng.sample(SCREEN_NAMES[1:], cfg.screens - 1)
    app = {name: Screen(name) for name in names}
    # A random spanning tree first (so everything is reachable), then extra links.
    for i, name in enumerate(names[1:], start=1):
        parent = names[rng.randrange(i)]
        app[parent].widgets.append(Widget("Button", name.removesuffix("Activity"), name))
    for name in names:
        screen = app[name]
        while len(screen.widgets) < cfg.links_per_screen:
            target = rng.choice([n for n in names if n != name])
            screen.widgets.append(Widget("TextView", f"{rng.choice(WIDGET_WORDS)} {target.removesuffix('Activity')}", target))
    if cfg.tarpits:
        rows = [Widget("TextView", f"License {lib}", LICENSES) for lib in ("okhttp", "gson", "glide", "retrofit", "room")]
        app[LICENSES] = Screen(LICENSES, rows)
        links = [Widget("ImageButton", f"Ad {n}", ADVERT) for n in ("Buy now", "Install", "Learn more", "Sponsored", "Close?")]
        app[ADVERT] = Screen(ADVERT, links)
        app[rng.choice(names)].widgets.append(Widget("TextView", "Open source licenses", LICENSES))
        app[rng.choice(names[1:] or names)].widgets.append(Widget("ImageButton", "Sponsored banner", ADVERT))
    for name in OUTSIDE + (LAUNCHER,):
        app[name] = Screen(name)
    for i, name in enumerate(rng.sample(names, cfg.external_links)):
        label, target = (("Share", OUTSIDE[0]), ("Open in browser", OUTSIDE[1]))[i % 2]
        app[name].widgets.append(Widget("ImageButton", label, target))
    for screen in app.values():
        rng.shuffle(screen.widgets)
    return app


class KeaSim:
    """One emulator exploring one app (a TextEnv)."""

    name = "kea"

    def __init__(self, cfg: SimConfig | None = None) -> None:
        self.cfg = cfg or SimConfig()
        self.app = build_app(self.cfg)
        self.state_hash = {name: _hex(self.cfg.seed, "state", name) for name in self.app}
        self.stack: list[str] = []
        self.visited: list[str] = []
        self.history: list[str] = []
        self.events: list[str] = []  # the numbered action strings of the current observation
        self.moves: list[tuple[str, str]] = []  # what each of them does: (kind, target screen)
        self.t = 0
        self.finished = True

    # --- the episode -----------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> Observation:
        # The app is fixed by cfg.seed; an episode always starts on a fresh launch, so
        # `seed` has nothing left to randomise. It is accepted for the TextEnv interface.
        self.stack = ["MainActivity"]
        self.visited = ["MainActivity"]
        self.history = []
        self.t = 0
        self.finished = False
        return self._observe()

    @property
    def screen(self) -> Screen:
        return self.app[self.stack[-1]]

    def step(self, action: int) -> StepResult:
        if self.finished:
            raise RuntimeError("the episode is over (or was never started): call reset() first")
        check_action(action, len(self.events))
        event = self.events[action]
        before = self.stack[-1]
        reward = self._apply(action)
        self.t += 1
        here = self.stack[-1]
        self.history.append(f"{event.split(': ', 1)[1]} -> {here}")
        truncated = self.t >= self.cfg.horizon
        self.finished = truncated
        info = {"screen": here, "from": before, "new_states": len(self.visited), "outside": self.screen.outside}
        return StepResult(self._observe(), reward, False, truncated, info)

    def _apply(self, action: int) -> float:
        cfg = self.cfg
        kind, target = self.moves[action]
        if kind == "touch":
            self.stack.append(target)
            if len(self.stack) > 32:  # a real back stack is bounded too
                del self.stack[1]
        elif kind == "intent":  # from the launcher, Kea starts the app again
            self.stack = [target]
        elif kind == "back":
            if len(self.stack) > 1:
                self.stack.pop()
            else:  # BACK on the app's first screen (or on the launcher) shows the launcher
                self.stack = [LAUNCHER]
        else:  # kill: Kea restarts the app on its first screen
            self.stack = ["MainActivity"]
            return cfg.penalty_kill
        here = self.stack[-1]
        if self.app[here].outside:
            return cfg.penalty_outside
        if here not in self.visited:
            self.visited.append(here)
            return cfg.reward_new_state
        return cfg.reward_seen_state

    # --- the prompt ------------------------------------------------------------------------
    def _observe(self) -> Observation:
        screen = self.screen
        state = self.state_hash[screen.name]
        events: list[str] = []
        self.moves = []
        for w in screen.widgets:
            label = f"{screen.name.split('/')[-1]}/{w.kind}-{w.text}"
            if self.cfg.event_hashes:
                events.append(f"TouchEvent(state={state}, view={_hex(state, w.text)}({label}))")
            else:
                events.append(f"TouchEvent(view={label})")
            self.moves.append(("touch", w.target))
        if screen.name == LAUNCHER:
            events.append("IntentEvent(action=android.intent.action.MAIN, component=MainActivity)")
            self.moves.append(("intent", "MainActivity"))
        events += [BACK, KILL]
        self.moves += [("back", ""), ("kill", "")]
        self.events = [f"{i}: {e}" for i, e in enumerate(events)]
        views = "".join(f"<{w.kind.lower()}>{w.text}</{w.kind.lower()}>" for w in screen.widgets) or "<none/>"
        history = self.history[-self.cfg.history_limit :] if self.cfg.history_limit else self.history
        lines = [
            "You are a robot testing an Android app. Explore as many new screens as you can and stay inside the app.",
            f"Visited pages: {', '.join(self.visited)}",
            "History of actions:",
            *(f"- {h}" for h in history),
            f"Current page: {screen.name}" + (" (outside the app)" if screen.outside else ""),
            f"Views: {views}",
            "Actions:",
            *self.events,
        ]
        return {"prompt": "\n".join(lines) + "\n", "question": DEFAULT_QUESTION, "action": list(self.events)}


def describe(cfg: SimConfig) -> dict[str, Any]:
    """A summary of the generated app, for logs and docs."""
    app = build_app(cfg)
    return {name: [f"{w.text} -> {w.target}" for w in s.widgets] for name, s in app.items() if s.widgets}
