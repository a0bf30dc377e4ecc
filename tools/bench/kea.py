"""`ppoz bench kea`: a whole stack at Kea's shapes on this CPU, as a GUI-testing farm drives it.

A 2-layer, hidden-64 Qwen2 with Qwen2.5's 151,936-token vocabulary (the vocabulary's cost alone, no width),
`ppoz up` with the defaults (`rollout_batch` 64), and `--clients` clients each sending Kea-shaped observations (a
1,024-token prompt, 32 candidates of 40-60 tokens), a reward after each step, for `--minutes`. It reports what a
farm's operator watches: updates applied, jobs taken as hung and requeued, the seconds a step takes as the
client sees it (the actor's scoring of one observation, most of it), and the learner's and the actor's peak
memory (their processes' own high-water mark, VmHWM). Before issue 54 this run was killed for memory at the
learner's first update, and the broker took the busy actor as hung every 20 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tools.bench.train_tasks import CACHE

VOCAB = 151_936


def kea_model() -> Path:
    """The model: tiny_config's Qwen2 (hidden 64, 2 layers, tied embeddings) at the full vocabulary, with `ppoz bench
    train`'s real-shape tokenizer (a byte-level BPE as Qwen2's, which transformers loads a Qwen2 model's folder
    with, over all 151,936 ids; each of its number words one token after a space), built once into the cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.tiny_models import tiny_config
    from tools.bench.train_tasks import shaped_tokenizer

    path = CACHE / "kea-qwen2-152k-bpe"
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    shaped_tokenizer(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=VOCAB)).save_pretrained(str(path))
    return path


def observation(generator: Any, prompt: int = 1024, candidates: int = 32, low: int = 40, high: int = 60) -> dict[str, Any]:
    """A Kea-shaped observation in number words, one token each: a `prompt`-token screen description, the question,
    and `candidates` actions of `low` to `high` tokens."""
    import torch

    from models.tiny_models import DIGIT_WORDS

    def words(n: int) -> str:
        return " ".join(DIGIT_WORDS[int(i)] for i in torch.randint(0, len(DIGIT_WORDS), (n,), generator=generator))

    sizes = torch.randint(low, high + 1, (candidates,), generator=generator).tolist()
    return {"prompt": " " + words(prompt), "question": " seven ", "action": [words(n) for n in sizes]}


def peak_rss_gb(pid: int | None) -> float | None:
    """A process's high-water mark of resident memory (VmHWM), in GB; None if it is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 2)
    except OSError:
        return None
    return None


def drive(broker: str, stop: threading.Event, seed: int, seconds: list[float], errors: list[str]) -> None:
    """One emulator: attach, then step and feedback until `stop`, each step's seconds recorded."""
    import torch

    from client import Client

    generator = torch.Generator().manual_seed(seed)
    with Client(broker, deadline=600.0, attempt_timeout=600.0) as client:
        task = client.attach()
        while not stop.is_set():
            obs = observation(generator)
            started = time.monotonic()
            try:
                reply = client.step(task, obs)
            except Exception as e:  # noqa: BLE001 - counted and reported: the run goes on as a farm would
                errors.append(f"{type(e).__name__}: {e}")
                stop.wait(1.0)  # not a tight loop of refusals
                continue
            seconds.append(time.monotonic() - started)
            client.feedback(task, 1.0 if reply["action"] % 4 == 0 else 0.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the clients step (default %(default)s)")
    parser.add_argument("--clients", type=int, default=1, help="emulators stepping at once (default %(default)s)")
    parser.add_argument("--updates", type=int, default=0, help="stop once the learner has applied this many updates (0: run --minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")


def main(args: argparse.Namespace) -> int:
    from client import Client
    from ppoz.ports import free_port
    from ppoz.up import UpConfig
    from tools.harness import wait_for_actor, watched_stack

    model = kea_model()
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-kea-") as tmp:
        front, back, weights = free_port(), free_port(), free_port()
        config = Path(tmp) / "kea.toml"
        config.write_text(
            f'[policy]\nmodel = "{model}"\n'
            f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\n'
            f'[actor]\nbroker = "tcp://127.0.0.1:{back}"\nweights = "tcp://127.0.0.1:{weights}"\n'
            f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\ncheckpoint_dir = "{tmp}/ckpt"\ntensorboard_dir = ""\n'
        )
        up = UpConfig(actors=1)
        log = open(Path(tmp) / "stack.log", "w")
        with watched_stack(up, str(config), "info", output=log) as stack:
            if not wait_for_actor(stack, timeout=600):
                print(f"ppoz bench kea: no actor registered within 600 s (log: {Path(tmp) / 'stack.log'})")
                return 1
            stop = threading.Event()
            seconds: list[float] = []
            errors: list[str] = []
            clients = [
                threading.Thread(target=drive, args=(stack.client_broker, stop, i, seconds, errors), daemon=True)
                for i in range(args.clients)
            ]
            started = time.monotonic()
            for c in clients:
                c.start()
            pids = {c.name: c.pid for c in stack.supervisor.components}
            with Client(stack.client_broker, deadline=30.0) as probe:
                status: dict[str, Any] = {}
                while time.monotonic() - started < args.minutes * 60:
                    time.sleep(5)
                    status = probe.status()
                    updates = int(status.get("learner", {}).get("updates", 0) or 0)
                    if args.updates and updates >= args.updates:
                        break
                    if stack.supervisor.failed:
                        break
                stop.set()
                peaks = {name: peak_rss_gb(pids.get(name)) for name in ("learner", "actor-0")}
                for c in clients:
                    c.join(600)
                status = probe.status()
        counters = status.get("counters", {})
        result = {
            "minutes": round((time.monotonic() - started) / 60, 2),
            "clients": args.clients,
            "steps": len(seconds),
            "errors": len(errors),
            "first_error": errors[0] if errors else "",
            "updates": int(status.get("learner", {}).get("updates", 0) or 0),
            "actors_hung": counters.get("actors/hung", 0),
            "jobs_requeued": counters.get("jobs/requeued", 0),
            "step_s_median": round(statistics.median(seconds), 3) if seconds else None,
            "step_s_max": round(max(seconds), 3) if seconds else None,
            "learner_peak_gb": peaks["learner"],
            "actor_peak_gb": peaks["actor-0"],
            "failed": str(stack.supervisor.failed or ""),
        }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return 0
