"""What the learner says of each update: its log line, systemd's status line, TensorBoard, and the figures it
leaves in Redis for `ppoz status`, `ppoz train`, the demo and the ledger (common/learner_figures.py names them)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from common.learner_figures import Chart, Latest, UpdateFigure, counter_key
from common.sd_notify import Notifier

# The learner's logger: the farm reads its update lines by this name (tools/reliability/farm_processes.py).
log = logging.getLogger("learner_node.worker")


class Reporter:
    """Rank 0's: the others have no TensorBoard writer and a silent notifier."""

    def __init__(self, notifier: Notifier, tensorboard_dir: str) -> None:
        self.notifier = notifier
        self.writer: Any = None
        if tensorboard_dir:
            from torch.utils.tensorboard.writer import FileWriter

            self.writer = FileWriter(tensorboard_dir)

    def update(self, metrics: Mapping[str, float], n: int, updates: int, version: int, trained_kind: str) -> None:
        """An applied update of `n` transitions: the status and log lines show the figures of the kind of policy it
        trained first (`trained_kind`, a prefix of common/learner_figures.UPDATE_PREFIXES)."""

        def figure(name: UpdateFigure) -> float:
            return metrics.get(name.of(trained_kind), math.nan)

        episodic_return = metrics.get(Chart.EPISODIC_RETURN.key, math.nan)
        self.notifier.status(
            f"policy version {version}, {updates} updates, last: {n} transitions, return "
            f"{episodic_return:.3f}, policy loss {figure(UpdateFigure.POLICY_LOSS):.4f}",
            min_interval_s=0,
        )
        self.tensorboard(metrics, updates)
        log.info(
            "update %d: version %d, %d transitions, return %.3f, policy_loss %.4f, value_loss %.4f, entropy %.3f, "
            "approx_kl %.4f, kl_ref %.4f, clipfrac %.3f, lag %.2f, %.1f transitions/s",
            updates,
            version,
            n,
            episodic_return,
            figure(UpdateFigure.POLICY_LOSS),
            figure(UpdateFigure.VALUE_LOSS),
            figure(UpdateFigure.ENTROPY),
            figure(UpdateFigure.APPROX_KL),
            figure(UpdateFigure.KL_REF),
            figure(UpdateFigure.CLIPFRAC),
            metrics.get(Chart.POLICY_LAG.key, math.nan),
            metrics.get(Chart.SPS.key, 0.0),
        )

    def tensorboard(self, metrics: Mapping[str, float], updates: int) -> None:
        """Every figure but NaN, at step `updates`: one event holding them all. SummaryWriter.add_scalar builds an
        event a figure (~135 us each: 8 ms an update of 60 figures, most of the demo learner's `other` in its cycle
        profile); one summary of 60 values takes 0.8 ms (docs/benchmarks.md), and TensorBoard reads each value as
        the same scalar."""
        if self.writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=key, simple_value=float(value))
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not math.isnan(value)
        ]
        self.writer.add_summary(Summary(value=values), updates)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def latest_figures(metrics: Mapping[str, float], n: int, updates: int, version: int, counters: Mapping[str, int]) -> dict[str, float]:
    """The latest update's figures for `<prefix>:learner:latest`: live displays (`ppoz demo`, `ppoz status`)
    and the ledger, which needs the cumulative, checkpointed counters."""
    latest = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isnan(v)}
    latest.update({Latest.UPDATES: updates, Latest.VERSION: version, Latest.TRANSITIONS: n, Latest.TIME: time.time()})
    latest.update({counter_key(k): v for k, v in counters.items()})
    return latest
