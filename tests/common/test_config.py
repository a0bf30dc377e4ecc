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
    assert cfg.redis_url == "redis://127.0.0.1:7777/0"  # top-level key applies to every component that has it
    assert cfg.heartbeat_ms == BrokerConfig().heartbeat_ms


def test_flags_alone_and_bool_flags():
    cfg = load(BrokerConfig, None, parse(["--max-actions", "3"]))
    assert cfg.max_actions == 3


@pytest.mark.parametrize(
    "text, words",
    [
        ("[broker]\nsegment_len = 0\n", "`segment_len` must be positive, got 0"),
        ("[broker]\nsegmnt_len = 4\n", "unknown key [broker] 'segmnt_len' = 4"),
        ("[broker]\nsegment_len = \"four\"\n", "[broker] segment_len = 'four': expected a int, got a str"),
        ("[brokr]\nsegment_len = 4\n", "unknown table [brokr]"),
        ("segmnt_len = 4\n", "unknown top-level key 'segmnt_len' = 4"),
        ("[broker]\nfrontend = \"localhost\"\n", "`frontend` must be a ZeroMQ endpoint"),
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
