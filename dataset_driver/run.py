"""One training run's driver side: datasets, rewards, validation before and after, the drivers with a
progress line, the resume state and the summary. The stack it drives is someone else's: `ppoz train`
starts one on this machine (ppoz/train.py) or drives a farm's broker.

Files under `output_dir`:
    driver_state.json   the order of work and its run id (sample ids are `<run>:<position>`), written before the first
                        sample is sent; and the first position not yet done, a hint rewritten every progress line:
                        which samples are stored is read from Redis (dataset_driver/resume.py)
    summary.json        the run's figures: validation before and after, rewards, counts, the curve and the checkpoint; what
                        `ppoz train --json` prints last, written once at the end (`write_summary`; strict JSON: null, never NaN)
    progress.jsonl      one line per progress report: time, samples, reward mean, the learner's figures; a resumed
                        run goes on with its times after the last run's, a run from the start writes it anew
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import local_path
from common.learner_figures import GENERATION, Latest, UpdateFigure, cycle_seconds
from common.protocol import Limits
from dataset_driver.config import TrainConfig
from dataset_driver.data import PromptOrder, PromptRecord, load_dataset
from dataset_driver.driver import BatchingScorer, DriverProgress, Sampling, drive, request_problem, validate
from dataset_driver.group_advantage import GroupAdvantage
from dataset_driver.resume import SampleMarks, load_samples, new_run_id
from rewards.composite import CompositeReward
from rewards.functions import RewardFn, load_reward_fn

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # after `stop`, how long turns in flight may take to be fed back before the run stops without them
STOP_POLL_S = 0.2  # how often the run looks at `stop` while the drivers work

# The learner's figures a progress line shows, by the name it gives them (common/learner_figures.py).
LEARNER_FIGURES = {
    "kl": UpdateFigure.KL_REF.of(GENERATION),
    "policy_loss": UpdateFigure.POLICY_LOSS.of(GENERATION),
    "value_loss": UpdateFigure.VALUE_LOSS.of(GENERATION),
    "clip_fraction": UpdateFigure.CLIPFRAC.of(GENERATION),
    "response_length": UpdateFigure.RESPONSE_LENGTH.of(GENERATION),
    "version": Latest.VERSION.value,
}


def build_reward(cfg: TrainConfig, reward_fn: RewardFn | None = None) -> CompositeReward:
    """The composite reward `cfg` describes; each source loaded once here, or asked of the reward service.
    `reward_fn`: the reward function `prepare` loaded (a user's module is run once, not once per check)."""
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
    if not weights.get("rule_score"):
        reward_fn = None
    elif reward_fn is None:
        reward_fn = load_reward_fn(cfg.reward_fn or "default")
    return CompositeReward(
        weights,
        reward_fn,
        reward_model,
        judge,
        cfg.reward_normalise,
        cfg.reward_clip,
        max_abs_reward=cfg.max_abs_reward,
        reward_fn_timeout_s=cfg.reward_fn_timeout_s,
    )


def _service_sources(cfg: TrainConfig) -> tuple[dict[str, float], Any, Any]:
    """The weights, and clients of the reward service at `cfg.reward_service` for rm_score and judge_score
    (what it hosts counts 1.0 each unless `weights` says otherwise); a weight it cannot serve stops the run at start."""
    from rewards.service import RemoteJudge, RemoteRewardModel, RewardServiceClient

    endpoint, timeout, retries = cfg.reward_service, cfg.reward_service_timeout_s, cfg.reward_service_retries
    keys = cfg.reward_service_keys()
    probe = RewardServiceClient(endpoint, timeout, retries, curve=keys)
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
        clients[component] = client_class(endpoint, timeout, retries, max_abs_reward=cfg.max_abs_reward, curve=keys)
    return weights, clients.get("rm_score"), clients.get("judge_score")


def load_records(path: str, strict: bool, limit: int = 0, fits: Callable[[PromptRecord], str] | None = None) -> list[PromptRecord]:
    records, report = load_dataset(path, strict, fits)
    if report.skipped:
        print(f"ppoz train: {path}: {report.skipped} of {report.read} records skipped; first: {report.reasons[0]}", flush=True)
    return records[:limit] if limit else records


def sampling_of(cfg: TrainConfig) -> Sampling:
    return Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, tuple(cfg.stop), cfg.chat_template)


@dataclass(frozen=True)
class Prepared:
    """What a run checks before any process starts: its datasets (each record within the broker's limits) and its
    reward function (loaded, so a wrong path or name stops the run at once)."""

    records: list[PromptRecord]
    val: list[PromptRecord]
    reward_fn: RewardFn | None = None  # None: no rule_score weight


