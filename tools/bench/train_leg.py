"""The ppoz leg of `ppoz bench train`: `ppoz train` with GRPO on one of tools/bench/train_tasks.py's tasks, for a budget.

Run as a process (`python -m tools.bench.train_leg --task long --seconds 150 --out DIR`). It does what
`ppoz demo --task arithmetic --advantage grpo` does, for any task: writes the task's prompts, builds its model,
starts the stack (embedded Redis, the broker, one actor, the learner: ppoz/demo_arithmetic.py's stack_config,
all weights trained at the task's learning rate) and the drivers, validates greedily before, every
`--val-every-s` seconds of training (beside the drivers, which go on) and after, and stops when the budget is
spent. The budget counts from just before the stack starts, as the trl leg's counts from before it imports trl;
the model is built before either. Its last line on stdout is the run's summary (`ppoz train --json`'s).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from ppoz.flags import add_device_flag
from tools.bench.train_tasks import TASKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--seconds", type=float, required=True, help="wall-clock budget, from just before the stack starts")
    parser.add_argument("--out", required=True, help="the run's folder (data, stack settings, outputs)")
    parser.add_argument("--val-every-s", type=float, default=15.0, help="greedy validation every this many seconds of training")
    parser.add_argument("--report-every", type=float, default=5.0, help="seconds between progress rows")
    add_device_flag(parser, "the actor's and the learner's: cpu, cuda or auto (default: cuda if there is one)")
    parser.add_argument(
        "--max-stream-backlog",
        type=int,
        default=-1,
        help="the broker's max_stream_backlog (default: -1, the learner's own limit; 32: one rollout beyond the one trained)",
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)

    # the tables of the stack's file register as their modules are imported (ppoz's parser imports them all)
    import actor_node.config  # noqa: F401
    import broker.config  # noqa: F401
    import ppoz.up  # noqa: F401
    from dataset_driver.config import TrainConfig
    from ppoz.demo_arithmetic import GRPO_GROUP, stack_config
    from ppoz.train import advantage_settings, finish, on_this_machine, stop_on_signals

    task = TASKS[args.task]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, val = out / "train.jsonl", out / "val.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in task.train_rows()))
    val_rows = task.val_rows()
    val.write_text("".join(json.dumps(row) + "\n" for row in val_rows))
    model = str(task.model())
    config = out / "stack.toml"
    backlog = args.max_stream_backlog
    config.write_text(stack_config(out, lora_rank=0, device=args.device, max_stream_backlog=backlog, policy_lr=task.policy_lr))
    cfg = TrainConfig(
        data=str(data),
        val=str(val) if val_rows else "",
        val_every_s=args.val_every_s if task.target is not None else 0.0,
        epochs=0,
        rollout_n=GRPO_GROUP,
        resume=False,
        workers=8,
        seed=0,
        max_new_tokens=task.max_new_tokens,
        reward_fn=task.reward_fn,
        output_dir=str(out / "train"),
        report_every_s=args.report_every,
    )
    print(f"ppoz bench train: the {task.name} task on {model}, {args.seconds:g} s; outputs in {out}", flush=True)
    stop, interrupt = stop_on_signals()
    timer = threading.Timer(args.seconds, stop.set)
    timer.daemon = True
    timer.start()
    run = argparse.Namespace(config=str(config), log_level=args.log_level, model=model)
    summary = on_this_machine(run, cfg, stop, *advantage_settings(str(config), "grpo"), interrupt=interrupt)
    timer.cancel()
    return finish(cfg, summary, as_json=True)


if __name__ == "__main__":
    sys.exit(main())
