"""The protocol module: encoding, header checks and request validation."""

import math

import msgpack
import pytest

from common import protocol as p


def test_encode_decode_round_trip_keeps_str_and_bin_apart():
    body = {"proto": "ppoz", "v": 1, "op": "step", "rid": b"\x00\x01", "obs": {"prompt": "é", "action": ["a"]}}
    assert p.decode(p.encode(body)) == body
    assert isinstance(p.decode(p.encode(body))["rid"], bytes)


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x92\x01", p.encode({"a": 1})[:-1], b"\x81\xa1a\xc5\xff\xff"])
def test_decode_refuses_truncated_or_invalid_bytes(frame):
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frame)
    assert e.value.code == p.E_BAD_REQUEST


def test_decode_refuses_non_map_and_invalid_utf8():
    with pytest.raises(p.ProtocolError, match="must be a msgpack map"):
        p.decode(msgpack.packb([1, 2]))
    with pytest.raises(p.ProtocolError, match="not valid msgpack"):
        p.decode(b"\x81\xa1a\xa2\xff\xfe")  # {"a": <invalid utf-8 str>}


@pytest.mark.parametrize(
    "value",
    [
        msgpack.Timestamp(1_700_000_000, 0),  # timestamp 32: fixext 4, type -1
        msgpack.Timestamp(1_700_000_000, 5),  # timestamp 64
        msgpack.Timestamp(2**40, 5),  # timestamp 96: ext 8
        msgpack.ExtType(5, b"abc"),
        msgpack.ExtType(5, b""),  # no data: not caught by max_ext_len, by the hook
    ],
    ids=["ts32", "ts64", "ts96", "ext5", "ext5-empty"],
)
def test_decode_refuses_extension_types_even_in_fields_it_ignores(value):
    """docs/protocol.md, section 2: no extension types. They were decoded (a Timestamp, an ExtType) and, in a field
    the broker ignores, accepted. The rid can still be read, so the reply names it."""
    body = msgpack.packb({"proto": "ppoz", "v": 1, "op": "ping", "rid": "p2", "sent": value}, use_bin_type=True)
    with pytest.raises(p.ProtocolError, match="extension type") as e:
        p.decode(body)
    assert e.value.code == p.E_BAD_REQUEST
    assert p.read_header(body) == {"op": "ping", "rid": "p2"}
    with pytest.raises(p.ProtocolError, match="not valid msgpack"):  # another fault as well: msgpack's own words
        p.decode(body.replace(b"\xa2p2", b"\xa2\xff\xfe"))


def test_decode_refuses_deep_nesting():
    deep = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(p.ProtocolError):
        p.decode(b"\x81\xa1a" + deep)


