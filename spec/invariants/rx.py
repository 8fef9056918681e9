"""RX: the radix prefix cache (cells with ``radix``). The tree holds whole pages of keys; a
request's row points at the tree's pages below its ``cache_protected_len`` and at its own
pages from there on; each holding request keeps one lock on the node its prefix ends at,
and a locked node is protected from eviction (docs/upstream-radix-sharing.md)."""

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.radix import RadixTree
from overlap_spec.spec.state import (
    REFUSED_PROMPT_TOKEN,
    Observation,
    ObservationPoint,
    RequestView,
    TreeNodeView,
    TreeView,
    compute_prompt_token,
)


def _tree(obs: Observation) -> TreeView:
    if obs.tree is None:
        raise fail("RX1", obs, "in a radix cell: the observation shows no tree")
    return obs.tree


def _get_key(config: ModelConfig, r: RequestView) -> tuple[object, ...] | None:
    """The request's key over its prompt and visible output (None: a trace shows no
    tokens)."""
    if r.output_ids is None or r.prompt_family is None:
        return None
    prompt = ([REFUSED_PROMPT_TOKEN] if r.last_prompt_token == REFUSED_PROMPT_TOKEN else
              [compute_prompt_token(r.prompt_family, i) for i in range(r.prompt_len)])
    return RadixTree(config.page_size, config.cell.is_spec).make_key(prompt + [*r.output_ids])


def _get_held_len(tree: TreeView, key: tuple[object, ...], page: int) -> int:
    """How much of ``key`` the tree holds on a path from the root, in whole pages (a node's
    children are keyed by their first page)."""
    children: dict[int | None, list[TreeNodeView]] = {}
    for node in tree.nodes:
        children.setdefault(node.parent, []).append(node)
    parent, held = None, 0
    while True:
        step = [n for n in children.get(parent, []) if n.key[:page] == key[held:held + page]]
        if not step or held + page > len(key):
            return held
        node, common = step[0], page
        while common < len(node.key) and node.key[common:common + page] == key[
                held + common:held + common + page] and held + common + page <= len(key):
            common += page
        if common < len(node.key):
            return held + common
        parent, held = node.id, held + common


@invariant("RX1", radix=True)
def check_rx1(config: ModelConfig, obs: Observation) -> int:
    """the pool is partitioned with the tree

    every KV page is free, on exactly one tree node, or private to exactly one holding request
    (its pages from cache_protected_len on), and the allocator's tree pages are the nodes'
    pages.

    Source: invariant_checker.py (the busy conservation check, ``kv_private_tokens``),
    unified_tree_core.py ``_add_new_node``; #13714, #11351, #32170 (a release freeing tree
    pages).
    """
    tree, alloc = _tree(obs), obs.allocator
    node_pages = [page for node in tree.nodes for page in node.pages]
    if sorted(node_pages) != sorted(alloc.tree_pages):
        raise fail("RX1", obs, f"for the tree: the allocator counts {len(alloc.tree_pages)} "
                   f"tree pages, the nodes hold {sorted(node_pages)}")
    seen: dict[int, str] = {}
    places = [(alloc.free_pages, "free"), *((n.pages, f"tree node {n.id}") for n in tree.nodes),
              *((r.owned_pages, f"private to r{r.rid}") for r in obs.requests)]
    for pages, where in places:
        for page in pages:
            if page in seen:
                raise fail("RX1", obs, f"for page {page}: both {seen[page]} and {where}")
            seen[page] = where
    if len(seen) != alloc.total_pages:
        raise fail("RX1", obs, f"for the KV pool: {len(seen)} pages placed != "
                   f"{alloc.total_pages} (leak)")
    return 1 if node_pages else 0


