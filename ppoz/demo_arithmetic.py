"""`ppoz demo --task arithmetic`: `ppoz train` on a generated dataset of sums, on this machine, no GPU.

The task: "what is two plus three" -> "five", for every pair of numbers from zero to four (25 sums),
said in words. The policy is a tiny Llama-style model built locally with a word-level tokenizer of
the number words (models/tiny_models.py `numbers`), so its first word is a number word and the
reward is verifiable: 1 when the response's first word is the sum, else 0 (chance: 1 in 17 tokens).
All its weights train (`lora_rank = 0`): on this task a rank-4 adapter learned slower (validation
0.24 against 0.40 after 90 s on the CPU VM, and it collapsed onto one answer first). A model given
with `--model` trains a rank-8 LoRA adapter at the learning rate for its size (1e-5), as the kea
demo does. `--clients` sets the driver workers (8), `--seed` the prompts' order and the sampling
seeds, `--device` the actor's and the learner's device.
`ppoz train` starts the stack as processes (embedded Redis, broker, one actor, the learner), validates
greedily on the 25 sums, trains for `--minutes` (or until `--responses` are trained), and validates again. The validation set is the
training set: a model this size learns the table, it does not generalise addition; the figure shows
what PPO taught it. `--advantage grpo` (or rloo) trains critic-free on groups of 4 responses per sum.
With `--json` the last line is the summary (`val_before`, `val_after`, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from pathlib import Path
from typing import Any

from ppoz.ports import free_port

log = logging.getLogger(__name__)

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
REWARD_FN = "first_word"
GRPO_GROUP = 4  # --advantage grpo or rloo: responses per sum, compared with each other
GAE_BACKLOG = 32  # --advantage gae: the stream holds one rollout beyond the one being trained


def sums() -> list[dict[str, Any]]:
    return [
        {"prompt": f"what is {NUMBERS[a]} plus {NUMBERS[b]}", "ground_truth": NUMBERS[a + b], "data_source": "arithmetic_words"}
        for a in range(5)
        for b in range(5)
    ]


def stack_config(out: Path, lora_rank: int = 0, device: str = "auto", max_stream_backlog: int = -1, policy_lr: float = 0.0) -> str:
    """The stack's settings: small rollouts and a one-transition segment per response (each turn ends its episode).
    `max_stream_backlog` -1 is the learner's own limit (four rollouts at its max_policy_lag of 8); `policy_lr` 0 is
    the model's default (docs/design.md)."""
    front, back, weights = free_port(), free_port(), free_port()
    on = f"device = {json.dumps(device)}\n"
    return (
        f"[policy]\nlora_rank = {lora_rank}\n"
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nsegment_len = 1\n'
        f"max_stream_backlog = {max_stream_backlog}\n"
        f'[learner]\n{on}weights_bind = "tcp://127.0.0.1:{weights}"\nrollout_batch = 32\npolicy_minibatch = 16\n'
        f"policy_lr = {policy_lr!r}\n"
        f'tensorboard_dir = "{out / "tensorboard"}"\n'
        "[generation]\nvalue_hidden = [64]\n"
        f"[actor]\n{on}weights_poll_s = 1.0\nmax_generate_rows = 32\ncredits = 32\n"  # 8 workers x groups of 4 in one batch
        "[up]\nactors = 1\nstop_timeout_s = 60\n"
    )


def settings(args: argparse.Namespace, out: Path, model: str) -> tuple[str, Any]:
    """The stack's TOML and the run's TrainConfig for these demo flags."""
    from dataset_driver.config import TrainConfig

    cfg = TrainConfig(
        data=str(out / "sums.jsonl"),
        val=str(out / "sums.jsonl"),
        epochs=0,
        rollout_n=GRPO_GROUP if args.advantage != "gae" else 1,
        resume=False,
        workers=args.clients or 8,
        seed=args.seed,
        max_new_tokens=2,
        reward_fn=REWARD_FN,
        output_dir=str(out / "train"),
        report_every_s=args.report_every,
        max_samples=args.responses,
    )
    # The critic (GAE) learned worse from the older samples a four-rollout backlog gives once the drivers no longer
    # sleep behind it (validation 0.52 and 0.60 after 5 minutes, against 0.84 with one rollout: docs/benchmarks.md);
    # GRPO keeps the learner's limit, which fed it at 188 responses/s in `ppoz bench train`.
    backlog = GAE_BACKLOG if args.advantage == "gae" else -1
    return stack_config(out, lora_rank=8 if args.model else 0, device=args.device, max_stream_backlog=backlog), cfg


def main(args: argparse.Namespace) -> int:
    from models.tiny_models import build_tiny_model
    from ppoz.train import advantage_settings, finish, on_this_machine, stop_on_signals

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sums.jsonl").write_text("\n".join(json.dumps(row) for row in sums()) + "\n")
    model = args.model or str(build_tiny_model(Path.home() / ".cache" / "ppoz" / "numbers-llama", "llama", tokenizer="numbers"))
    stack, cfg = settings(args, out, model)
    config = out / "stack.toml"
    config.write_text(stack)
    print(f"ppoz demo: arithmetic in words on {model}, {args.minutes:g} minutes; outputs in {out}", flush=True)
    stop, interrupt = stop_on_signals()  # Ctrl-C: the run stops and says so, as `ppoz train`'s does
    timer = threading.Timer(args.minutes * 60, stop.set)
    timer.daemon = True
    timer.start()
    run = argparse.Namespace(config=str(config), log_level=args.log_level, model=model)
    summary = on_this_machine(run, cfg, stop, *advantage_settings(str(config), args.advantage), interrupt=interrupt)
    timer.cancel()
    return finish(cfg, summary, args.json)
