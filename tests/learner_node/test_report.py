"""The learner's TensorBoard log (learner_node/report.py): every figure of an update at its step, read back by
TensorBoard's own reader, NaN left out, ints taken as the numbers they are."""

from __future__ import annotations

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.sd_notify import Notifier
from learner_node.report import Reporter


def test_every_figure_of_every_update_is_a_scalar_at_its_step_and_nan_is_left_out(tmp_path):
    reporter = Reporter(Notifier({}), str(tmp_path / "tb"))
    figures = [
        {"generation/policy_loss": -0.25, "generation/value_loss": math.nan, "charts/SPS": 1234.5, "cycle/idle_s": 3},
        {"generation/policy_loss": 0.125, "generation/value_loss": 2.0, "charts/SPS": 99.0, "cycle/idle_s": 7},
    ]
    for step, metrics in enumerate(figures, start=1):
        reporter.tensorboard(metrics, step)
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {
        "generation/policy_loss": [(1, -0.25), (2, 0.125)],
        "generation/value_loss": [(2, 2.0)],  # the first update had none (NaN): no point, not a NaN point
        "charts/SPS": [(1, 1234.5), (2, 99.0)],
        "cycle/idle_s": [(1, 3.0), (2, 7.0)],
    }
