"""Generation-mode PPO learns, through real processes: `ppoz up` runs Redis, the broker, an LLM actor and the
learner, each its own process; client threads `generate` and `feedback` over the real protocol.

The toy task is verifiable: the prompt names a colour ("say the word blue") and the reward is 1 when the
response's first word is that colour. The tiny model (a random Llama with a word-level tokenizer of 20
tokens, a rank-4 LoRA adapter, the learner's default learning rate for it) starts near chance (1 in 20);
the run takes its whole budget of responses, and the reward over its last 1,200 must stand clearly above
the untrained policy's in every window: learned, and still learned at the end, with the actor serving the
weights the learner published. A policy that learns and then falls back fails: at the old default
learning rate (1e-3) most runs reached 0.95 and fell to 0.5 to 0.8 (`ppoz bench stability`).
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest

from client import Client
from tests.helpers import wait_for
from tests.processes import Up, free_port, ppoz, status
from tests.test_up import last_update
from tools.bench.stability import WINDOW, figures, prompt_and_reward, stack_config

BUDGET = 6000  # responses: at the default learning rate the reward passes 0.9 after 3,000 to 4,000 of them
CLIENTS = 8


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 70 s on a quiet 2-core machine
def test_generation_ppo_learns_to_say_the_word_through_real_processes(tmp_path, tiny_model):
    model = tiny_model("llama", tokenizer="words")
    front, back, weights = free_port(), free_port(), free_port()
    config = tmp_path / "stack.toml"
    config.write_text(stack_config(model, f"tcp://127.0.0.1:{front}", f"tcp://127.0.0.1:{back}", f"tcp://127.0.0.1:{weights}", tmp_path))
    up = Up(config)
    rewards: list[tuple[float, int]] = []  # (reward, policy version that wrote the response)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def play(i: int) -> None:
        rng = random.Random(i)
        try:
            # a generate of 2 tokens at the actor process, and the broker's back-pressure holds while the learner trains:
            # seconds at most alone; x20 an attempt
            with Client(f"tcp://127.0.0.1:{front}", deadline=120, attempt_timeout=60) as client:
                task = client.attach()
                while len(rewards) < BUDGET:
                    prompt, reward_of = prompt_and_reward(rng)
                    client.wait_turn(task)  # the broker's back-pressure: it holds clients while the learner is behind
                    reply = client.generate(task, prompt, max_new_tokens=2)
                    reward = reward_of(reply["text"])
                    client.feedback(task, reward, done=True)
                    with lock:
                        rewards.append((reward, reply["policy_version"]))
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    try:
        # `ppoz up`'s stack: a broker, an actor and a learner (two torch processes at once): 15-20 s alone; x15
        wait_for(lambda: (s := status(front)) and s["actors"], timeout=300, what=f"the stack to start\n{up.text()[-3000:]}")
        threads = [threading.Thread(target=play, args=(i,)) for i in range(CLIENTS)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)  # 6,000 responses: about 60 s alone (the test: 79 s); x10, inside the test's 900 s
        elapsed = time.monotonic() - started
        final = status(front)
        table = ppoz("status", "--broker", f"tcp://127.0.0.1:{front}", timeout=60)  # no torch: under 1 s alone; x60
    finally:
        code = up.stop()
    assert code == 0, up.text()[-3000:]  # first: a process that failed stops the stack, and its clients' errors follow
    assert not errors, errors[0]
    # `ppoz status` shows the generation learner's last update as it reports it (issue 41: the line was empty)
    assert table.returncode == 0, table.stderr
    assert last_update(table.stdout, "policy_loss", "value_loss", "entropy", "approx_kl", "kl_ref", "clipfrac"), table.stdout
    untrained = [r for r, v in rewards if v == 0]
    windows = [statistics.mean(r for r, _ in rewards[i : i + WINDOW]) for i in range(0, BUDGET - WINDOW + 1, WINDOW)]
    summary = f"{len(rewards)} responses in {elapsed:.0f} s, windows of {WINDOW}: {' '.join(f'{w:.2f}' for w in windows)}"
    summary += f"; learner {final and {k: v for k, v in final['learner'].items() if k.startswith(('counters', 'updates', 'charts'))}}"
    # How many responses come before the first published version depends on the machine's load (94 to 130
    # measured); 50 at the untrained policy's 0.05 give a mean with a standard error of 0.03.
    assert len(untrained) >= 50 and statistics.mean(untrained) < 0.2, f"untrained {statistics.mean(untrained):.2f}; {summary}"
    assert max(v for _, v in rewards) >= 20, f"the actor served no trained version; {summary}"  # the learner published, the actor took it
    # learned, and still learned over the last 1,200 responses. Measured there (ppoz bench stability, 8,000-response
    # runs, responses 4,800 to 6,000): 0.92 to 1.00 in every window at the default learning rate; at 1e-3, windows
    # of 0.43 to 0.65 in most runs, the policy having reached 0.95 first.
    tail = windows[-8:]
    assert min(tail) >= 0.6 and statistics.mean(tail) >= 0.8, summary
    # and never lost what it had learned on the way: at the default rate a window fell at most 0.09 below the best
    # before it; at 1e-3, 0.47, 0.61 and 0.35 (ppoz bench stability, 3 runs; the last climbed back by the end)
    run = figures([r for r, _ in rewards[:BUDGET]])
    assert run["learned_at"] is not None and run["fall"] <= 0.3, f"fell {run['fall']:.2f}; {summary}"
    assert final is not None and final["learner"].get("counters/dropped_mismatched", 0) == 0
