"""The radix prefix tree, as sglang 0.5.23's ``UnifiedRadixCache`` keeps it for full attention
on the device: the python tree core, LRU eviction, no host tier, no sessions.

Both implementations use this one tree (it is host-side state, like the free list; they may
not import each other), so a tree bug is the spec's and the invariants of
``spec/invariants/rx.py`` and the upstream tier are what check it. What the scheduler does
with it (match at admission, checkpoints, the release, retraction) is each implementation's
own, following ``docs/upstream-radix-sharing.md`` sections 1 and 2.

- **Keys** are whole pages of tokens, bigrams ``(t[i], t[i+1])`` under EAGLE
  (``RadixKey.maybe_to_bigram_view``, ``page_aligned``). A node holds one page id per page
  of its key; a position ``i`` of a key is KV slot ``pages[i // p] * p + i % p``.
- **Nodes split** where a match or an insert leaves one part-way (``_split_node``): the new
  parent keeps the first part and the child's locks.
- **Locks** walk from a node up to the root's child (``acquire_component_lock``); a node's
  length moves from evictable to protected when its count leaves 0, and back.
- **Eviction** removes unlocked leaves, least recently used first, a parent once it is a
  leaf (``_evict_device_next_node``). The clock is the release's
  (``get_and_increase_time_counter``): a new node takes two ticks, a walked node one, a
  split's child one, and a match of a non-empty key stamps its path, deepest newest.

Source: ``mem_cache/unified_cache/unified_tree_core.py`` (``_match_prefix_helper``,
``_match_post_processor``, ``_insert_walk_step``, ``_insert_overlap_step``,
``_insert_commit_step``, ``_split_node``), ``components/full.py`` (locks, eviction),
``unified_radix_cache.py`` (``checkpoint_into_tree``, ``path_device_indices``).
"""

from __future__ import annotations

from collections.abc import Sequence

from overlap_spec.spec.state import TreeNodeView, TreeView
from overlap_spec.spec.units import PageId


