"""One training run's driver side: datasets, rewards, validation before and after, the drivers with a
progress line, the resume state and the summary. The stack it drives is someone else's: `ppoz train`
starts one on this machine (ppoz/train.py) or drives a farm's broker.

Files under `output_dir`:
    driver_state.json   where the prompts stand (resume point), written every progress line and at the end
    summary.json        the run's figures: validation before and after, rewards, counts
    progress.jsonl      one line per progress report: time, samples, reward mean, the learner's figures
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
    """The composite reward `cfg` describes; each source loaded once."""
    weights = cfg.reward_weights()
    reward_fn = load_reward_fn(cfg.reward_fn or "default") if weights.get("rule_score") else None
    reward_model = judge = None
    if weights.get("rm_score"):
        from rewards.reward_model import RewardModel, RewardModelConfig

        reward_model = RewardModel(RewardModelConfig(cfg.reward_model, device=cfg.reward_model_device))
    if weights.get("judge_score"):
        from rewards.judge import Judge, JudgeConfig

        judge = Judge(
            JudgeConfig(
                model=cfg.judge_model,
                provider=cfg.judge_provider,
                base_url=cfg.judge_base_url,
                api_key_env=cfg.judge_api_key_env,
                preset=cfg.judge_preset,
                concurrency=cfg.judge_concurrency,
                timeout_s=cfg.judge_timeout_s,
            )
        )
    return CompositeReward(weights, reward_fn, reward_model, judge, cfg.reward_normalise, cfg.reward_clip)


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
    reward = progress.recent_mean()
    reward = math.nan if reward is None else reward
    shown = f"{done}/{total}" if total else str(done)
    parts = [
        f"samples {shown}",
        f"reward_mean {reward:.3f}",
        f"unrewarded {progress.unrewarded}",
        f"tokens/s {progress.response_tokens / max(elapsed, 1e-9):.1f}",
    ]
    parts += [f"{name} {learner[key]:.4g}" for name, key in LEARNER_FIGURES.items() if key in learner and math.isfinite(learner[key])]
    return "  ".join(parts)


def run_training(
    cfg: TrainConfig,
    frontend: str,
    learner_figures: Callable[[], dict[str, float]] = dict,
    stop: threading.Event | None = None,
    echo: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, Any]:
    """Validation, the drivers until the order of work ends (or `max_samples`, or `stop`), validation
    again; the summary (also written to output_dir/summary.json)."""
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
        ),
        name="drivers",
        daemon=True,
    )
    driving.start()
    with (out / "progress.jsonl").open("a") as lines:
        while driving.is_alive():
            driving.join(cfg.report_every_s)
            elapsed = time.monotonic() - started
            figures = _safe(learner_figures)
            done = start + len(progress.done)  # positions from `start` on
            echo(progress_line(done, total, progress, elapsed, figures))
            row = {"time": elapsed, "samples": done, "reward_mean": progress.recent_mean()}
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


def _safe(figures: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The learner's figures, or none while they cannot be read (a progress line never stops a run)."""
    try:
        return figures()
    except Exception as e:  # noqa: BLE001
        log.debug("learner figures unavailable: %s", e)
        return {}