def prepare(cfg: TrainConfig, limits: Limits | None = None) -> Prepared:
    """Load and check the datasets and the reward function; DatasetError or ValueError (RewardError) names what is wrong.
    `limits`: the broker's ([broker] table); a record its generate request would exceed is a bad record, named."""
    limits = limits or Limits()
    sampling = sampling_of(cfg)
    fits = lambda record: request_problem(record, sampling, limits)  # noqa: E731
    records = load_records(cfg.data, cfg.strict, fits=fits)
    greedy = Sampling(cfg.max_new_tokens, 0.0, chat_template=cfg.chat_template)  # validation's requests
    val = load_records(cfg.val, cfg.strict, cfg.val_size, lambda record: request_problem(record, greedy, limits)) if cfg.val else []
    reward_fn = load_reward_fn(cfg.reward_fn or "default") if cfg.reward_weights().get("rule_score") else None
    return Prepared(records, val, reward_fn)


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


def read_state(path: Path, order: PromptOrder, data: str) -> tuple[str, int]:
    """The run id and resume point a previous run left for this dataset and order; ("", 0) if none."""
    if not path.is_file():
        return "", 0
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s cannot be read: starting from the first prompt", path)
        return "", 0
    same = order_identity(order, data)
    recorded = {k: state.get(k) for k in same}
    if isinstance(recorded["data"], str):  # a run from before paths were made absolute recorded the path as given
        recorded["data"] = local_path(recorded["data"])
    if recorded != same:
        print(f"ppoz train: {path} is for another dataset or order: starting from the first prompt", flush=True)
        return "", 0
    return str(state.get("run") or ""), int(state.get("resume_from", 0))