@pytest.mark.parametrize(
    "body, code, words",
    [
        ({"proto": "ppoz", "v": 2, "op": "ask", "rid": "r"}, p.E_UNSUPPORTED_VERSION, "v=2"),
        ({"proto": "PPO", "v": 1, "op": "ask", "rid": "r"}, p.E_UNSUPPORTED_VERSION, "proto='PPO'"),
        ({"proto": "ppoz", "v": True, "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "v of type bool"),
        ({"proto": "ppoz", "v": "1", "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "v of type str"),
        ({"proto": "ppoz", "v": 1.0, "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "v of type float"),
        ({"proto": b"ppoz", "v": 1, "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "proto of type bytes"),
        ({"v": 1, "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "proto of type NoneType"),
        ({"proto": "ppoz", "op": "ask", "rid": "r"}, p.E_BAD_REQUEST, "v of type NoneType"),
        ({"proto": "ppoz", "v": 1, "op": "ask"}, p.E_BAD_REQUEST, "`rid`"),
        ({"proto": "ppoz", "v": 1, "op": "ask", "rid": "x" * 65}, p.E_BAD_REQUEST, "longer than 64"),
        ({"proto": "ppoz", "v": 1, "op": 3, "rid": "r"}, p.E_BAD_REQUEST, "`op` must be a str"),
    ],
)
def test_check_header_names_the_problem(body, code, words):
    with pytest.raises(p.ProtocolError) as e:
        p.check_header(body)
    assert e.value.code == code
    assert words in e.value.message


def test_check_obs_accepts_the_kea_shape_and_drops_unknown_keys():
    obs = p.check_obs({"obs": {"prompt": "p", "question": "q", "action": ["a", "b"], "extra": 1}}, p.Limits())
    assert obs == {"prompt": "p", "question": "q", "action": ["a", "b"]}
    assert p.check_obs({"obs": {"prompt": "p", "action": ["a"]}}, p.Limits())["question"] == ""
    # empty text is accepted where it can be scored: prompt and question, and a candidate of white space only
    assert p.check_obs({"obs": {"prompt": "", "question": "", "action": [" "]}}, p.Limits())["action"] == [" "]


@pytest.mark.parametrize(
    "obs, code, words",
    [
        ({"prompt": "p", "action": []}, p.E_BAD_REQUEST, "is empty"),
        ({"prompt": "p"}, p.E_BAD_REQUEST, "`action` is missing"),
        ({"prompt": 5, "action": ["a"]}, p.E_BAD_REQUEST, "`prompt` must be a str"),
        ({"prompt": "p", "action": ["a", 7]}, p.E_BAD_REQUEST, "`obs.action[1]` must be a str, got int"),
        ({"prompt": "p", "action": ["a", ""]}, p.E_BAD_REQUEST, "`obs.action[1]` is empty"),
        ({"prompt": "p", "action": ["a"] * 5}, p.E_TOO_LARGE, "5 candidates, the limit is 4"),
        ({"prompt": "p" * 100, "action": ["a"]}, p.E_TOO_LARGE, "the limit is 50"),
        ({"prompt": "p", "action": ["a" * 11]}, p.E_TOO_LARGE, "11 characters, the limit is 10"),
    ],
)
def test_check_obs_errors_name_the_field(obs, code, words):
    limits = p.Limits(max_actions=4, max_action_chars=10, max_prompt_chars=50)
    with pytest.raises(p.ProtocolError) as e:
        p.check_obs({"obs": obs}, limits)
    assert e.value.code == code
    assert words in e.value.message


def test_check_reward_refuses_bool_nan_and_strings():
    assert p.check_reward({"reward": 1}) == 1.0
    for bad in (True, math.nan, math.inf, "1"):
        with pytest.raises(p.ProtocolError, match="reward"):
            p.check_reward({"reward": bad})


def test_task_id_pattern():
    assert p.check_task_id({"task_id": "emu-3:5554"}) == "emu-3:5554"
    for bad in ("", "a b", "x" * 129, "é"):
        with pytest.raises(p.ProtocolError, match="task_id"):
            p.check_task_id({"task_id": bad})


def test_an_integral_reward_is_read_as_a_float():
    reward = p.check_reward({"reward": 1})
    assert reward == 1.0 and isinstance(reward, float)


@pytest.mark.parametrize(
    "rid, readable, words",
    [
        ("r", True, ""),
        (b"\x00" * 64, True, ""),
        ("é" * 32, True, ""),
        ("x" * 65, False, "longer than 64 bytes (65)"),
        ("é" * 33, False, "longer than 64 bytes (66)"),
        ("", False, "got an empty str"),
        (b"", False, "got an empty bin"),
        (None, False, "got nil"),
        (7, False, "got int"),
        (True, False, "got bool"),
        ("\ud800", False, "not valid UTF-8"),
    ],
)
def test_a_rid_is_a_str_or_bin_of_1_to_64_bytes_counted_in_utf8(rid, readable, words):
    assert p.readable_rid(rid) is readable
    if readable:
        assert p.check_rid(rid) == rid
    else:
        with pytest.raises(p.ProtocolError) as e:
            p.check_rid(rid)
        assert e.value.code == p.E_BAD_REQUEST and words in e.value.message


def test_read_header_finds_rid_and_op_in_a_body_decode_refuses():
    bad_utf8 = p.encode({"proto": "ppoz", "v": 1, "op": "step", "obs": {"prompt": "XXXX"}, "rid": "r1"}).replace(
        b"XXXX", b"\xff\xfe\xfd\xfc"
    )
    with pytest.raises(p.ProtocolError):
        p.decode(bad_utf8)
    assert p.read_header(bad_utf8) == {"op": "step", "rid": "r1"}
    assert p.read_header(p.encode({1: "int key", "rid": b"bin", "op": "ask"})) == {"rid": b"bin", "op": "ask"}
    huge = p.encode({"op": "ping", "pad": "z" * 100_000, "rid": "after-the-pad"})
    assert p.read_header(huge) == {"op": "ping", "rid": "after-the-pad"}


@pytest.mark.parametrize(
    "frame, found",
    [
        (b"", {}),
        (b"\xc1", {}),
        (msgpack.packb([1, 2]), {}),
        (p.encode({"op": "ask", "rid": "x" * 65}), {"op": "ask"}),  # an unreadable rid is left out, not cut
        (p.encode({"op": 3, "rid": "r"}), {"rid": "r"}),  # an op that is not a str is left out
        (p.encode({"op": "ask", "rid": "abc"})[:-1], {"op": "ask"}),  # cut short inside the rid
        (b"\x82\xa3obs" + b"\x91" * 100_000 + b"\xc0" + p.encode("rid") + p.encode("r"), {}),  # nested too deep before the rid
        (b"\x83" + p.encode("rid") + p.encode("r") + b"\xa2\xff\xfe" + b"\x01" + p.encode("op") + p.encode("ask"), {"rid": "r"}),
    ],
    ids=["empty", "not-msgpack", "array", "long-rid", "int-op", "truncated", "deep", "bad-key"],  # bad-key: the walk stops there
)
def test_read_header_gives_only_what_it_can_read(frame, found):
    assert p.read_header(frame) == found
