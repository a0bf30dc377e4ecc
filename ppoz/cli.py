"""The `ppoz` command: one entry point, one subcommand per process or tool.

Each process subcommand takes `--config FILE` (TOML, one table per component)
and one flag per config field; a flag overrides the file, the file overrides
the defaults. Logging is configured here and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from common.config import ConfigError, add_flags, load, local_path

log = logging.getLogger("ppoz")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"ppoz {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class _BenchParser(argparse.ArgumentParser):
    """The parser of one `ppoz bench NAME`, whose module (and so its options) is imported only when that
    benchmark is run or its help is asked for: the benchmarks import torch, and every other command
    (`ppoz broker`, `gateway`, `status`, ...) would otherwise spend 2 s of CPU importing it at start."""

    def __init__(self, *args: Any, module: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module: str | None = module

    def _load(self) -> None:
        if self._module is not None:
            module, self._module = importlib.import_module(self._module), None
            module.add_arguments(self)
            self.set_defaults(func=module.main)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    from actor_node.config import ActorConfig
    from broker.config import BrokerConfig

    parser = argparse.ArgumentParser(
        prog="ppoz",
        description="PPOZ: an LLM policy served to many environment clients over ZeroMQ and trained online with PPO.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity (default: info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "broker",
        help="run the broker: client sessions, routing to actors, segments to Redis",
        description="Run the broker. Clients connect to --frontend, actors to --backend.",
    )
    _config_option(p)
    add_flags(p, BrokerConfig)
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser(
        "actor",
        help="run an actor: score candidate actions and answer the broker",
        description="Run an actor process that connects to the broker's back end.",
    )
    _config_option(p)
    add_flags(p, ActorConfig)
    p.set_defaults(func=cmd_actor)

    from learner_node.config import LearnerConfig

    p = sub.add_parser(
        "learner",
        help="run the PPO learner on the Redis segment stream",
        description="Train the policy with PPO on the segments the broker writes to Redis; publish each new version.",
    )
    _config_option(p)
    add_flags(p, LearnerConfig)
    p.set_defaults(func=cmd_learner)

    from gateway.config import GatewayConfig

    p = sub.add_parser(
        "gateway",
        help="serve the PPOAPI HTTP API and forward it to the broker (unmodified Kea builds)",
        description="Serve PPOAPI's HTTP API (POST /attach, /ask, /step, /rag_step, /feedback, /detach) and "
        "forward each request to the broker over the PPOZ protocol, so an unmodified Kea build works "
        "by pointing its base URL here. See docs/client.md.",
    )
    _config_option(p)
    add_flags(p, GatewayConfig)
    p.set_defaults(func=cmd_gateway)

    from ppoz import demo

    p = sub.add_parser(
        "demo",
        help="watch an LLM policy learn on this machine (no GPU needed)",
        description="Run broker, actor, learner and simulated clients on a tiny local model and watch it learn.",
    )
    demo.add_arguments(p)
    p.set_defaults(func=demo.main)

    from ppoz import up
    from ppoz.up import UpConfig

    p = sub.add_parser(
        "up",
        help="start and supervise a whole stack on this machine",
        description="Start and supervise Redis (embedded unless a URL is given), the broker, N actors, the learner "
        "and optionally environment clients, each as its own process with its log lines prefixed by "
        "its name. The config file's [broker], [actor] and [learner] tables configure the components; "
        "[up] says what runs here. Ctrl-C or SIGTERM stops everything. See docs/farm.md.",
    )
    _config_option(p)
    add_flags(p, UpConfig)
    p.set_defaults(func=up.main)

    from ppoz import train as train_command

    p = sub.add_parser(
        "train",
        help="PPO on a prompt dataset with a reward function, reward model or LLM judge (docs/train.md)",
        description="Generation-mode PPO on a dataset of prompts: starts a stack here (as `ppoz up`) or, with "
        "--broker, drives a farm; validates before and after, shows progress, writes the run's figures "
        "under [train] output_dir. See docs/train.md.",
    )
    train_command.add_arguments(p)
    p.set_defaults(func=train_command.main)

    from ppoz import reward_server

    p = sub.add_parser(
        "reward-server",
        help="serve a reward model and/or LLM judge to every driver of a farm (docs/train.md)",
        description="Load the [reward_service] table's reward model and/or judge once and serve rm_score and judge "
        "requests over ZeroMQ to every `ppoz train` driver whose [train] reward_service points here. See docs/train.md.",
    )
    reward_server.add_arguments(p)
    p.set_defaults(func=reward_server.main)

    from ppoz import export

    p = sub.add_parser(
        "export",
        help="a checkpoint as a Hugging Face model folder (adapter merged) that from_pretrained and serving engines load",
        description="Write a learner checkpoint (LoRA adapter, all weights or sharded; or the newest in a folder of them) "
        "as a model folder: config, merged safetensors weights, tokenizer, generation config. See docs/train.md.",
    )
    export.add_arguments(p)
    p.set_defaults(func=export.main)

    from ppoz import play

    p = sub.add_parser(
        "play",
        help="run environment clients (Kea-like simulator, gymnasium games) against a broker",
        description="Play N environment clients in parallel against a broker and report episodes, returns and steps per second.",
    )
    play.add_arguments(p)
    p.set_defaults(func=play.main)

    p = sub.add_parser(
        "bench",
        help="run a benchmark (see docs/benchmarks.md)",
        description="Benchmarks; each prints a table, or one JSON object with --json.",
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="NAME", parser_class=_BenchParser)
    for name, help_text, description in (
        (
            "broker",
            "step+feedback pairs/s and latency through the broker",
            "Step+feedback pairs per second through a real broker with Redis durability on, and client-seen latency at a fixed rate.",
        ),
        (
            "scoring",
            "candidate scoring: padded sequences vs prompt KV per action vs packed",
            "Score Kea-shaped observations three ways on one model, side by side (docs/benchmarks.md).",
        ),
        (
            "learner",
            "peak memory and speed of a PPO step: packed vs one sequence per candidate",
            "Peak memory and transitions/s of one PPO policy step, packed layout against one sequence per candidate.",
        ),
        (
            "rag",
            "what rag_step's retrieval adds to a step, side by side with the plain step",
            "Time step, retrieval and rag_step on simulated Kea tasks with a corpus (docs/benchmarks.md).",
        ),
        (
            "generate",
            "PPOZ's generation engine against model.generate one at a time, as a static batch, and generate_batch",
            "The same requests through transformers (model.generate one at a time and as a static batch, generate_batch) "
            "and PPOZ (its engine, and a real broker and actor), legs alternating, medians of --repeats runs: tokens/s, "
            "p50/p99 latency, fraction of the matmul peak, equal greedy outputs (docs/benchmarks.md).",
        ),
        (
            "activations",
            "what one learner forward keeps for its backward: plain, bf16 autocast, gradient checkpointing, both",
            "A Qwen2 of a real model's width in bf16 with a float32 LoRA adapter of rank 8: the bytes autograd saves for the "
            "backward of one sequence, counted through saved-tensor hooks, four ways (docs/benchmarks.md).",
        ),
        (
            "midflight",
            "new weights while responses run: drain the batch, resubmit the unfinished rows, or continue (the actor's way)",
            "The actor's engine generates a queue of responses while a new LoRA adapter arrives every --every decode steps, "
            "taken three ways, legs alternating, medians of --repeats runs: drain the batch first, resubmit the unfinished "
            "rows, or continue with their KV recomputed; wall time, useful tokens/s, decode steps (docs/benchmarks.md).",
        ),
        (
            "learning",
            "PPO under policy lag: sync, dropping stale samples, and the decoupled objective, side by side",
            "Train a contextual bandit with the actor's and learner's own code three ways under the same budget and "
            "seeds: no lag, lag with stale samples dropped, lag with the decoupled objective (docs/benchmarks.md).",
        ),
        (
            "stability",
            "generation PPO through the real stack at several policy learning rates: does it learn, and stay learned",
            "Run the say-the-word task (a tiny random model, rank-4 LoRA) through `ppoz up` with client threads for a long run at "
            "each learning rate in --lr, legs alternating, --repeats runs each: when the reward first reaches 0.9, its peak, the "
            "last quarter's mean and worst window, and the largest fall from a peak (docs/benchmarks.md).",
        ),
        (
            "update",
            "the generation learner's update throughput: packed rows vs right-padded rows, equal losses",
            "Response tokens per second through one generation PPO update (forward, backward, optimizer steps) on long-tailed "
            "response lengths, the learner's packed layout against one right-padded sequence per row, alternating, with the "
            "losses and weights of both compared (docs/benchmarks.md).",
        ),
        (
            "drivers",
            "the dataset drivers' responses rewarded per second with an LLM judge stand-in, by judge_concurrency",
            "Responses rewarded per second and the wait from response to reward for ppoz train's drivers, with a rule reward and "
            "with an LLM judge (a local chat-completions stand-in with a set latency) at several judge_concurrency settings, "
            "end to end against a real stack and through the scoring path alone (docs/benchmarks.md).",
        ),
        (
            "train",
            "the arithmetic demo's GRPO training: PPOZ against trl's GRPOTrainer on the same work and wall-clock budget",
            "Train the arithmetic demo's work (the tiny numbers model, the 25 sums, the first_word reward, GRPO groups of 4) "
            "for the same wall-clock budget two ways, legs alternating, medians of --repeats runs: `ppoz demo --task "
            "arithmetic --advantage grpo`, and trl's GRPOTrainer in a virtual environment of its own that the bench creates "
            "on first use (trl is no dependency of PPOZ): responses/s, validation after, the first time at 0.7, CPU cores "
            "used and peak memory.",
        ),
        (
            "weights",
            "publishing a full snapshot of a GB or more, learner to applied actor, in Redis and a directory, against memcpy",
            "Publish a random model's full snapshot (1.50 GB by default) in chunks, fetch it with every checksum checked and apply "
            "it to an actor's model, through Redis and through the shared-directory store, against a plain memory copy of the "
            "same tensors; legs alternating, medians of --repeats runs: GB/s and the publisher's peak memory (docs/benchmarks.md).",
        ),
        (
            "gpu",
            "every GPU figure in one command: GAE, one update's time and peak memory at a 1.5B shape, scoring, generate, weights",
            "On a GPU, within --budget-s (8 minutes by default), at users' shapes: GAE on 131,072 tokens, one generation update "
            "with the learner's defaults at Qwen2.5-1.5B's shape (time, peak memory), the actor's decode step at 64 rows against "
            "its kernels' own GPU time, ppoz bench scoring, generate (against "
            "one request at a time and the static batch at 64 rows) and weights, and bench train's long task against trl with "
            "--trl-python; one JSON object with --json. With --device cpu the same code at tiny sizes (CI runs it).",
        ),
        (
            "farm",
            "the stack on six hosts (network namespaces, as root): links cut, Redis killed; throughput per host, recovery times",
            "Redis and the broker, two actors, a learner of two ranks on two hosts (torchrun --nnodes 2) and the clients, each "
            "in a Linux network namespace joined by a bridge. While the clients play, an actor host's link is cut for 30 s, "
            "the second learner host's link during an update, and Redis is killed and restarted; then the ledger must "
            "balance, both actors serve the newest version and no request failed. Prints steps served per host in each "
            "phase and how long each fault took to heal (docs/farm.md, docs/benchmarks.md). Needs root.",
        ),
    ):
        benches.add_parser(name, help=help_text, description=description, module=f"tools.bench.{name}")

    p = sub.add_parser(
        "status", help="show a running broker's sessions, actors and counters", description="Ask a running broker for its figures."
    )
    p.add_argument("--broker", default="tcp://127.0.0.1:5555", help="the broker's client endpoint (default: tcp://127.0.0.1:5555)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default: 5)")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    p.add_argument(
        "--curve-server-key",
        default="",
        type=local_path,
        metavar="FILE",
        help="CURVE: the broker's public key file (NAME.key), for a broker with CURVE on",
    )
    p.add_argument(
        "--curve-secret-key",
        default="",
        type=local_path,
        metavar="FILE",
        help="CURVE: this client's key pair file (NAME.key_secret), allowed by the broker",
    )
    p.set_defaults(func=cmd_status)

    from tools.reliability import fuzz, soak

    p = sub.add_parser(
        "fuzz",
        help="send adversarial messages to a running broker (and gateway) and check every answer",
        description="Fuzz a running broker's front end (and a gateway): random bytes, truncated msgpack, wrong "
        "types, huge strings and arrays, deep nesting, invalid UTF-8, floods; every well-framed "
        "request must get an error reply, memory must stay bounded, a well-behaved client "
        "alongside must see no error (docs/reliability.md).",
    )
    fuzz.add_arguments(p)
    p.set_defaults(func=fuzz.main)

    p = sub.add_parser(
        "soak",
        help="many simulated emulators against a full stack of processes, for minutes",
        description="Start Redis, a broker, an LLM actor and the learner as processes, drive N emulators for "
        "a while, and report errors, step latency and memory per window and the ledger "
        "(docs/reliability.md).",
    )
    soak.add_arguments(p)
    p.set_defaults(func=soak.main)

    from models.tiny_models import ARCHITECTURES, TOKENIZERS

    p = sub.add_parser(
        "tiny-model",
        help="build a tiny causal LM with random weights in a directory, to try a stack without a GPU or a download",
        description="Build a tiny model and its tokenizer locally (nothing is downloaded) and save them with "
        "save_pretrained, so `[policy] model = DIR` loads it as any model. Its random head and final norm train "
        "beside the LoRA adapter and the learner's policy_lr is 3e-4 by default (with LoRA and with all weights).",
    )
    p.add_argument("dir", metavar="DIR", type=local_path, help="where to write it (kept if it holds the same tiny model already)")
    p.add_argument("--arch", default="llama", choices=ARCHITECTURES, help="architecture (default: llama)")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZERS, help="tokenizer, trained locally but byte (default: byte)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser(
        "keygen",
        help="make a CURVE key pair: NAME.key (public) and NAME.key_secret (secret, mode 0600)",
        description="Write DIR/NAME.key (the public key: give it to the peers that must accept NAME) and "
        "DIR/NAME.key_secret (the key pair: it stays on this machine). See docs/security.md.",
    )
    p.add_argument("name", metavar="NAME", help="the key's name, such as broker, learner, actor-gpu0 or client-42")
    p.add_argument("--dir", default=".", type=local_path, help="directory for the two files (created if missing; default: .)")
    p.add_argument(
        "--force", action="store_true", help="replace existing files of that name (peers holding the old public key are then refused)"
    )
    p.set_defaults(func=cmd_keygen)
    return parser


def _config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", type=local_path, help="TOML config file; flags given on the command line override it")


def _on_stop(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask the process to finish its turn and exit."""

    def handler(signum: int, frame: Any) -> None:
        log.info("%s received, stopping", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from models.tiny_models import build_tiny_model

    if args.hidden < 8 or args.hidden % 4 or args.layers < 1:
        print(f"ppoz tiny-model: --hidden must be a multiple of 4 from 8 (got {args.hidden}), --layers at least 1", file=sys.stderr)
        return 2
    path = build_tiny_model(args.dir, args.arch, seed=args.seed, tokenizer=args.tokenizer, hidden=args.hidden, layers=args.layers)
    print(f'{path}: a tiny {args.arch} model with random weights; use it with [policy] model = "{path}" (or --model {path})')
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from broker.config import BrokerConfig
    from broker.server import Broker
    from common.redis_server import check_server, connect, redis_url_or_embedded

    cfg = load(BrokerConfig, args.config, args)
    url, embedded = redis_url_or_embedded(cfg.store.redis_url)
    try:
        # Few retries: a Redis call must not stall the broker's loop (and its heartbeats)
        # for long; the broker handles a failed write itself (docs/protocol.md, section 5).
        client = connect(url, socket_timeout=2.0, retries=1)
        check_server(client)
        broker = Broker(cfg, client)
        _on_stop(broker.stop)
        broker.start()
        broker.run()
        log.info("broker stopped: %s", json.dumps(dict(broker.metrics), sort_keys=True))
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def cmd_actor(args: argparse.Namespace) -> int:
    from actor_node.config import ActorConfig
    from actor_node.main import run_actor

    cfg = load(ActorConfig, args.config, args)
    stop = threading.Event()
    _on_stop(stop.set)
    code = run_actor(cfg, stop)
    # The process ends here: leave torch's objects to the OS rather than to the interpreter's last collection
    # (0.3 s idle, 1-2 s on a loaded 2-core machine), so that SIGTERM ends an actor within 2 s (issue 41).
    import gc

    gc.freeze()
    return code


def cmd_learner(args: argparse.Namespace) -> int:
    from common.processes import EXIT_STOPPED_ON_INPUT, exit_now
    from common.redis_server import check_server, connect
    from learner_node.config import LearnerConfig
    from learner_node.worker import Learner, PoisonedInput

    cfg = load(LearnerConfig, args.config, args)
    # The blocking stream read needs a socket timeout above its block time.
    client = connect(cfg.store.redis_url, socket_timeout=cfg.read_block_ms / 1000 + 10)
    check_server(client)
    learner = Learner(cfg, client)
    _on_stop(learner.stop)
    try:
        learner.run()
    except PoisonedInput as e:  # its batches are acknowledged as dropped and its checkpoint holds the last good weights
        log.error("learner stopped: %s", e)
        learner.close()
        return EXIT_STOPPED_ON_INPUT
    log.info("learner stopped after %d updates at policy version %d: %s", learner.updates, learner.version, dict(learner.counters))
    if learner.world > 1:
        exit_now(0)  # a rank's process group is gone (close): nothing is left for the interpreter's exit but torch's aborts
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    cfg = load(GatewayConfig, args.config, args)
    gateway = Gateway(cfg)
    try:
        gateway.start()
    except OSError as e:
        print(f"ppoz gateway: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    _on_stop(gateway.stop)
    gateway.serve()
    log.info("gateway stopped: %s", json.dumps(gateway.counters, sort_keys=True))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ppoz.status import main as status

    return status(args)


def cmd_keygen(args: argparse.Namespace) -> int:
    from common.security import generate_keypair, load_public

    try:
        public, secret = generate_keypair(args.dir, args.name, force=args.force)
    except (OSError, ValueError) as e:  # FileExistsError included: an existing key is never replaced silently
        print(f"ppoz keygen: {e}", file=sys.stderr)
        return 1
    print(f"public key file: {public}  (copy it to the peers that must accept {args.name}: an allow-list directory, or a *_key setting)")
    print(f"secret key file: {secret}  (mode 0600; keep it on this machine)")
    print(f"public key: {load_public(public).decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
