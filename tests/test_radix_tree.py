"""spec/radix.py by hand: the release's keys, splits, duplicates, locks and LRU eviction on
small trees whose every number is worked out here (docs/upstream-radix-sharing.md sections
1.1-1.5). ``tests/test_radix_upstream.py`` drives the same tree against the release's."""

from __future__ import annotations

import pytest

from overlap_spec.spec.radix import RadixTree
from overlap_spec.spec.units import PageId


def _pages(*ids: int) -> list[PageId]:
    return [PageId(i) for i in ids]


def test_keys_are_whole_pages_bigrams_under_eagle() -> None:
    tokens = list(range(10, 20))  # 10 tokens
    assert len(RadixTree(4, is_eagle=False).make_key(tokens)) == 8
    eagle = RadixTree(4, is_eagle=True).make_key(tokens)
    assert len(eagle) == 8 and eagle[0] == (10, 11)  # 9 bigrams, cut to 8
    assert len(RadixTree(4, is_eagle=True).make_key(tokens[:5])) == 4  # floor4(5 - 1)
    assert RadixTree(1, is_eagle=True).make_key([7]) == ()


def test_an_insert_over_a_held_key_frees_the_inserters_duplicates_from_its_protected_len(
) -> None:
    tree = RadixTree(2, is_eagle=False)
    key = tree.make_key([1, 2, 3, 4, 5, 6])
    held, node, duplicates = tree.insert(key, _pages(10, 11, 12), prev_prefix_len=0)
    assert (held, duplicates, tree.evictable_size) == (0, [], 6)
    # A second request with the same prompt: all of its pages are duplicates...
    held, again, duplicates = tree.insert(key, _pages(20, 21, 22), prev_prefix_len=0)
    assert (held, again, duplicates) == (6, node, _pages(20, 21, 22))
    # ...except below its cache_protected_len, which already are the tree's.
    _, _, duplicates = tree.insert(key, _pages(10, 31, 32), prev_prefix_len=2)
    assert duplicates == _pages(31, 32)
    assert tree.get_path_pages(node) == _pages(10, 11, 12)


def test_a_longer_insert_adds_a_leaf_and_a_diverging_one_splits_the_node() -> None:
    tree = RadixTree(2, is_eagle=False)
    _, first, _ = tree.insert(tree.make_key([1, 2, 3, 4]), _pages(0, 1), 0)
    held, longer, duplicates = tree.insert(tree.make_key([1, 2, 3, 4, 5, 6]),
                                           _pages(0, 1, 2), prev_prefix_len=4)
    assert (held, duplicates, longer.parent) == (4, [], first)
    # [1, 2, 7, 8] shares one page: the first node splits at 2.
    held, other, duplicates = tree.insert(tree.make_key([1, 2, 7, 8]), _pages(5, 6), 0)
    assert (held, duplicates) == (2, _pages(5))
    head = other.parent
    assert head is not None and head.key == (1, 2) and head.pages == _pages(0)
    assert first.parent is head and first.key == (3, 4) and first.pages == _pages(1)
    assert sorted(tree.get_pages()) == _pages(0, 1, 2, 6)
    assert tree.evictable_size == 8


def test_a_match_splits_the_node_it_ends_inside_and_the_split_keeps_its_locks() -> None:
    tree = RadixTree(2, is_eagle=False)
    _, leaf, _ = tree.insert(tree.make_key([1, 2, 3, 4, 5, 6]), _pages(0, 1, 2), 0)
    tree.lock(leaf)
    assert (tree.evictable_size, tree.protected_size) == (0, 6)
    matched, node = tree.match(tree.make_key([1, 2, 3, 4, 9, 9]))
    assert (matched, node.key, node.lock_ref) == (4, (1, 2, 3, 4), 1)
    assert leaf.parent is node and leaf.key == (5, 6)
    tree.unlock(leaf)
    assert (tree.evictable_size, tree.protected_size) == (6, 0)
    with pytest.raises(AssertionError, match="lock_ref 0"):
        tree.unlock(leaf)


def test_eviction_takes_unlocked_leaves_least_recently_used_first_then_their_parents() -> None:
    tree = RadixTree(1, is_eagle=False)
    _, a, _ = tree.insert((1, 2), _pages(0, 1), 0)
    _, b, _ = tree.insert((1, 3), _pages(9, 2), 0)  # splits: (1) -> (2), (3)
    assert a.key == (2,) and b.key == (3,)
    tree.match((1, 2))  # a used last
    assert tree.evict(1) == _pages(2)  # b, the least recent leaf
    tree.lock(a)
    assert tree.evict(5) == []  # a and its parent are locked
    tree.unlock(a)
    assert tree.evict(5) == _pages(1, 0)  # a, then its parent once it is a leaf
    assert (tree.get_nodes(), tree.evictable_size, tree.protected_size) == ([], 0, 0)


def test_the_view_numbers_nodes_and_parents_and_gives_each_path() -> None:
    tree = RadixTree(1, is_eagle=False)
    _, a, _ = tree.insert((1, 2), _pages(0, 1), 0)
    tree.insert((1, 3), _pages(5, 2), 0)
    tree.lock(a)
    view = tree.view()
    by_key = {node.key: node for node in view.nodes}
    assert by_key[(1,)].parent is None and by_key[(2,)].parent == by_key[(1,)].id
    assert [n.key for n in view.get_path(a.id)] == [(1,), (2,)]
    assert (by_key[(1,)].lock_ref, by_key[(3,)].lock_ref) == (1, 0)
    assert (view.evictable_size, view.protected_size) == (1, 2)


def test_the_waiting_prefix_refresh_matches_on_the_first_pass_and_every_32nd() -> None:
    """``_touch_waiting_prefixes``: a pass that finds requests waiting counts; the first and
    every 32nd match the waiting keys (a split where one ends inside a node), the others
    nothing; a pass with nobody waiting does not count."""
    tree = RadixTree(1, is_eagle=False)
    tree.insert(tuple(range(6)), [PageId(p) for p in range(6)], 0)
    waiting = [tree.make_key([0, 1, 2])]
    tree.refresh_waiting([])
    assert tree.refresh_calls == 0
    tree.refresh_waiting(waiting)
    assert sorted(len(n.key) for n in tree.get_nodes()) == [3, 3]  # split at 3
    tree.refresh_waiting([tree.make_key([0, 1])])  # pass 2 of 32: no match, no split
    assert sorted(len(n.key) for n in tree.get_nodes()) == [3, 3]
    for _ in range(30):
        tree.refresh_waiting(waiting)
    tree.refresh_waiting([tree.make_key([0, 1])])  # pass 33: matched, split at 2
    assert sorted(len(n.key) for n in tree.get_nodes()) == [1, 2, 3]
