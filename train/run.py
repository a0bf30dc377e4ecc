"""One training run's driver side: datasets, rewards, validation before and after, the drivers with a
progress line, the resume state and the summary. The stack it drives is someone else's: `ppoz train`
starts one on this machine (ppoz/train.py) or drives a farm's broker.

Files under `output_dir`:
    driver_state.json   where the prompts stand (resume point), written every progress line and at the end
    summary.json        the run's figures: validation before and after, rewards, counts
    progress.jsonl      one line per progress report: time, samples, reward mean, the learner's figures; a resumed
                        run goes on with its times after the last run's, a run from the start writes it anew
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewards.composite import CompositeReward
from rewards.functions import load_reward_fn
from rewards.group import GroupAdvantage
from train.config import TrainConfig
from train.data import PromptOrder, PromptRecord, load_dataset
from train.driver import BatchingScorer, DriverProgress, Sampling, drive, validate

log = logging.getLogger(__name__)

# The learner's figures a progress line shows, by the name it gives them (learner_node/generation.py).
LEARNER_FIGURES = {
    "kl": "generation/kl_ref",
    "policy_loss": "generation/policy_loss",
    "value_loss": "generation/value_loss",
    "clip_fraction": "generation/clipfrac",
    "response_length": "generation/response_length",
    "version": "version",
}


def build_reward(cfg: TrainConfig) -> CompositeReward:
    """The composite reward `cfg` describes; each source loaded once here, or asked of the reward service."""
    if cfg.reward_service:
        weights, reward_model, judge = _service_sources(cfg)
    else:
        weights = cfg.reward_weights()
        reward_model = judge = None
        if weights.get("rm_score"):
            from rewards.reward_model import RewardModel

            reward_model = RewardModel(cfg.reward_model_config())
        if weights.get("judge_score"):
            from rewards.judge import Judge

            judge = Judge(cfg.judge_config())
    reward_fn = load_reward_fn(cfg.reward_fn or "default") if weights.get("rule_score") else None
    return CompositeReward(weights, reward_fn, reward_model, judge, cfg.reward_normalise, cfg.reward_clip)


def _service_sources(cfg: TrainConfig) -> tuple[dict[str, float], Any, Any]:
    """The weights, and clients of the reward service at `cfg.reward_service` for rm_score and judge_score
    (what it hosts counts 1.0 each unless `weights` says otherwise); a weight it cannot serve stops the run at start."""
    from rewards.service import RemoteJudge, RemoteRewardModel, RewardServiceClient

    endpoint, timeout, retries = cfg.reward_service, cfg.reward_service_timeout_s, cfg.reward_service_retries
    probe = RewardServiceClient(endpoint, timeout, retries)
    try:
        hosted = probe.components()
    finally:
        probe.close()
    log.info("the reward service at %s hosts %s", endpoint, ", ".join(hosted))
    weights = cfg.reward_weights(hosted)
    clients: dict[str, Any] = {}
    for component, client_class in (("rm_score", RemoteRewardModel), ("judge_score", RemoteJudge)):
        if not weights.get(component):
            continue
        if component not in hosted:
            raise ValueError(f"reward weight {component} is set but the reward service at {endpoint} hosts only {', '.join(hosted)}")
        clients[component] = client_class(endpoint, timeout, retries)
    return weights, clients.get("rm_score"), clients.get("judge_score")


def load_records(path: str, strict: bool, limit: int = 0) -> list[PromptRecord]:
    records, report = load_dataset(path, strict)
    if report.skipped:
        print(f"ppoz train: {path}: {report.skipped} of {report.read} records skipped; first: {report.reasons[0]}", flush=True)
    return records[:limit] if limit else records


def order_identity(order: PromptOrder, data: str) -> dict[str, Any]:
    """What a resume point belongs to: the dataset and the order of work over it."""
    return {
        "data": data,
        "n_records": order.n_records,
        "epochs": order.epochs,
        "rollout_n": order.rollout_n,
        "seed": order.seed,
        "shuffle": order.shuffle,
    }


def read_state(path: Path, order: PromptOrder, data: str) -> int:
    """The resume point a previous run left for this dataset and order, else 0."""
    if not path.is_file():
        return 0
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s cannot be read: starting from the first prompt", path)
        return 0
    same = order_identity(order, data)
    if {k: state.get(k) for k in same} != same:
        print(f"ppoz train: {path} is for another dataset or order: starting from the first prompt", flush=True)
        return 0
    return int(state.get("resume_from", 0))


def write_state(path: Path, order: PromptOrder, data: str, progress: DriverProgress) -> None:
    state = {**order_identity(order, data), "resume_from": progress.resume_from, "time": time.time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # a crash mid-write leaves the previous state, never half of one


def progress_line(done: int, total: int | None, progress: DriverProgress, elapsed: float, learner: dict[str, float]) -> str:
    """One progress report: samples, the drivers' reward figures, and the learner's latest."""
    reward = progress.recent_mean()
    reward = math.nan if reward is None else reward
    shown = str(done)
    this_run = len(progress.done)  # positions done since this run's start
    if total:
        shown = f"{done}/{total} ({done / total:.0%}"
        if this_run and done < total:  # the rest at this run's pace so far
            shown += f", eta {_duration((total - done) * elapsed / this_run)}"
        shown += ")"
    parts = [
        f"samples {shown}",
        f"reward_mean {reward:.3f}",
        f"unrewarded {progress.unrewarded}",
        f"tokens/s {progress.response_tokens / max(elapsed, 1e-9):.1f}",
    ]
    recent = progress.recent_uniform[-100:]
    if recent:  # GRPO: the share of the last 100 groups whose responses all scored alike (advantages 0: nothing learned)
        parts.append(f"uniform_groups {sum(recent) / len(recent):.0%}")
    parts += [f"{name} {learner[key]:.4g}" for name, key in LEARNER_FIGURES.items() if key in learner and math.isfinite(learner[key])]
    return "  ".join(parts)


def _duration(seconds: float) -> str:
    """42s, 7m05s, 3h12m."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run_training(
    cfg: TrainConfig,
    frontend: str,
    learner_figures: Callable[[], dict[str, float]] = dict,
    stop: threading.Event | None = None,
    echo: Callable[[str], None] = lambda line: print(line, flush=True),
    grouping: GroupAdvantage | None = None,
) -> dict[str, Any]:
    """Validation, the drivers until the order of work ends (or `max_samples`, or `stop`), validation
    again; the summary (also written to output_dir/summary.json). With `grouping` (GRPO or RLOO: the learner's
    [generation] advantage = grpo or rloo) the drivers send group-relative advantages over each prompt's
    rollout_n responses (train/driver.py)."""
    if grouping is not None and cfg.rollout_n < 2:
        raise ValueError(
            f"[train] rollout_n = {cfg.rollout_n}: {grouping.estimator.upper()} compares the responses to one prompt, so it needs 2 or more"
        )
    stop = stop or threading.Event()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(cfg.data, cfg.strict)
    val = load_records(cfg.val, cfg.strict, cfg.val_size) if cfg.val else []
    reward = build_reward(cfg)
    order = PromptOrder(len(records), cfg.epochs, cfg.rollout_n, cfg.shuffle, cfg.seed)
    state_path = out / "driver_state.json"
    start = read_state(state_path, order, cfg.data) if cfg.resume else 0
    if start:
        echo(f"ppoz train: resuming at sample {start}")
    if order.total is not None and start >= order.total:
        echo(f"ppoz train: the last run with {out} finished all {order.total} samples; --no-resume starts again")
    summary: dict[str, Any] = {"data": cfg.data, "records": len(records), "val_records": len(val), "start": start}

    warned: list[bool] = []  # the learner's advantage against the drivers', said once

    def check_learner(figures: dict[str, float]) -> None:
        learner_grpo = figures.get("generation/group_relative")
        if learner_grpo is not None and bool(learner_grpo) != (grouping is not None) and not warned:
            warned.append(True)
            mode = "grpo or rloo" if learner_grpo else "gae"
            log.error(
                "the learner trains with [generation] advantage = %s but these drivers send %s: give both the same setting",
                mode,
                f"group-relative advantages ({grouping.estimator})" if grouping else "rewards (gae)",
            )

    def validation(when: str) -> None:  # `before` or `after`: the mean reward and the first responses into the summary
        result = validate(frontend, val, reward, cfg.max_new_tokens, cfg.chat_template, cfg.workers, cfg.deadline_s)
        summary[f"val_{when}"], summary[f"val_examples_{when}"] = result["mean_reward"], result["responses"][:3]
        echo(f"ppoz train: validation reward {when}: {result['mean_reward']:.4f}")

    if val:
        echo(f"ppoz train: validating on {len(val)} prompts (greedy) before training")
        validation("before")
    total = order.total if not cfg.max_samples else min(order.total or cfg.max_samples, start + cfg.max_samples)
    progress = DriverProgress(start=start)
    scorer = BatchingScorer(reward, max_batch=max(cfg.workers, 1))
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, tuple(cfg.stop), cfg.chat_template)
    started = time.monotonic()
    driving = threading.Thread(
        target=drive,
        kwargs=dict(
            frontend=frontend,
            records=records,
            order=order,
            scorer=scorer,
            sampling=sampling,
            workers=cfg.workers,
            start=start,
            stop=stop,
            limit=cfg.max_samples or None,
            deadline_s=cfg.deadline_s,
            progress=progress,
            seed=cfg.seed,
            reward_timeout_s=cfg.reward_timeout_s,
            grouping=grouping,
        ),
        name="drivers",
        daemon=True,
    )
    driving.start()
    progress_path = out / "progress.jsonl"
    before = _last_time(progress_path) if start else 0.0  # the curve of a resumed run goes on where the last one ended
    with progress_path.open("a" if start else "w") as lines:
        while driving.is_alive():
            driving.join(cfg.report_every_s)
            elapsed = time.monotonic() - started
            figures = _safe(learner_figures)
            check_learner(figures)
            done = start + len(progress.done)  # positions from `start` on
            echo(progress_line(done, total, progress, elapsed, figures))
            row = {"time": before + elapsed, "samples": done, "reward_mean": progress.recent_mean()}
            lines.write(json.dumps({**row, **{k: figures.get(v) for k, v in LEARNER_FIGURES.items()}}) + "\n")
            lines.flush()
            write_state(state_path, order, cfg.data, progress)
    scorer.close()
    write_state(state_path, order, cfg.data, progress)
    summary.update(
        samples=len(progress.done),
        rewarded=progress.rewarded,
        unrewarded=progress.unrewarded,
        unrewarded_reasons=progress.errors[:5],
        **({"groups": progress.groups, "uniform_groups": progress.uniform_groups, "lone": progress.lone} if grouping else {}),
        stopped_workers=progress.stopped_workers,
        reward_mean=progress.reward_sum / progress.rewarded if progress.rewarded else None,
        resume_from=progress.resume_from,
        seconds=round(time.monotonic() - started, 1),
        learner={k: v for k, v in _safe(learner_figures).items() if k in LEARNER_FIGURES.values()},
    )
    if val:
        validation("after")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _last_time(path: Path) -> float:
    """The time of the last readable row of a progress file (0 if none)."""
    try:
        rows = path.read_text().splitlines()
    except OSError:
        return 0.0
    for line in reversed(rows):
        try:
            return float(json.loads(line)["time"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0.0


def _safe(figures: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The learner's figures, or none while they cannot be read (a progress line never stops a run)."""
    try:
        return figures()
    except Exception as e:  # noqa: BLE001
        log.debug("learner figures unavailable: %s", e)
        return {}
