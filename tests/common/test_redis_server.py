"""The embedded redis-server: starts privately, has the stream commands PPOZ needs, stops clean."""

from common.redis_server import EmbeddedRedis, check_server, connect, find_redis_server


def test_embedded_server_runs_streams_and_cleans_up():
    server = EmbeddedRedis().start()
    data_dir = server.dir
    try:
        assert server.url.startswith("unix://") and data_dir.exists()
        client = connect(server.url)
        check_server(client)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.xgroup_create("s", "g", id="0", mkstream=True)
        client.xadd("s", {"k": "v"})
        client.xreadgroup("g", "c1", {"s": ">"}, count=1)
        claimed = client.xautoclaim("s", "g", "c2", min_idle_time=0)
        assert len(claimed[1]) == 1  # XAUTOCLAIM takes over the pending entry
        client.close()
    finally:
        server.stop()
    assert server.process is None and not data_dir.exists()


def test_a_redis_server_binary_is_found():
    assert find_redis_server().endswith("redis-server")


def test_keeps_data_in_a_given_directory_across_restarts(tmp_path):
    with EmbeddedRedis(appendonly=True, data_dir=tmp_path) as server:
        connect(server.url).rpush("k", "a", "b")
    with EmbeddedRedis(appendonly=True, data_dir=tmp_path) as server:
        assert connect(server.url).lrange("k", 0, -1) == [b"a", b"b"]