def write_state(path: Path, order: PromptOrder, data: str, run: str, resume_from: int) -> None:
    """Replace the state file whole (a kill mid-write leaves the previous one), on disk before this returns."""
    state = {**order_identity(order, data), "run": run, "resume_from": resume_from, "time": time.time()}
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(state))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def strict_json(value: Any) -> Any:
    """`value` with NaN and infinities as None (JSON's null): what json.dumps(..., allow_nan=False) accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON (RFC 8259): undefined figures are null."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


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
    prepared: Prepared | None = None,
    marks: SampleMarks | None = None,
    wait_for_learner: Callable[[threading.Event], None] | None = None,
    interrupt: threading.Event | None = None,
) -> dict[str, Any]:
    """Validation, the drivers until the order of work ends (or `max_samples`, or `stop`), validation
    again; the summary (`ppoz train` adds to it and writes it to output_dir/summary.json). With `grouping` (GRPO or RLOO: the learner's
    [generation] advantage = grpo or rloo) the drivers send group-relative advantages over each prompt's
    rollout_n responses (dataset_driver/driver.py).

    `prepared`: the datasets `prepare` checked (else loaded here); `marks`: the Redis the broker stores sample
    marks in (without it a resumed run starts at the state file's hint and may play a few samples again);
    `wait_for_learner(stop)`: called once the drivers finished the order, to let a learner started for this
    run train what they sent before the validation after. On `stop` (a time limit, a component that died, a
    signal) the drivers stop within STOP_GRACE_S; `interrupt` (set with `stop` by SIGTERM or SIGINT) also
    skips the validation after: the run is not over, and a resumed run goes on from its place."""
    if grouping is not None and cfg.rollout_n < 2:
        raise ValueError(
            f"[train] rollout_n = {cfg.rollout_n}: {grouping.estimator.upper()} compares the responses to one prompt, so it needs 2 or more"
        )
    stop = stop or threading.Event()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepared or prepare(cfg)
    records, val = prepared.records, prepared.val
    reward = build_reward(cfg, prepared.reward_fn)
    order = PromptOrder(len(records), cfg.epochs, cfg.rollout_n, cfg.shuffle, cfg.seed)
    state_path = out / "driver_state.json"
    run, start = read_state(state_path, order, cfg.data) if cfg.resume else ("", 0)
    run = run or new_run_id()
    write_state(state_path, order, cfg.data, run, start)  # the run id is on disk before any sample is sent
    samples = load_samples(run, marks, grouped=grouping is not None)
    ahead = sum(1 for position in samples.stored if position >= start)
    if start or ahead:
        skipping = f"; {ahead} samples after it were stored before and are skipped" if ahead else ""
        echo(f"ppoz train: resuming at sample {start}{skipping}")
    if order.total is not None and start >= order.total:
        echo(f"ppoz train: the last run with {out} finished all {order.total} samples; --no-resume starts again")
    summary: dict[str, Any] = {"data": cfg.data, "records": len(records), "val_records": len(val), "start": start, "run": run}

    warned: list[bool] = []  # the learner's advantage against the drivers', said once

    def check_learner(figures: dict[str, float]) -> None:
        learner_grpo = figures.get(UpdateFigure.GROUP_RELATIVE.of(GENERATION))
        if learner_grpo is not None and bool(learner_grpo) != (grouping is not None) and not warned:
            warned.append(True)
            mode = "grpo or rloo" if learner_grpo else "gae"
            log.error(
                "the learner trains with [generation] advantage = %s but these drivers send %s: give both the same setting",
                mode,
                f"group-relative advantages ({grouping.estimator})" if grouping else "rewards (gae)",
            )

    def validation(when: str) -> float:  # `before`, `after` or `at N s`: the mean reward (before and after: into the summary)
        result = validate(frontend, val, reward, cfg.max_new_tokens, cfg.chat_template, cfg.workers, cfg.deadline_s)
        if when in ("before", "after"):
            summary[f"val_{when}"], summary[f"val_examples_{when}"] = result["mean_reward"], result["responses"][:3]
        echo(f"ppoz train: validation reward {when}: {result['mean_reward']:.4f}")
        return float(result["mean_reward"])

    if val:
        echo(f"ppoz train: validating on {len(val)} prompts (greedy) before training")
        validation("before")
    total = order.total if not cfg.max_samples else min(order.total or cfg.max_samples, start + cfg.max_samples)
    progress = DriverProgress(start=start)
    scorer = BatchingScorer(reward, max_batch=max(cfg.workers, 1))
    sampling = sampling_of(cfg)
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
            samples=samples,
        ),
        name="drivers",
        daemon=True,
    )
    driving.start()
    progress_path = out / "progress.jsonl"
    before = _last_time(progress_path) if start else 0.0  # the curve of a resumed run goes on where the last one ended
    stopping_since: float | None = None  # when the loop saw `stop` (polled every STOP_POLL_S)
    next_report = time.monotonic() + cfg.report_every_s
    # validation while training (val_every_s): greedy on the validation prompts beside the drivers, which go on
    next_validation = started + cfg.val_every_s if val and cfg.val_every_s else math.inf
    validations: list[list[float]] = []  # [seconds of training when it began, mean reward]
    with progress_path.open("a" if start else "w") as lines:
        while driving.is_alive():
            driving.join(STOP_POLL_S)
            now = time.monotonic()
            if stop.is_set():
                stopping_since = stopping_since or now
                if driving.is_alive() and now - stopping_since < STOP_GRACE_S:
                    continue
                if driving.is_alive():  # their turns are not stored, or stored once: a resumed run plays or skips them
                    echo(f"ppoz train: stopping without the turns still in flight after {STOP_GRACE_S:g} s; a resumed run plays them")
                    break
            elif driving.is_alive() and now < min(next_report, next_validation):
                continue
            elapsed = now - started
            val_reward = None
            if driving.is_alive() and not stop.is_set() and now >= next_validation:
                val_reward = validation(f"at {before + elapsed:.0f} s")
                validations.append([round(before + elapsed, 1), val_reward])
                next_validation = time.monotonic() + cfg.val_every_s
            next_report = now + cfg.report_every_s
            figures = _safe(learner_figures)
            check_learner(figures)
            done = start + len(progress.done)  # positions from `start` on
            echo(progress_line(done, total, progress, elapsed, figures))
            row = {"time": before + elapsed, "samples": done, "reward_mean": progress.recent_mean()}
            if val_reward is not None:
                row["val_reward"] = val_reward
            lines.write(dumps({**row, **{k: figures.get(v) for k, v in LEARNER_FIGURES.items()}}) + "\n")
            lines.flush()
            write_state(state_path, order, cfg.data, run, progress.resume_from)
    interrupted = interrupt is not None and interrupt.is_set()
    if interrupted:  # a batch still being scored is not waited for, nor a reward function that hangs
        scorer.abandon()
        echo(f"ppoz train: the drivers stopped {time.monotonic() - (stopping_since or time.monotonic()):.1f} s after the signal")
    else:
        scorer.close()
    write_state(state_path, order, cfg.data, run, progress.resume_from)
    if not stop.is_set() and wait_for_learner is not None:  # the order of work is done: the learner trains its end
        wait_for_learner(stop)
    last_figures = _safe(learner_figures)
    summary.update(
        samples=len(progress.done) - progress.skipped,
        skipped=progress.skipped,
        stopped=interrupted,
        rewarded=progress.rewarded,
        unrewarded=progress.unrewarded,
        unrewarded_reasons=progress.errors[:5],
        unrewarded_by_cause=dict(sorted(reward.unrewarded.items())),  # component/reason: out_of_range, timed_out, ...
        **({"groups": progress.groups, "uniform_groups": progress.uniform_groups, "lone": progress.lone} if grouping else {}),
        stopped_workers=progress.stopped_workers,
        reward_mean=progress.reward_sum / progress.rewarded if progress.rewarded else None,
        response_tokens=progress.response_tokens,
        **({"validations": validations} if validations else {}),
        resume_from=progress.resume_from,
        seconds=round(time.monotonic() - started, 1),
        learner={k: v for k, v in last_figures.items() if k in LEARNER_FIGURES.values()},
        learner_cycle=cycle_seconds(last_figures),  # the learner's seconds by part of its loop, to its last update
    )
    if val and not interrupted:
        validation("after")
    return summary


def write_summary(output_dir: str | Path, summary: dict[str, Any]) -> Path:
    """output_dir/summary.json: the whole summary as strict JSON, put in place at once (written beside it, then
    renamed over it: a reader never finds half of it)."""
    path = Path(output_dir) / "summary.json"
    writing = path.with_name(f".summary.json.{os.getpid()}")
    writing.write_text(dumps(summary, indent=2))
    os.replace(writing, path)
    return path


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
