"""Typed configuration: defaults < TOML file < flags, and errors that name the key and value."""

import argparse

import pytest

from broker.config import BrokerConfig
from common.config import ConfigError, add_flags, load


def parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, BrokerConfig)
    return parser.parse_args(argv)


def test_defaults_file_then_flags(tmp_path):
    path = tmp_path / "ppoz.toml"
    path.write_text('redis_url = "redis://127.0.0.1:7777/0"\n[broker]\nsegment_len = 8\nsession_ttl_s = 30\n')
    cfg = load(BrokerConfig, path, parse(["--segment-len", "16"]))
    assert cfg.segment_len == 16  # the flag wins over the file
    assert cfg.session_ttl_s == 30.0  # int in TOML accepted for a float
    assert cfg.store.redis_url == "redis://127.0.0.1:7777/0"  # top-level key applies to every component that has it, shared tables too
    assert cfg.heartbeat_ms == BrokerConfig().heartbeat_ms


def test_flags_alone_and_bool_flags():
    cfg = load(BrokerConfig, None, parse(["--max-actions", "3"]))
    assert cfg.max_actions == 3


@pytest.mark.parametrize(
    "text, words",
    [
        ("[broker]\nsegment_len = 0\n", "`segment_len` must be positive, got 0"),
        ("[broker]\nsegmnt_len = 4\n", "unknown key [broker] 'segmnt_len' = 4"),
        ('[broker]\nsegment_len = "four"\n', "[broker] segment_len = 'four': expected a int, got a str"),
        ("[brokr]\nsegment_len = 4\n", "unknown table [brokr]"),
        ("segmnt_len = 4\n", "unknown top-level key 'segmnt_len' = 4"),
        ('[broker]\nfrontend = "localhost"\n', "`frontend` must be a ZeroMQ endpoint"),
        ("[broker\n", "is not valid TOML"),
    ],
)
def test_invalid_config_names_key_and_value(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(BrokerConfig, path, parse([]))
    assert words in str(e.value)


def test_invalid_flag_value_names_it():
    with pytest.raises(ConfigError, match="`heartbeat_liveness` must be at least 2, got 1"):
        load(BrokerConfig, None, parse(["--heartbeat-liveness", "1"]))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.toml"):
        load(BrokerConfig, tmp_path / "nope.toml", parse([]))


# --- shared tables: [policy] for actor and learner, [retrieval] for broker and actor, [store] for all -----


def test_one_policy_table_configures_actor_and_learner_alike(tmp_path):
    from actor_node.config import ActorConfig
    from learner_node.config import LearnerConfig

    path = tmp_path / "farm.toml"
    path.write_text(
        'redis_url = "redis://r:6379/0"\n[policy]\nmodel = "m"\nlora_rank = 4\nnormalisation = "token"\n'
        '[actor]\ndevice = "cuda:1"\n[learner]\ndevice = "cuda:0"\n'
    )
    actor, learner = load(ActorConfig, path), load(LearnerConfig, path)
    assert actor.policy == learner.policy and (actor.policy.model, actor.policy.lora_rank) == ("m", 4)
    assert (actor.device, learner.device) == ("cuda:1", "cuda:0")  # the device is each process's own


def test_policy_flags_keep_their_names_and_override_the_table(tmp_path):
    from actor_node.config import ActorConfig

    parser = argparse.ArgumentParser()
    add_flags(parser, ActorConfig)
    path = tmp_path / "a.toml"
    path.write_text('[policy]\nmodel = "m"\ntemperature = 2.0\n[retrieval]\ntop_k = 2\n')
    cfg = load(ActorConfig, path, parser.parse_args(["--temperature", "0.5", "--rag-top-k", "3", "--lora-rank", "0"]))
    assert (cfg.policy.model, cfg.policy.temperature, cfg.policy.lora_rank, cfg.retrieval.top_k) == ("m", 0.5, 0, 3)


def test_the_broker_keeps_the_history_the_actor_expects(tmp_path):
    from actor_node.config import ActorConfig

    path = tmp_path / "r.toml"
    path.write_text("[retrieval]\nhistory_len = 3\nquery_chars = 500\n")
    broker, actor = load(BrokerConfig, path), load(ActorConfig, path)
    assert (broker.rag_history_len, broker.rag_history_chars) == (actor.retrieval.history_len, actor.retrieval.query_chars) == (3, 500)


STORE_TOML = '[store]\nredis_url = "redis://db:6379/2"\nkey_prefix = "shop"\nstream_key = "segs"\nconsumer_group = "trainers"\n'


def test_one_store_table_configures_broker_actor_learner_and_up_alike(tmp_path):
    from actor_node.config import ActorConfig
    from learner_node.config import LearnerConfig
    from ppoz.up import UpConfig

    path = tmp_path / "farm.toml"
    path.write_text(STORE_TOML + '[policy]\nmodel = "m"\n')
    configs = [load(cls, path) for cls in (BrokerConfig, ActorConfig, LearnerConfig, UpConfig)]
    stores = {(c.store.redis_url, c.store.key_prefix, c.store.stream_key, c.store.consumer_group) for c in configs}
    assert stores == {("redis://db:6379/2", "shop", "segs", "trainers")}
    # the keys written by the broker are the ones the learner reads
    assert configs[0].store.keys.stream == configs[2].store.keys.stream == "shop:segs"


def test_store_flags_keep_their_names_and_override_the_table(tmp_path):
    from actor_node.config import ActorConfig
    from learner_node.config import LearnerConfig
    from ppoz.cli import build_parser
    from ppoz.up import UpConfig

    path = tmp_path / "farm.toml"
    path.write_text(STORE_TOML + '[policy]\nmodel = "m"\n')
    for command, cls in (("broker", BrokerConfig), ("actor", ActorConfig), ("learner", LearnerConfig), ("up", UpConfig)):
        args = build_parser().parse_args([command, "--config", str(path), "--key-prefix", "other", "--redis-url", "unix:///r.sock"])
        store = load(cls, args.config, args).store
        assert (store.redis_url, store.key_prefix, store.stream_key) == ("unix:///r.sock", "other", "segs"), command


def test_an_empty_redis_url_means_what_each_process_makes_of_it():
    from actor_node.config import ActorConfig
    from learner_node.config import LearnerConfig

    assert BrokerConfig().store.redis_url == ""  # the broker starts an embedded redis-server
    assert ActorConfig().store.redis_url == ""  # the actor follows no weights
    with pytest.raises(ConfigError, match="`redis_url` is required: the Redis the broker writes segments to"):
        load(LearnerConfig, None, {"policy.model": "m"})


@pytest.mark.parametrize(
    "component, text, words",
    [
        ("actor", '[actor]\nmodel = "m"\n', "[actor] model has moved: write it as `model = 'm'` in the [policy] table"),
        ("learner", "[learner]\nlora_rank = 4\n", "[learner] lora_rank has moved: write it as `lora_rank = 4` in the [policy] table"),
        ("actor", "[actor]\nrag_top_k = 2\n", "[actor] rag_top_k has moved: write it as `top_k = 2` in the [retrieval] table"),
        (
            "broker",
            "[broker]\nrag_history_len = 4\n",
            "[broker] rag_history_len has moved: write it as `history_len = 4` in the [retrieval] table",
        ),
        (
            "broker",
            "[broker]\nrag_history_chars = 9\n",
            "[broker] rag_history_chars has moved: write it as `query_chars = 9` in the [retrieval] table",
        ),
        (
            "broker",
            '[broker]\nredis_url = "redis://b:6379/0"\n',
            "[broker] redis_url has moved: write it as `redis_url = 'redis://b:6379/0'` in the [store] table",
        ),
        ("actor", '[actor]\nkey_prefix = "farm"\n', "[actor] key_prefix has moved: write it as `key_prefix = 'farm'` in the [store] table"),
        ("learner", '[learner]\nstream_key = "s"\n', "[learner] stream_key has moved: write it as `stream_key = 's'` in the [store] table"),
        (
            "broker",
            '[broker]\nconsumer_group = "g"\n',
            "[broker] consumer_group has moved: write it as `consumer_group = 'g'` in the [store] table",
        ),
        (
            "up",
            '[up]\nredis_url = "redis://u:6379/0"\n',
            "[up] redis_url has moved: write it as `redis_url = 'redis://u:6379/0'` in the [store] table",
        ),
        ("actor", '[store]\nkey_prefix = "two words"\n', "`key_prefix` must be a non-empty word, got 'two words'"),
        ("actor", "[policy]\nlora_rnk = 4\n", "unknown key [policy] 'lora_rnk'"),
        ("actor", '[policy]\nnormalisation = "tokens"\n', "`normalisation` must be one of token, word, sum"),
    ],
)
def test_old_keys_say_where_they_moved(tmp_path, component, text, words):
    from actor_node.config import ActorConfig
    from learner_node.config import LearnerConfig
    from ppoz.up import UpConfig

    cls = {"actor": ActorConfig, "learner": LearnerConfig, "broker": BrokerConfig, "up": UpConfig}[component]
    path = tmp_path / "old.toml"
    path.write_text('redis_url = "redis://r:6379/0"\nmodel = "m"\n' + text)
    with pytest.raises(ConfigError) as e:
        load(cls, path)
    assert words in str(e.value)