@invariant("RX2", radix=True)
def check_rx2(config: ModelConfig, obs: Observation) -> int:
    """a node's locks are its holders

    a node's lock count is the number of holding requests whose locked node is it or below it;
    a request that holds no KV holds no lock, and a locked node is in the tree (never
    evicted).

    Source: components/full.py ``acquire_component_lock`` / ``release_component_lock``,
    schedule_policy.py ``_commit_prefill_admission``, common.py ``release_kv_cache``
    (unlock); #32170 (a release without its unlock).
    """
    tree = _tree(obs)
    holders: dict[int, int] = {node.id: 0 for node in tree.nodes}
    for r in obs.requests:
        if r.lock_node is None:
            continue
        if not r.holds_kv:
            raise fail("RX2", obs, f"for request r{r.rid}: holds no KV but a lock on node "
                       f"{r.lock_node}")
        if r.lock_node not in holders:
            raise fail("RX2", obs, f"for request r{r.rid}: its locked node {r.lock_node} is "
                       "not in the tree (evicted while locked)")
        for node in tree.get_path(r.lock_node):
            holders[node.id] += 1
    for node in tree.nodes:
        if node.lock_ref != holders[node.id]:
            raise fail("RX2", obs, f"for tree node {node.id}: lock_ref={node.lock_ref}, "
                       f"{holders[node.id]} holding requests lock it")
    return sum(1 for node in tree.nodes if node.lock_ref > 0)


@invariant("RX3", radix=True)
def check_rx3(config: ModelConfig, obs: Observation) -> int:
    """evictable + protected is the tree

    the tree's protected size is the length of its locked nodes' keys, and evictable +
    protected is the length of all of them.

    Source: components/full.py (``evictable_size_`` / ``protected_size_`` moved by the lock
    walks), unified_radix_cache.py ``evictable_size`` / ``protected_size``.
    """
    tree = _tree(obs)
    total = sum(len(node.key) for node in tree.nodes)
    locked = sum(len(node.key) for node in tree.nodes if node.lock_ref > 0)
    if (tree.protected_size, tree.evictable_size + tree.protected_size) != (locked, total):
        raise fail("RX3", obs, f"for the tree: protected={tree.protected_size}, evictable="
                   f"{tree.evictable_size}; its locked nodes hold {locked} positions of "
                   f"{total}")
    return 1 if tree.nodes else 0