class Node:
    def __init__(self, tree: RadixTree, key: tuple[object, ...], pages: list[PageId],
                 parent: Node | None) -> None:
        self.id, tree.next_id = tree.next_id, tree.next_id + 1
        self.key, self.pages, self.parent = key, pages, parent
        self.children: dict[tuple[object, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = tree.tick()
        tree.tick()  # creation_time


class RadixTree:
    def __init__(self, page_size: int, is_eagle: bool, faults: frozenset[str] = frozenset()
                 ) -> None:
        # B31: the lock walks skip the node itself; B34: an insert counts pages, not tokens.
        self.page_size, self.is_eagle, self.faults = page_size, is_eagle, faults
        self.clock = 0
        self.next_id = 0
        self.root = Node(self, (), [], None)
        self.evictable_size = 0  # tokens, as the release counts them
        self.protected_size = 0
        self.refresh_calls = 0  # SchedulePolicy._waiting_prefix_refresh_calls

    def reset(self) -> None:
        """``tree_core.reset`` (``flush_cache``): a new root, both sizes 0. The clock and the
        node counter go on (the release's are global), and so does the waiting-prefix
        refresh count (the scheduler's policy keeps it)."""
        self.root = Node(self, (), [], None)
        self.evictable_size = self.protected_size = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock - 1

    def make_key(self, tokens: Sequence[int], whole_pages: bool = True) -> tuple[object, ...]:
        """The key over ``tokens``: bigrams under EAGLE, cut to whole pages (uncut: B32)."""
        pairs = zip(tokens, tokens[1:], strict=False)
        key: tuple[object, ...] = tuple(pairs) if self.is_eagle else tuple(tokens)
        return key[:len(key) // self.page_size * self.page_size] if whole_pages else key

    def _common(self, a: tuple[object, ...], b: tuple[object, ...]) -> int:
        """Positions ``a`` and ``b`` share from their start, in whole pages."""
        p, n = self.page_size, 0
        while n < min(len(a), len(b)) and a[n:n + p] == b[n:n + p]:
            n += p
        return n

    def _split(self, child: Node, at: int) -> Node:
        assert child.parent is not None
        p = self.page_size
        new = Node(self, child.key[:at], child.pages[:at // p], child.parent)
        new.lock_ref = child.lock_ref
        child.parent.children[child.key[:p]] = new
        child.key, child.pages, child.parent = child.key[at:], child.pages[at // p:], new
        new.children = {child.key[:p]: child}
        child.last_access = self.tick()
        return new

    def match(self, key: tuple[object, ...]) -> tuple[int, Node]:
        """The longest prefix of ``key`` the tree holds and its deepest node (splitting one
        it ends inside); stamps the path as used. An empty key returns the root untouched:
        ``match_prefix`` answers it before any walk, so the clock does not move."""
        if not key:
            return 0, self.root
        p, node, matched = self.page_size, self.root, 0
        while matched < len(key) and key[matched:matched + p] in node.children:
            child = node.children[key[matched:matched + p]]
            n = self._common(child.key, key[matched:])
            matched += n
            if n < len(child.key):
                node = self._split(child, n)
                break
            node = child
        now, walk = float(self.tick()), node  # type: tuple[float, Node | None]
        while walk is not None:
            walk.last_access = now  # type: ignore[assignment]
            now, walk = now - 0.00001, walk.parent
        return matched, node

    def insert(self, key: tuple[object, ...], pages: Sequence[PageId],
               prev_prefix_len: int) -> tuple[int, Node, list[PageId]]:
        """Insert ``key`` with the inserter's ``pages`` (one per page of the key): the length
        the tree already held, the node the insert ended on, and the inserter's pages at or
        past ``prev_prefix_len`` that the tree already held (duplicates, to be freed)."""
        p, node, done = self.page_size, self.root, 0
        duplicates: list[PageId] = []
        self.tick()  # the root is touched
        while done < len(key) and key[done:done + p] in node.children:
            child = node.children[key[done:done + p]]
            child.last_access = self.tick()
            n = self._common(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            start = max(prev_prefix_len, done)
            duplicates += pages[start // p:(done + n) // p] if start < done + n else []
            node, done = child, done + n
        held = done
        if done < len(key):
            leaf = Node(self, key[done:], list(pages[done // p:len(key) // p]), node)
            node.children[leaf.key[:p]] = leaf
            self.evictable_size += len(leaf.pages if "B34" in self.faults else leaf.key)
            node = leaf
        return held, node, duplicates

    def refresh_waiting(self, keys: Sequence[tuple[object, ...]]) -> None:
        """``_touch_waiting_prefixes`` (schedule_policy.py:282-302: FCFS keeps the waiting
        prefixes' LRU order): on the first admission pass that finds requests waiting and on
        every 32nd after, the keys of the first 128 are matched, the queue's head last
        (``touch_prefix``: splits and stamps, no lock)."""
        if not keys:
            return
        self.refresh_calls += 1
        if (self.refresh_calls - 1) % 32 == 0:
            for key in reversed(keys[:128]):
                self.match(key)

    def get_path_pages(self, node: Node) -> list[PageId]:
        """The pages from the root down to ``node`` (``path_device_indices``)."""
        pages: list[PageId] = []
        walk: Node | None = node
        while walk is not None:
            pages[:0] = walk.pages
            walk = walk.parent
        return pages

    def lock(self, node: Node) -> Node:
        walk: Node | None = node.parent if "B31" in self.faults else node
        while walk is not None and walk is not self.root:
            if walk.lock_ref == 0:
                self.evictable_size -= len(walk.key)
                self.protected_size += len(walk.key)
            walk.lock_ref += 1
            walk = walk.parent
        return node

    def unlock(self, node: Node) -> None:
        walk: Node | None = node.parent if "B31" in self.faults else node
        while walk is not None and walk is not self.root:
            assert walk.lock_ref > 0, f"unlock of node {walk.id} at lock_ref 0"
            walk.lock_ref -= 1
            if walk.lock_ref == 0:
                self.protected_size -= len(walk.key)
                self.evictable_size += len(walk.key)
            walk = walk.parent

    def get_nodes(self) -> list[Node]:
        found, stack = [], [self.root]
        while stack:
            node = stack.pop()
            found += [] if node is self.root else [node]
            stack += node.children.values()
        return sorted(found, key=lambda n: n.id)

    def evict(self, pages: int) -> list[PageId]:
        """Evict unlocked leaves, least recently used first, until ``pages`` pages are freed
        or none is left; the freed pages."""
        freed: list[PageId] = []
        while len(freed) < pages:
            leaves = [n for n in self.get_nodes() if n.lock_ref == 0 and not n.children]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            assert victim.parent is not None
            del victim.parent.children[victim.key[:self.page_size]]
            self.evictable_size -= len(victim.key)
            freed += victim.pages
        return freed

    def get_pages(self) -> list[PageId]:
        return [page for node in self.get_nodes() for page in node.pages]

    def view(self) -> TreeView:
        return TreeView(tuple(TreeNodeView(n.id, None if n.parent is self.root else
                                           n.parent.id if n.parent else None,
                                           n.key, tuple(n.pages), n.lock_ref)
                              for n in self.get_nodes()),
                        self.evictable_size, self.protected_size)
