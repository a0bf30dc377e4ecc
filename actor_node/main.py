"""The actor process, wired in one function: policy, weights, broker link, then the serve loop.

    run_actor(cfg, stop)
      policy    = LLMPolicy(load_policy(ModelSpec.of(cfg.policy, cfg.device)))  or UniformPolicy without a model
      retriever = Retriever(cfg.retrieval, ...)                                  rag_step context (cfg.rag)
      follower  = WeightFollower(Redis snapshots + the learner's PUB)            with a model and a Redis URL
      catch_up(policy, follower)                                                  a late joiner never serves stale weights
      link      = BrokerLink(cfg.broker)                                          DEALER to the broker's backend
      serve(link, policy, stop, ...)                                              jobs -> results; weights between batches

`ppoz actor` (ppoz/cli.py) calls it with a stop event its signal handlers set;
the demo and the tests call it on a thread.
"""

from __future__ import annotations

import logging
import threading

from actor_node.config import ActorConfig
from actor_node.link import BrokerLink
from actor_node.policies import Policy, UniformPolicy
from actor_node.weight_follower import WeightFollower, host_cache_dir
from actor_node.worker import catch_up, serve
from common.sd_notify import Notifier
from common.security import client_keys

log = logging.getLogger(__name__)


def run_actor(cfg: ActorConfig, stop: threading.Event) -> int:
    """Load the policy, catch up with the newest weights, then serve the broker until `stop` is set; the exit code."""
    follower: WeightFollower | None = None
    retriever = None
    policy: Policy
    if cfg.policy.model:
        from actor_node.llm_policy import LLMPolicy, SamplingConfig  # torch: only for a model
        from models.policy_model import ModelSpec, load_policy

        model, tokenizer = load_policy(ModelSpec.of(cfg.policy, cfg.device))
        sampling = SamplingConfig(
            normalisation=cfg.policy.normalisation,
            temperature=cfg.policy.temperature,
            greedy=cfg.greedy,
            max_batch_tokens=cfg.max_batch_tokens,
            seed=cfg.seed,
            max_generate_rows=cfg.max_generate_rows,
            max_generate_positions=cfg.max_generate_positions,
            prefill_tokens=cfg.prefill_tokens,
            fold_lora=cfg.fold_lora,
            capture_decode=cfg.capture_decode,
            stage_weights=cfg.stage_weights,
        )
        policy = LLMPolicy(model, tokenizer, sampling, cfg.policy.scoring_path, cfg.prefix_cache_mb)
        if cfg.rag:
            from actor_node.rag import Retriever

            retriever = Retriever(cfg.retrieval, model, tokenizer, str(next(model.parameters()).device))
        if cfg.store.redis_url:
            from common.redis_server import connect

            follower = WeightFollower(
                connect(cfg.store.redis_url),
                cfg.store.key_prefix,
                cfg.weights,
                poll_s=cfg.weights_poll_s,
                curve=client_keys(cfg.curve_secret_key, cfg.curve_learner_key, ("curve_secret_key", "curve_learner_key")),
                weights_dir=cfg.store.weights_dir,
                source=cfg.weights_source,
                cache_dir=host_cache_dir(cfg.weights_cache, cfg.store, cfg.weights_source),
            )
            catch_up(policy, follower, wait=True)
    else:
        log.warning("no --model given: serving the uniform random policy")
        policy = UniformPolicy(cfg.seed)
    link = BrokerLink(
        cfg.broker,
        cfg.name,
        cfg.credits,
        cfg.heartbeat_ms,
        cfg.heartbeat_liveness,
        curve=client_keys(cfg.curve_secret_key, cfg.curve_broker_key, ("curve_secret_key", "curve_broker_key")),
        progress=lambda: policy.progress,
    )
    link.policy_version = policy.policy_version
    link.start()
    serving = cfg.policy.model or "the uniform policy"
    log.info("actor %s serving %s (policy version %d) for %s", link.name, serving, policy.policy_version, cfg.broker)
    notifier = Notifier()  # ready: the model is loaded and the newest weights are in place
    notifier.ready(f"serving {serving} at policy version {policy.policy_version}")

    def tick(served: int) -> None:
        notifier.watchdog()
        notifier.status(f"policy version {policy.policy_version}, {served} requests served")

    served = serve(link, policy, stop, cfg.max_batch, follower, tick, retriever)
    notifier.stopping(f"stopped after {served} requests; unscored jobs handed back to the broker")
    link.close()
    if follower is not None:
        follower.close()
    summary = "; ".join(s for s in (policy.stats(), f"retrieval {retriever.stats()}" if retriever else "") if s)
    log.info("actor %s stopped after %d requests%s", link.name, served, f"; {summary}" if summary else "")
    return 0