@invariant("RX4", radix=True)
def check_rx4(config: ModelConfig, obs: Observation) -> int:
    """a prefix row is the tree's path

    a holding request's cache_protected_len is whole pages, at most its committed length, and
    the length of its locked node's path; its row below it holds that path's pages, in
    order (a request's own pages start there: it never frees the tree's).

    Source: unified_radix_cache.py ``checkpoint_into_tree`` (the row repoint, the lock move),
    allocation.py ``alloc_for_extend`` (``_prefix_kv_indices``), invariant_checker.py:302
    (cpl page aligned); mini-sglang #142 (duplicates freed, the row not repointed).
    """
    tree, p = _tree(obs), config.page_size
    count = 0
    for r in obs.get_holding():
        cpl = r.cache_protected_len
        path = tree.get_path(r.lock_node) if r.lock_node in {n.id for n in tree.nodes} else []
        pages = [page for node in path for page in node.pages]
        if cpl % p or cpl > r.kv_committed_len or cpl != len(pages) * p:
            raise fail("RX4", obs, f"for request r{r.rid}: cache_protected_len={cpl}, "
                       f"kv_committed_len={r.kv_committed_len}, its locked path holds "
                       f"{len(pages) * p} positions (page {p})")
        for position, slot in enumerate(r.row_slots[:cpl]):
            if slot != pages[position // p] * p + position % p:
                raise fail("RX4", obs, f"for request r{r.rid}: req_to_token position "
                           f"{position} holds slot {slot}, the tree's path has "
                           f"{pages[position // p] * p + position % p} there")
        count += 1 if cpl else 0
    return count


@invariant("RX5", radix=True)
def check_rx5(config: ModelConfig, obs: Observation) -> int:
    """a hit is the request's own key

    the tree path below a holding request's cache_protected_len is keyed by that request's own
    tokens: a hit is never longer than what the tree held of its key.

    Source: unified_tree_core.py ``_match_prefix_helper``, schedule_batch.py
    ``_compute_max_prefix_len`` (a match covers at most input_len - 1 tokens).
    """
    tree = _tree(obs)
    present = {node.id for node in tree.nodes}
    count = 0
    for r in obs.get_holding():
        key = _get_key(config, r)
        if key is None or not r.cache_protected_len or r.lock_node not in {None, *present}:
            continue  # a lock on a node the tree lacks is RX2's
        path_key = tuple(k for node in tree.get_path(r.lock_node) for k in node.key)
        if path_key != key[:r.cache_protected_len] or len(key) < r.cache_protected_len:
            raise fail("RX5", obs, f"for request r{r.rid}: its {r.cache_protected_len} "
                       f"protected positions are keyed {path_key[:8]}..., its own key is "
                       f"{key[:8]}... ({len(key)} long)")
        count += 1
    return count


@invariant("RX6", radix=True)
def check_rx6(config: ModelConfig, obs: Observation) -> int:
    """keys are whole pages

    every tree node's key is a positive number of whole pages, with one page per page of key.

    Source: radix_cache.py ``RadixKey.page_aligned``, unified_tree_core.py ``_split_node``
    (splits at page boundaries).
    """
    tree, p = _tree(obs), config.page_size
    for node in tree.nodes:
        if not node.key or len(node.key) % p or len(node.pages) * p != len(node.key):
            raise fail("RX6", obs, f"for tree node {node.id}: key of {len(node.key)} positions "
                       f"with {len(node.pages)} pages (page {p})")
    return len(tree.nodes)


@invariant("RX7", radix=True)
def check_rx7(config: ModelConfig, obs: Observation) -> int:
    """a finish inserts what it caches

    after a finish release processed in this result, the tree holds the request's key for the
    positions KV9 says it keyed (``inserted_len``), as far as its visible tokens show the key.

    Source: common.py ``release_kv_cache`` (checkpoint=True), unified_radix_cache.py
    ``checkpoint_into_tree``; #35694 (what a finish keys).
    """
    if obs.point is not ObservationPoint.PROCESS_RESULT or obs.result is None:
        return 0
    tree = _tree(obs)
    count = 0
    released = {e.rid for e in obs.result.entries if not e.finished_before}
    for r in obs.requests:
        key = _get_key(config, r)
        if r.rid not in released or r.holds_kv or not r.inserted_len or key is None:
            continue
        # A finish hides what it accepted past its stop; an abort's key runs past it.
        shown = min(r.inserted_len, len(key) // config.page_size * config.page_size)
        held = _get_held_len(tree, key, config.page_size)
        if held < shown:
            raise fail("RX7", obs, f"for request r{r.rid}: the tree holds {held} positions of "
                       f"its key, its finish keyed {r.inserted_len}")
        count += 1
    return count


@invariant("RX8", radix=True)
def check_rx8(config: ModelConfig, obs: Observation) -> int:
    """a flush runs only at full idle and leaves nothing

    a flush_cache that ran found no request holding KV (none running, chunked or in the batch
    in flight) and none waiting unless generation was paused, and left every page free,
    every request row free and the tree empty with both sizes 0.

    Source: scheduler.py ``flush_cache`` and ``is_fully_idle`` (the running and last batches,
    the result queue, the chunked request, the waiting queue; ``ignore_waiting`` while
    ``pause_generation`` holds the loop, :5520), unified_tree_core.py
    ``reset``, allocator ``clear``, memory_pool.py ``ReqToTokenPool.clear``; #12107 (a flush
    blind to the overlap's batch in flight: its request's lock held a node of the old tree),
    #27446 (the same under pipeline parallelism).
    """
    if obs.point is not ObservationPoint.FLUSH_CACHE:
        return 0
    busy = [f"r{r.rid}" for r in obs.requests
            if (r.waiting and not obs.paused) or r.holds_kv]
    tree, alloc = _tree(obs), obs.allocator
    for what, got, want in (
            (f"requests waiting or holding KV {busy}", len(busy), 0),
            ("free pages", len(alloc.free_pages), alloc.total_pages),
            ("free request rows", len(alloc.free_pool_rows), alloc.pool_rows),
            ("tree nodes", len(tree.nodes), 0),
            ("evictable + protected", tree.evictable_size + tree.protected_size, 0)):
        if got != want:
            raise fail("RX8", obs, f"after the flush: {got} {what}, expected {want}")
    return 1 if any(r.finished for r in obs.requests) else 0  # a flush after some work
