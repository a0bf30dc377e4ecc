"""The trl leg of `ppoz bench train`: trl's GRPOTrainer on the arithmetic demo's work, for a wall-clock budget.

Run by the Python of the bench's trl environment (ppoz/bench/train.py `ensure_trl`), which sees this
environment's packages through a `.pth` file: it imports trl, and of PPOZ only what needs no more than the
PPOZ environment's packages (the sums, the tiny model's builder, the `first_word` reward). Its last line on
stdout is one JSON object: samples, seconds, val_before, val_after, first_at_0.7_s, cpu_s, peak_rss_mb, ...

The work, as `ppoz demo --task arithmetic --advantage grpo` defines it: the tiny numbers-llama model and its
weights, the 25 sums for training and validation, reward 1.0 when the response's first word is the sum,
4 responses per sum, 2 new tokens sampled at temperature 1 (no top-k, no top-p), all weights trained at
3e-4 (constant), 32 responses generated per generation batch and trained on in minibatches of 16, one
optimizer step each (per_device_train_batch_size 16, gradient_accumulation_steps 1, generation_batch_size
32: trl's steps_per_generation becomes 2), 2 passes (num_iterations), clip 0.2, KL beta 0.001 (trl's k3),
token-mean loss (trl's `dapo`, PPOZ's `token-mean`), gradient norm clipped at 0.5 (PPOZ's learner's
max_grad_norm). So 32 responses make 4 optimizer steps here, as 32 responses (rollout_batch) make
2 epochs x 2 minibatches of 16 in PPOZ's learner.

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
- trl's defaults that differ from its Trainer's are set back: bf16 off (trl turns it on when fp16 is
  off), gradient checkpointing off (trl turns it on; PPOZ does not checkpoint), a constant learning rate
  (the linear decay over max_steps would depend on the huge max_steps that a time budget needs);
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
from pathlib import Path
from typing import Any

TARGET = 0.7
VALIDATE_EVERY_S = 15.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, required=True, help="wall-clock budget, counted from after the model is built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: 0, torch's own default: every core)")
    args = parser.parse_args(argv)

    from common.tiny_models import build_tiny_model  # imports torch and transformers, as the ppoz demo does before its timer
    from ppoz.demo_arithmetic import GRPO_GROUP, REWARD_FN, sums
    from rewards.functions import BUILTINS

    model_dir = build_tiny_model(Path.home() / ".cache" / "ppoz" / "numbers-llama", "llama", tokenizer="numbers")
    started = time.monotonic()  # the budget, from the point the ppoz demo starts its timer
    deadline = started + args.seconds

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames (gradient -> activation checkpointing)
    score = BUILTINS[REWARD_FN]
    rows = sums()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    tokenizer.pad_token = "<pad>"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompts = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)

    def validate() -> float:
        """Greedy, 2 new tokens, on the 25 sums, scored with the demo's reward."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **prompts,
                max_new_tokens=2,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        if was_training:
            model.train()
        texts = tokenizer.batch_decode(out[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(score(r["data_source"], t, r["ground_truth"]) for r, t in zip(rows, texts)) / len(rows)

    val_before = validate()
    generated = [0]

    def first_word(completions: list[str], ground_truth: list[str], data_source: list[str], **_: Any) -> list[float]:
        generated[0] += len(completions)
        return [float(score(d, c, g)) for c, g, d in zip(completions, ground_truth, data_source)]

    class Budget(TrainerCallback):
        """Stops training when the budget is spent; validates every VALIDATE_EVERY_S seconds of training."""

        def __init__(self) -> None:
            self.began = 0.0
            self.validating_s = 0.0  # time spent validating during training, left out of the training seconds
            self.next_validation = VALIDATE_EVERY_S
            self.validations: list[tuple[float, float]] = []
            self.first_at_target: float | None = None
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
                if value >= TARGET and self.first_at_target is None:
                    self.first_at_target = round(at, 1)
                print(f"trl: {at:.0f} s, step {state.global_step}, {generated[0]} responses, validation {value:.3f}", flush=True)
                self.next_validation += VALIDATE_EVERY_S
            if time.monotonic() >= deadline:
                control.should_training_stop = True
            return control

        def on_train_end(self, *a: Any, **k: Any) -> None:
            self.ended = time.monotonic()

    budget = Budget()
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            fp16=False,
            activation_checkpointing=False,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=0.5,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            generation_batch_size=32,
            num_generations=GRPO_GROUP,
            max_completion_length=2,
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
            reward_funcs=first_word,
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
        "seconds": round(seconds, 1),
        "steps": steps,
        "val_before": val_before,
        "val_after": val_after,
        "validations": budget.validations,
        f"first_at_{TARGET}_s": budget.first_at_target,
        "budget_s": args.seconds,
        "wall_s": round(time.monotonic() - started, 1),
        "cpu_s": round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1),
        "peak_rss_mb": round(max(own.ru_maxrss, children.ru_maxrss) / 1024, 1),
        "torch_threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "python": sys.executable,
        "pid": os.getpid(),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
