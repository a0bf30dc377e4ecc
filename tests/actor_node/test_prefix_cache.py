"""The prefix cache as a data structure: longest prefix, one entry per task, LRU under a budget."""

import torch

from actor_node.prefix_cache import PrefixCache


def kv(n: int, layers: int = 2):
    return [(torch.full((1, 1, n, 4), float(i)), torch.full((1, 1, n, 4), float(i))) for i in range(layers)]


def nbytes(n: int) -> int:
    return 2 * 2 * n * 4 * 4  # layers * (k, v) * n * head_dim * float32


def test_longest_common_prefix_wins_and_last_token_is_left_to_compute():
    cache = PrefixCache(budget_mb=1, min_prefix=2)
    cache.insert("a", [1, 2, 3, 4, 5], kv(5))
    cache.insert("b", [1, 2, 9, 9], kv(4))
    got, m = cache.lookup([1, 2, 3, 4, 7, 8])
    assert m == 4 and got[0][0].shape[2] == 4
    _, m = cache.lookup([1, 2, 3, 4, 5])  # identical context: the last token is still computed
    assert m == 4
    assert cache.lookup([7, 7, 7]) is None
    assert cache.lookup([1, 5, 5]) is None  # 1 shared token is below min_prefix
    assert cache.hits == 2 and cache.misses == 2 and cache.reused_tokens == 8


def test_one_entry_per_task_and_lru_eviction_under_budget():
    cache = PrefixCache(budget_mb=3 * nbytes(10) / 2**20, min_prefix=1)
    cache.insert("a", list(range(10)), kv(10))
    cache.insert("a", list(range(10)), kv(10))  # replaces, does not add
    assert len(cache.entries) == 1 and cache.nbytes == nbytes(10)
    cache.insert("b", [50] * 10, kv(10))
    cache.insert("c", [60] * 10, kv(10))
    cache.lookup([0, 1, 2, 3])  # touches "a"
    cache.insert("d", [70] * 10, kv(10))  # evicts the least recently used: "b"
    assert list(cache.entries) == ["c", "a", "d"] and cache.nbytes <= cache.budget
    cache.clear()
    assert not cache.entries and cache.nbytes == 0 and cache.lookup([0, 1, 2]) is None


def test_zero_budget_disables():
    cache = PrefixCache(budget_mb=0)
    cache.insert("a", [1, 2, 3], kv(3))
    assert not cache.enabled and cache.lookup([1, 2, 3, 4]) is None
