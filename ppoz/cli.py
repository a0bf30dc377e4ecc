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
from ppoz.flags import add_broker_flag, add_json_flag, add_seed_flag

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

    _process_command(
        sub,
        "broker",
        BrokerConfig,
        cmd_broker,
        help="run the broker: client sessions, routing to actors, segments to Redis",
        description="Run the broker. Clients connect to --frontend, actors to --backend.",
    )

    _process_command(
        sub,
        "actor",
        ActorConfig,
        cmd_actor,
        help="run an actor: score candidate actions and answer the broker",
        description="Run an actor process that connects to the broker's back end.",
    )

    from learner_node.config import LearnerConfig

    _process_command(
        sub,
        "learner",
        LearnerConfig,
        cmd_learner,
        help="run the PPO learner on the Redis segment stream",
        description="Train the policy with PPO on the segments the broker writes to Redis; publish each new version.",
    )

    from gateway.config import GatewayConfig

    _process_command(
        sub,
        "gateway",
        GatewayConfig,
        cmd_gateway,
        help="serve the PPOAPI HTTP API and forward it to the broker (unmodified Kea builds)",
        description="Serve PPOAPI's HTTP API (POST /attach, /ask, /step, /rag_step, /feedback, /detach) and "
        "forward each request to the broker over the PPOZ protocol, so an unmodified Kea build works "
        "by pointing its base URL here. See docs/client.md.",
    )

    from ppoz import demo

    _module_command(
        sub,
        "demo",
        demo,
        help="watch an LLM policy learn on this machine (no GPU needed)",
        description="Run broker, actor, learner and simulated clients on a tiny local model and watch it learn.",
    )

    from ppoz import up
    from ppoz.up import UpConfig

    _process_command(
        sub,
        "up",
        UpConfig,
        up.main,
        help="start and supervise a whole stack on this machine",
        description="Start and supervise Redis (embedded unless a URL is given), the broker, N actors, the learner "
        "and optionally environment clients, each as its own process with its log lines prefixed by "
        "its name. The config file's [broker], [actor] and [learner] tables configure the components; "
        "[up] says what runs here. Ctrl-C or SIGTERM stops everything. See docs/farm.md.",
    )

    from ppoz import train as train_command

    _module_command(
        sub,
        "train",
        train_command,
        help="PPO on a prompt dataset with a reward function, reward model or LLM judge (docs/train.md)",
        description="Generation-mode PPO on a dataset of prompts: starts a stack here (as `ppoz up`) or, with "
        "--broker, drives a farm; validates before and after, shows progress, writes the run's figures "
        "under [train] output_dir. See docs/train.md.",
    )

    from ppoz import reward_server

    _module_command(
        sub,
        "reward-server",
        reward_server,
        help="serve a reward model and/or LLM judge to every driver of a farm (docs/train.md)",
        description="Load the [reward_service] table's reward model and/or judge once and serve rm_score and judge "
        "requests over ZeroMQ to every `ppoz train` driver whose [train] reward_service points here. See docs/train.md.",
    )

    from ppoz import export

    _module_command(
        sub,
        "export",
        export,
        help="a checkpoint as a Hugging Face model folder (adapter merged) that from_pretrained and serving engines load",
        description="Write a learner checkpoint (LoRA adapter, all weights or sharded; or the newest in a folder of them) "
        "as a model folder: config, merged safetensors weights, tokenizer, generation config. See docs/train.md.",
    )

    from ppoz import play

    _module_command(
        sub,
        "play",
        play,
        help="run environment clients (Kea-like simulator, gymnasium games) against a broker",
        description="Play N environment clients in parallel against a broker and report episodes, returns and steps per second.",
    )

    p = sub.add_parser(
        "bench",
        help="run a benchmark (see docs/benchmarks.md)",
        description="Benchmarks; each prints a table, or one JSON object with --json.",
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="NAME", parser_class=_BenchParser)
    from tools.bench import BENCHES

    for bench in BENCHES:
        benches.add_parser(bench.name, help=bench.help, description=bench.description, module=bench.module)

    p = sub.add_parser(
        "status", help="show a running broker's sessions, actors and counters", description="Ask a running broker for its figures."
    )
    add_broker_flag(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default: 5)")
    add_json_flag(p, "print the raw figures as JSON")
    key_files = (
        ("--curve-server-key", "CURVE: the broker's public key file (NAME.key), for a broker with CURVE on"),
        ("--curve-secret-key", "CURVE: this client's key pair file (NAME.key_secret), allowed by the broker"),
    )
    for flag, key_help in key_files:
        p.add_argument(flag, default="", type=local_path, metavar="FILE", help=key_help)
    p.set_defaults(func=cmd_status)

    from tools.reliability import fuzz, soak

    _module_command(
        sub,
        "fuzz",
        fuzz,
        help="send adversarial messages to a running broker (and gateway) and check every answer",
        description="Fuzz a running broker's front end (and a gateway): random bytes, truncated msgpack, wrong "
        "types, huge strings and arrays, deep nesting, invalid UTF-8, floods; every well-framed "
        "request must get an error reply, memory must stay bounded, a well-behaved client "
        "alongside must see no error (docs/reliability.md).",
    )

    _module_command(
        sub,
        "soak",
        soak,
        help="many simulated emulators against a full stack of processes, for minutes",
        description="Start Redis, a broker, an LLM actor and the learner as processes, drive N emulators for "
        "a while, and report errors, step latency and memory per window and the ledger "
        "(docs/reliability.md).",
    )

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
    add_seed_flag(p, "seed of the random weights (default: 0)")
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


def _process_command(sub: Any, name: str, config_class: type, func: Callable[[argparse.Namespace], int], **texts: str) -> None:
    """A process's subcommand: `--config FILE` and one flag per field of its config (`texts`: help, description)."""
    p = sub.add_parser(name, **texts)
    _config_option(p)
    add_flags(p, config_class)
    p.set_defaults(func=func)


def _module_command(sub: Any, name: str, module: Any, **texts: str) -> None:
    """A subcommand whose module holds its options (`add_arguments(parser)`) and its run (`main(args)`)."""
    p = sub.add_parser(name, **texts)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


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
