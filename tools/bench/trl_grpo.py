"""The trl leg of `ppoz bench train`: trl's GRPOTrainer on one of tools/bench/train_tasks.py's tasks, for a budget.

Run by the Python of the bench's trl environment (tools/bench/trl_env.py `ensure_trl`), which sees this
environment's packages through a `.pth` file: it imports trl, and of PPOZ only what needs no more than the
PPOZ environment's packages (the task: its prompts, its model's builder, its reward). Its last line on
stdout is one JSON object: samples, response_tokens, seconds, val_before, val_after, validations, cpu_s, ...

The work, as tools/bench/train_leg.py gives it to `ppoz train`: the task's model and weights, prompts and reward,
4 responses per prompt, the task's max_new_tokens sampled at temperature 1 (no top-k, no top-p), all weights
trained at the task's learning rate (constant), 32 responses generated per generation batch and trained on in
minibatches of 16, one optimizer step each (per_device_train_batch_size 16, gradient_accumulation_steps 1,
generation_batch_size 32: trl's steps_per_generation becomes 2), 2 passes (num_iterations), clip 0.2, KL beta
0.001 (trl's k3), token-mean loss (trl's `dapo`, PPOZ's `token-mean`), gradient norm clipped at 0.5 (PPOZ's
learner's max_grad_norm). So 32 responses make 4 optimizer steps here, as 32 responses (rollout_batch) make
2 epochs x 2 minibatches of 16 in PPOZ's learner. Validation: greedy, the task's max_new_tokens, on its
validation prompts, every `--val-every-s` seconds of training (left out of the training seconds).

Workarounds trl 1.16 needed for this model and this comparison:
- the tokenizer is a word-level one without a chat template: the dataset's prompts are plain text
  (trl's "standard" format), so trl tokenizes them with the tokenizer as is (its post-processor adds <s>,
  as PPOZ's actor does) and never calls apply_chat_template;
- the tokenizer and model are loaded here and handed to the trainer (a model id would make trl call
  AutoProcessor and load the weights itself); the tokenizer is left-padded for generation, its pad
  token (<pad>, id 0) set explicitly on the tokenizer, the model config and the generation config (trl
  falls back to eos as pad when it finds none, which would mask real end tokens);
- the saved generation_config.json has no sampling settings; trl builds its own GenerationConfig
  (do_sample, temperature 1, top_k 0, top_p 1), and validation passes its own greedy settings to
  model.generate, so nothing of the saved config decides the sampling;
- trl's defaults that differ from its Trainer's are set back: bf16 autocast off (trl turns it on when fp16 is
  off; on cuda the weights are bfloat16 themselves, as PPOZ's are), gradient checkpointing off (trl turns it
  on; PPOZ does not checkpoint), a constant learning rate (the linear decay over max_steps would depend on
  the huge max_steps that a time budget needs);
- the trainer has no end but the budget: max_steps is huge and a TrainerCallback sets
  control.should_training_stop once the budget is spent; no saving (save_strategy "no", an output_dir
  in a temporary directory), no reporting, no progress bars, no logging of completions;
- responses generated for training are counted in the reward function (each call gets one generation
  batch), since one optimizer step is 16 of them, reused over 2 passes: steps x 32 would be wrong here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import warnings
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--task", required=True, help="demo, long or real-shape (tools/bench/train_tasks.py)")
    parser.add_argument("--seconds", type=float, required=True, help="wall-clock budget, counted from after the model is built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: 0, torch's own default: every core)")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda if there is one (default); weights in the dtype PPOZ's policy takes there: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument("--val-every-s", type=float, default=15.0, help="greedy validation every this many seconds of training")
    args = parser.parse_args(argv)

    from ppoz.demo_arithmetic import GRPO_GROUP
    from rewards.functions import load_reward_fn
    from tools.bench.train_tasks import TASKS  # imports nothing beyond the PPOZ environment's packages

    task = TASKS[args.task]
    val_every_s = args.val_every_s  # `args` is the callbacks' TrainingArguments below
    model_dir = task.model()
    started = time.monotonic()  # the budget, from the point the ppoz leg starts its timer
    deadline = started + args.seconds

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from models.policy_model import ModelSpec

    placed = ModelSpec(model=str(model_dir), device=args.device)  # the device and dtype PPOZ's policy takes there
    device = placed.resolved_device()
    on_gpu = device.type == "cuda"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames (gradient -> activation checkpointing)
    score = load_reward_fn(task.reward_fn)
    rows, val_rows = task.train_rows(), task.val_rows()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    tokenizer.pad_token = "<pad>"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=placed.resolved_dtype()).to(device)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompts = tokenizer([r["prompt"] for r in val_rows], return_tensors="pt", padding=True).to(device) if val_rows else None

    def validate() -> float | None:
        """Greedy, the task's max_new_tokens, on its validation prompts, scored with its reward (None: it has none)."""
        if prompts is None:
            return None
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **prompts,
                max_new_tokens=task.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        if was_training:
            model.train()
        texts = tokenizer.batch_decode(out[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(score(r["data_source"], t, r["ground_truth"]) for r, t in zip(val_rows, texts)) / len(val_rows)

    val_before = validate()
    generated, tokens = [0], [0]

    def reward(completions: list[str], ground_truth: list[str], data_source: list[str], completion_ids: list[Any], **_: Any) -> list[float]:
        generated[0] += len(completions)
        tokens[0] += sum(len(ids) for ids in completion_ids)
        return [float(score(d, c, g)) for c, g, d in zip(completions, ground_truth, data_source)]

    class Budget(TrainerCallback):
        """Stops training when the budget is spent; validates every --val-every-s seconds of training."""

        def __init__(self) -> None:
            self.began = 0.0
            self.validating_s = 0.0  # time spent validating during training, left out of the training seconds
            self.next_validation = val_every_s if prompts is not None else float("inf")
            self.validations: list[tuple[float, float | None]] = []
            self.ended = 0.0

        def training_s(self) -> float:
            return time.monotonic() - self.began - self.validating_s

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.began = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> Any:
            if self.training_s() >= self.next_validation:
                at, t0 = self.training_s(), time.monotonic()
                value = validate()
                self.validating_s += time.monotonic() - t0
                self.validations.append((round(at, 1), value))
                print(f"trl: {at:.0f} s, step {state.global_step}, {generated[0]} responses, validation {value:.3f}", flush=True)
                self.next_validation += val_every_s
            if time.monotonic() >= deadline:
                control.should_training_stop = True
            return control

        def on_train_end(self, *a: Any, **k: Any) -> None:
            self.ended = time.monotonic()

    budget = Budget()
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=not on_gpu,
            bf16=False,  # no autocast: the weights are in the device's dtype already, as PPOZ's are
            fp16=False,
            activation_checkpointing=False,
            learning_rate=task.policy_lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=0.5,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            generation_batch_size=32,
            num_generations=GRPO_GROUP,
            max_completion_length=task.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_iterations=2,
            epsilon=0.2,
            beta=0.001,
            loss_type="dapo",
            max_steps=10**9,
            seed=args.seed,
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            disable_tqdm=True,
            log_completions=False,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[budget],
        )
        trainer.train()
        steps = trainer.state.global_step
    seconds = (budget.ended or time.monotonic()) - budget.began - budget.validating_s
    val_after = validate()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = {
        "samples": generated[0],
        "response_tokens": tokens[0],
        "seconds": round(seconds, 1),
        "steps": steps,
        "val_before": val_before,
        "val_after": val_after,
        "validations": budget.validations,
        "budget_s": args.seconds,
        "wall_s": round(time.monotonic() - started, 1),
        "cpu_s": round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1),
        "peak_rss_mb": round(max(own.ru_maxrss, children.ru_maxrss) / 1024, 1),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "python": sys.executable,
        "pid": os.getpid(),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
