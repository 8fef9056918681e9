"""The catalogue of historical bugs B1-B39 (digest section 5; B16 is the reserve upstream
fixed in #26354, B17 what the upstream tier found the release doing, B18 a chunked-prefill
counter bug of the JAX port, B19 and B20 mixed-chunk bugs, B21 the row of a tree on pages
> 1, B22 an unaligned spec-v2 allocation, B23 the release's page-1 tree row: U7, B24
a prompt too long admitted, B25 the crash when the last request does not fit; B26-B35 the
radix prefix cache's, in the radix cells only; B38 finished requests still counted as the
admission's running load), each a mutant the checkers must kill.

Each entry names the upstream PRs, the trigger, the invariants the digest says it
breaks and the cells where the trigger can occur. An implementation re-introduces
a bug when its ``faults`` set holds the ID (``spec/relation.py`` and the implementations
say what each fault changes); with no fault it is the intended design. A mutant is
*killed* by a checker when the checker reports a violation in every cell where the bug
applies, or by exactly the crash its entry expects where the bug was a crash (B2 in
gpu_impl, B25 everywhere; ``harness/crash.py``), and by nothing else.

The catalogue is the mutant runner's data, not a claim, so it lives here and not in
``spec/``: the spec keeps only the IDs (``spec/bugs.py`` ``BUG_IDS``), which the
implementations check their ``faults`` against; ``tests/test_mutants.py`` holds the two
lists to each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from overlap_spec.harness.crash import Crash
from overlap_spec.spec.bugs import BUG_IDS, LAST_REQUEST_OOM
from overlap_spec.spec.config import Cell, SpecMode


@dataclass(frozen=True)
class Bug:
    id: str
    title: str
    upstream: str  # PRs / issues
    trigger: str
    mutant: str  # how the fault re-introduces it
    invariants: tuple[str, ...]  # what the digest says it breaks
    applies: Callable[[Cell], bool]
    stream_level: bool = False  # lives in the stream / event structure
    # Cells where the trigger is reachable in a few steps; the default matrix must kill
    # the mutant in each. Empty: the first applicable cell of each speculative mode.
    representative_cells: tuple[str, ...] = ()
    # Non-empty when sglang 0.5.23 still behaves this way (where, and the upstream issue or
    # the upstream tier's finding): the mutant is then today's upstream, not history.
    current_upstream: str = ""
    # Non-empty when the Z3 model cannot express the trigger: its column is n/a, saying why.
    not_in_z3: str = ""
    # Sizes the trigger needs in place of the preset's (chunked prefill for B18): every
    # column runs the mutant at them.
    sizes: tuple[tuple[str, int], ...] = ()
    # The crash a bug was (B2 in gpu_impl's backend, B25): a checker kills the bug by a
    # listed invariant or by exactly this crash (type, raising function, words of the
    # message); any other crash is no kill.
    crash: Crash | None = None
    # A bug of the radix prefix cache (B26-B35): it applies in radix cells only, and the
    # earlier bugs in the cells without the cache (``harness/mutants/select.py``).
    radix: bool = False


# The radix bugs the BMC's bounded tree cannot express: it counts pages and locks per page
# of one family's trunk, with no nodes and no keys (proofs/bmc_radix.py).
_NO_NODES_IN_BMC: Final = ("the BMC's bounded tree counts pages and per-page locks, with no "
                           "nodes or keys (proofs/bmc_radix.py)")
# Their representative cells: serving defaults (overlap on), one without speculation and one
# keying bigrams (EAGLE); tests/test_mutants.py kills each in every radix cell it applies in.
_RADIX_CELLS: Final = ("ov-p1-none-radix", "ov-p1-v2chain-cpu-honest-radix")
_PAGED_RADIX_CELLS: Final = ("ov-p4-none-radix", "ov-p4-v2chain-cpu-honest-radix")

BUGS: Final[tuple[Bug, ...]] = (
    Bug("B1", "stale seq_lens_sum kept across filter/merge", "#25818",
        "filter_batch / merge_batch keep the old integer sum instead of resetting it to None",
        "filter and merge leave seq_lens_sum as it was", ("SL3", "SL1"), lambda cell: True),
    Bug("B2", "a None seq_lens_sum consumed without refresh", "#25818, #32532",
        "init_new no longer backfills the lazily-None sum; a consumer gets None",
        "init_new skips the backfill", ("SL1",),
        lambda cell: not (cell.is_spec and cell.overlap),
        # gpu_impl's ForwardBatch.init_new raises where the backend sized its buffer by
        # the None (#25818's crash); the reference's checker sees SL1 first.
        crash=Crash("SeqLensSumMissing", "init_new", "seq_lens_sum is None with a CPU mirror")),
    # Stale rows exist under overlap only; the pre-claim era is where their commit was the
    # bug (#23456 added the skip with the pre-claim; the honest cells never lacked it).
    Bug("B3", "late verify results committed for finished or retracted requests",
        "#23456 (fixed 2026-05-10), #18848",
        "under the bonus pre-claim, the commit loop of a late verify result adds "
        "accept_len - 1 to every row of the batch copy: a request retracted since gains "
        "committed KV it no longer holds, one finished since misses its refund (the output "
        "loop already skipped both)",
        "the commit loop drops its stale-row skip; output, finish and release keep theirs",
        ("RP1", "KV5", "KV6"), lambda cell: cell.is_spec and cell.overlap and cell.preclaim),
    Bug("B4", "global accept counters count stale rows", "#23456 review, #18848",
        "num_correct_drafts and the metrics batch size sum over every request of the copy",
        "counters sum over all requests (today's upstream behaviour)", ("RP3",),
        lambda cell: cell.is_spec and cell.overlap,
        current_upstream="every spec cell: batch_result_processor.py:785, :986 (#18848 closed "
                         "unmerged; upstream tier finding U3)"),
    Bug("B5", "schedule side reads new_seq_lens without the publish_ready fence",
        "#25465, #25879",
        "resolve_seq_lens_cpu gathers / copies new_seq_lens_buf without waiting on publish_ready",
        "S and D skip their publish_ready waits", ("FM1",),
        lambda cell: cell.is_spec and cell.overlap and cell.needs_cpu_seq_lens,
        stream_level=True),
    # Stale by design until the next resolve (#25879, #25944); the bug was a schedule-side
    # reader that consumed it. In spec cells the model has no such reader before the
    # resolve, so there only the state shows it.
    Bug("B6", "seq_lens sentinel between forwards, read on the schedule side",
        "#25879, #25944, #26020",
        "run_batch leaves SB.seq_lens = -future_indices until the next resolve, and a "
        "schedule-side reader consumes it first: non-spec prepare_for_decode's "
        "alloc_for_decode, one of the five sites #26020 lists",
        "the sentinel is re-introduced after launch; a non-spec decode is prepared from it",
        ("SL5", "SL2", "SL7", "KV1"), lambda cell: cell.overlap),
    Bug("B7", "spec draft-extend mutations pollute the ScheduleBatch", "#26020",
        "draft-extend adds D_tok to SB.seq_lens / seq_lens_cpu instead of the ForwardBatch",
        "the +D_tok is written to the ScheduleBatch", ("SL10", "SL2", "SL6"),
        lambda cell: cell.is_spec),
    Bug("B8", "no WAR fence after launch", "#26376, #26380, #28363, #31687",
        "S rewrites req_to_token rows while F_i still reads them",
        "_apply_war_barrier does nothing", ("ST2",), lambda cell: cell.overlap, stream_level=True),
    # FM3 too: the release's read-done follows the publish, so S's barrier already orders
    # F_i's publish before the prebuilt's (FM1, FM2 hold), but not F_i's stash, which comes
    # after it: the prebuilt's stash on S races F_i's stash of a row a finished request
    # left and the prebuilt reuses (the hazard #35748's S.wait_stream(F) is for). With a
    # FIFO free list that takes four requests on three rows, which Hypothesis draws in
    # about 2 of 5 seeds: the representative is the early fence's cell, where FM1 and FM2
    # show in 4 ops (tests/test_fence.py pins the release cells' FM3 in every column).
    Bug("B9", "publish_ready re-recorded on the schedule stream", "#30435, #35748",
        "the PD prebuilt path publishes on S with no caller fence; the event leaves F",
        "process_prebuilt publishes on S without S.wait_stream(F)", ("FM2", "FM1", "FM3"),
        lambda cell: cell.is_spec and cell.overlap, stream_level=True,
        representative_cells=("ov-p1-v2chain-cpu-honest-earlyfence",)),
    # A slot claimed past the newest token: the non-spec overlap claim. (In spec cells the
    # release's owned_kv_len equals the trimmed rule once the run is cut: B11's ground.)
    Bug("B10", "the newest token's slot cached at a finish",
        "#24590 (closed), #24745 (closed unmerged)",
        "under overlap the next decode has claimed the newest token's slot (non-spec "
        "prepare_for_decode) when a result stops the request; the release caches "
        "owned_kv_len, prompt + the visible output, so the tree keys a slot only the "
        "in-flight forward writes, one more than prompt + output - 1",
        "a trimmed finish's cell caches owned_kv_len, the release's rule",
        ("KV9",), lambda cell: cell.trimmed_finish and not cell.is_spec,
        current_upstream="every non-spec overlap cell: Req.owned_kv_len() "
                         "(schedule_batch.py:1552) keys prompt + the visible output at a stop "
                         "(#24590 closed, its fix #24745 unmerged)"),
    # A run committed past the visible output: only a verify accepts more than one token (a
    # non-spec decode commits at most prompt + output, which owned_kv_len does not cut).
    Bug("B11", "finishing-round overshoot cached", "#22897, M2, Req.owned_kv_len",
        "the finishing verify accepts tokens past the stop or max_new_tokens; the whole run is "
        "committed, and the release caches kv_committed_len instead of cutting it at the "
        "visible output (finished_len)",
        "cache kv_committed_len, not owned_kv_len (with the trimmed finish, also commit the "
        "uncut run)", ("KV9",), lambda cell: cell.is_spec),
    # A reserve that shrinks on an adaptive down-switch: the rung reserve proposal only
    # (since PR 26354 the release's reserve does not depend on the rung).
    Bug("B12", "v2 reserve without the max clamp", "#23336 (the clamp); rung reserve cells",
        "after an adaptive step down-switch committed + reserve < allocated (reachable only "
        "where the reserve shrinks with the rung: the rung reserve proposal)",
        "nxt = page_align(committed + reserve) without max(cur, ...)", ("KV1", "KV4", "KV7"),
        lambda cell: cell.spec_mode is SpecMode.V2_CHAIN and cell.rung_reserve,
        representative_cells=("ov-p1-v2chain-cpu-honest-rungreserve",
                              "nov-p1-v2chain-cpu-honest-rungreserve")),
    Bug("B13", "schedule stream reads forward-produced spec state", "#35198",
        "spec_info carries a forward-written accept_lens tensor that filter_batch gathers on S",
        # ST4 too: the forward-allocated tensor now lives on the schedule side, so its free
        # can race S's last read of it (gpu_impl's race detector finds that one first).
        "filter_batch slices the forward-produced accept_lens", ("FM1", "ST4"),
        lambda cell: cell.is_spec and cell.overlap, stream_level=True),
    Bug("B14", "a released request launched again", "#28986, #28682",
        "overlap disabled for a batch processes the pending result between prepare and launch"
        " and a request it finished and released stays in the batch",
        "no re-filter after the early result processing", ("RP1", "KV4"),
        lambda cell: cell.overlap,
        current_upstream="the need_grammar_sync path (host-draft or ngram with a grammar): "
                         "event_loop_overlap processes early and launches without a re-filter "
                         "(#32353; #28986 open)"),
    # gpu_impl's allocator reuses a freed block on S, which in a spec cell has waited for
    # the release's read-done, past every read F_i makes of the batch's tensors: only the
    # reference's rule (a free ordered after the host) sees B15 there. The representatives
    # are cells where every column sees it: non-spec, and spec with the early fence.
    Bug("B15", "tensor lifetime across streams", "#11210, #36661",
        "tensors read by F_i are dropped before F_i completes and their memory reused",
        "the batch_record_buf ring has one slot", ("ST4",), lambda cell: cell.overlap,
        stream_level=True,
        representative_cells=("ov-p1-none", "ov-p1-v2chain-cpu-honest-earlyfence")),
    Bug("B16", "2A reserve of the current rung under an adaptive down-switch",
        "before #26354 (fixed upstream 2026-05-28)",
        "the in-flight verify ran a wider rung than the one being prepared, so the lag can "
        "exceed A of the new rung and 2A of it does not cover lag + W",
        "reserve = 2 * A(current rung) instead of 2 * A(widest rung)", ("KV3",),
        lambda cell: cell.spec_mode is SpecMode.V2_CHAIN and cell.overlap,
        representative_cells=("ov-p1-v2chain-cpu-honest", "ov-p1-v2chain-nocpu-honest")),
    Bug("B17", "an abort shows the whole finishing run",
        "upstream tier findings U5, U6 (no upstream issue filed)",
        "an abort is pending when a verify result crosses max_new_tokens or holds a stop: "
        "update_finish_state returns on to_finish before it sets finished_len, so the "
        "client sees the whole accepted run, past the cap and the stop",
        "with an abort pending the accepted run is shown whole", ("RP2", "RP5", "RP7"),
        lambda cell: cell.is_spec,
        current_upstream="every spec cell: schedule_batch.py:2011 Req.update_finish_state "
                         "(findings U5, U6)",
        not_in_z3="aborts are not among the BMC's choices (proofs/bmc.py)"),
    Bug("B18", "a continuing middle chunk left uncounted",
        "sgl-project/sglang-jax #971 (merged 2026-04-27; the JAX port of the scheduler)",
        "a prompt of three chunks or more: the next chunk, itself a middle one, is scheduled "
        "without bumping inflight_middle_chunks, so its result is taken for the last chunk's: "
        "a token the model never emitted is appended and the finish state updated while the "
        "prompt is still being prefilled",
        "add_chunked_req's continuing middle chunk is not counted", ("KV12", "RP2"),
        lambda cell: True,
        not_in_z3="the Z3 model and BMC have no chunked prefill (proofs/model.py)",
        sizes=(("chunked_prefill_size", 4),)),
    Bug("B19", "a mixed step keeps the prefill's prefill-only flag",
        "#10889 (merged 2025-09-26)",
        "with mixed chunks, a prefill of requests capped to 0 new tokens takes the running "
        "decodes along: the merged batch stays flagged prefill-only, so once it is the running "
        "batch it is never decoded and the decodes it carries stall until a merge clears the "
        "flag (in 2025 the loop also skipped the prefill-only batch's merge, stranding them "
        "with their KV, the leak the PR reports)",
        "mix_with_running leaves is_prefill_only as the prefill's (its merge of the "
        "decodes not AND-ing it, as then)", ("RP8",),
        lambda cell: not cell.is_spec, representative_cells=("ov-p1-none", "nov-p4-none"),
        not_in_z3="the Z3 model and BMC have no chunked prefill (proofs/model.py)",
        sizes=(("chunked_prefill_size", 8), ("mixed_chunk", 1), ("kv_tokens", 16))),
    Bug("B20", "a spec decode mixed into a prefill commits nothing",
        "#27971 (closed: its settle-at-result design landed through #28754; upstream's "
        "DP-attention mixed-chunk CI job caught a 37-slot gap)",
        "with mixed chunks in a spec cell, a running decode rides in the prefill as a tail "
        "that writes its pending bonus token's slot; the prefill's result path is a second "
        "entry point for decode results, and without its commit kv_committed_len falls one "
        "behind per mixed step, so the next reserve starts from the wrong base",
        "the tail's kv_committed_len += 1 in process_batch_result_prefill is dropped",
        ("KV8", "KV9"),
        lambda cell: cell.mixes_spec_tails,
        representative_cells=("ov-p1-v2chain-cpu-honest", "nov-p1-v2tree-cpu-honest"),
        not_in_z3="the Z3 model and BMC have no chunked prefill (proofs/model.py)",
        sizes=(("chunked_prefill_size", 8), ("mixed_chunk", 1))),
    Bug("B21", "a tree's req_to_token row not widened on pages > 1",
        "#26972 (merged 2026-06; the release reverts it with SGLANG_DEBUG_REVERT_PR=26972)",
        "a tree on pages > 1 reserves 2A with a page-aligned region per branch (2A = 32 at the "
        "minimal shape), far past the spec headroom 4 + D_tok: the first decode allocates past "
        "the row (the release asserts in eagle_prepare_for_decode; before the PR its free "
        "clamped to the row and leaked the slots past it)",
        "get_req_to_token_extra_context_len keeps 4 + D_tok, not max(., 2A + page - 1)",
        ("KV1",), lambda cell: cell.spec_mode is SpecMode.V2_TREE and cell.page_size > 1,
        not_in_z3="the Z3 model and BMC take the row width from the configuration "
                  "(proofs/claims.py), not from an implementation"),
    # The record, not the pool: 0.5.23's next prepare fills the partial page's tail from
    # last_loc + 1 and its release frees whole pages, so no page leaks on the paths read
    # (docs/upstream-radix-sharing.md section 6); the pages counted are the same.
    Bug("B22", "a spec-v2 decode allocation not page aligned",
        "#31616 (closed 2026-07 unmerged; 0.5.23 rounds nxt up in "
        "page_aligned_decode_alloc_lens, and #35265, merged 2026-08, aligned DFLASH the same "
        "way)",
        "on pages > 1 kv_committed_len grows by a variable accept count, so committed + 2A "
        "is rarely a page multiple: recording it leaves the last page's tail allocated by "
        "the paged allocator (whole pages) but outside kv_allocated_len (the PR's "
        "\"stranded tail\")",
        "the spec-v2 prepare keeps max(cur, committed + 2A) without the page rounding",
        ("KV3",), lambda cell: cell.is_spec and cell.page_size > 1),
    # The release's own row (finding U7). The minimal tree keeps 2A within 4 + D_tok, so the
    # kill sizes widen it to four branches (2A 16 > 8) and shorten the context to 8, so that
    # a prompt of one token allocates past the row at its first decode (1 + 16 > 16) and
    # the request lives on. A chain's 2A = 2 * D_tok exceeds 4 + D_tok only from
    # chain_steps 4, past both presets: there the release's row is narrower than the
    # model's too (U7 on the release), and B23 is not stated.
    Bug("B23", "a page-1 tree's row not widened to its decode reserve",
        "#26972 (widens only on pages > 1); #33581 (open, 2026-08-04: the same gate on "
        "DFLASH's page-1 row); upstream tier finding U7",
        "on page 1 the row keeps 4 + D_tok columns past the context while a decode reserves "
        "2A from kv_committed_len: a tree's 2A = 2 * steps * topk (24 at topk 4, steps 3) "
        "exceeds it, so a request a few tokens below the context allocates past its row "
        "(the assign kernel then writes the next row)",
        "get_req_to_token_extra_context_len widens to 2A + page - 1 on pages > 1 only",
        ("KV1",), lambda cell: cell.spec_mode is SpecMode.V2_TREE and cell.page_size == 1,
        current_upstream="every page-1 tree whose 2A exceeds 4 + D_tok (the realistic "
                         "preset's): allocation_sizing.py:96 "
                         "get_req_to_token_extra_context_len; upstream tier finding U7; "
                         "#33581 (open)",
        not_in_z3="the Z3 model and BMC take the row width from the configuration "
                  "(proofs/claims.py), not from an implementation",
        sizes=(("max_context_len", 8), ("tree_topk", 4))),
    # Admission-time validation (issue 12, deliverable 5). Refused from max_req_len - 5 =
    # min(context, pool) - 6 tokens: the kill size, a context of 7, refuses every prompt,
    # the alphabet's one-token prompt included, so the mutant runs it at once.
    Bug("B24", "a prompt too long for the context admitted",
        "#3910 (open, 2025-02) and #9599 (closed, 2025-08): a prompt near the context "
        "length crashed the server; 0.5.23 refuses it in validate_input_length and "
        "queues it as one token with an abort (set_finish_with_abort)",
        "a prompt of max_req_len - 5 tokens or more reaches the waiting queue whole and "
        "is prefilled and decoded as any other, where the release aborts it at once",
        "validate_input_length skipped: the prompt is admitted whole, its max_new_tokens "
        "only capped", ("RP9",), lambda cell: True,
        representative_cells=("ov-p1-none", "ov-p1-v2chain-cpu-honest"),
        not_in_z3="the BMC draws prompts up to max_prompt_len, where admission neither caps "
                  "nor refuses (tests/test_admission.py)",
        sizes=(("max_context_len", 7),)),
    # The retract-time abort of the last request (issue 12, deliverable 5). Only a spec-v2
    # decode can outgrow the pool alone: admission caps prompt + max_new_tokens at the
    # pool less 2 (validate_input_length's max_req_len), and a non-spec decode asks one
    # token; #14948's other road there, the PD-decode prealloc queue, is not modelled. The
    # kill sizes: a pool of 12 (40 for a tree on pages > 1), chain steps 5 and three
    # branches, where a one-token prompt's first decode already asks more than the pool
    # (A = 6 for chains and page-1 trees, 1 + 2A = 13 > 12; A = 24 for a page-4 tree,
    # 1 + 2A = 49 > 40), so the exhaustive tier's one-token admissions reach it within
    # its depth; the rung-dependent reserve of a cell without overlap (3 at the minimal
    # chain, which a capped request never outgrows) reaches it at chain steps 5.
    Bug("B25", "the last request that cannot fit crashes the scheduler",
        "#19881 (merged 2026-03-04); #15626 and #14948 (closed): with one request left "
        "and the pool short, retract_decode raised (ValueError; earlier an assertion) "
        "and the scheduler process died; 0.5.23 aborts that request instead",
        "one running request whose next decode alone needs more KV than the pool has "
        "free once every other request is retracted",
        "retract_decode raises where it would abort the last request",
        (), lambda cell: cell.is_spec,
        representative_cells=("ov-p1-v2chain-cpu-honest", "nov-p4-v2tree-cpu-honest",
                              "nov-p1-v2chain-cpu-honest-rungreserve"),
        not_in_z3="the BMC leaves the out-of-memory abort path out (docs/proofs.md)",
        sizes=(("kv_tokens", 12), ("paged_tree_kv_tokens", 40), ("chain_steps", 5),
               ("tree_topk", 3)),
        crash=Crash("ValueError", "retract_decode", LAST_REQUEST_OOM)),
    # The radix prefix cache's bugs (issue 42; docs/upstream-radix-sharing.md section 4):
    # each applies in the radix cells only, where a request holds a prefix of the tree.
    Bug("B26", "a release that keeps its tree lock",
        "#32170 (open, 2026-07-23: a PD decode release moved protected_size_ with no lock "
        "taken; the lock walk and the release must pair)",
        "a finish, abort or retraction releases a request that holds a lock on its prefix "
        "node: the node stays locked with no holder, protected forever (never evictable)",
        "release_kv_cache drops the request's lock without dec_lock_ref", ("RX2",),
        lambda cell: cell.radix, radix=True,
        representative_cells=_RADIX_CELLS),
    Bug("B27", "a release that frees its prefix's pages",
        "#32170 (open: a PD decode release freed [0, cache_protected_len), the tree's "
        "slots); #11351 (merged 2025-10-09: release_req routed through "
        "cache_finished_req(is_insert=False))",
        "a request holding a prefix of the tree (matched, or checkpointed at its prefill "
        "completion) is released: its row's pages from 0 are freed, the tree's with them",
        "the release frees the row's pages from 0, not from cache_protected_len",
        ("RX1",), lambda cell: cell.radix, radix=True,
        representative_cells=_RADIX_CELLS),
    Bug("B28", "a release that frees from the admission's match",
        "#13714 (merged 2025-11-21: cache_protected_len introduced, apart from the match's "
        "prefix); #38355 (open, 2026-09-07: chunk pages inserted mid-prefill freed by a "
        "retract or abort)",
        "a checkpoint (a chunk's stash, the prefill's completion) advanced the protected "
        "prefix past what the admission matched; the release frees from the match, so the "
        "pages the checkpoint gave the tree are freed too",
        "the release frees from the admission's matched length, not cache_protected_len",
        ("RX1",), lambda cell: cell.radix, radix=True,
        representative_cells=_RADIX_CELLS),
    Bug("B29", "a checkpoint that frees duplicates without repointing the row",
        "sgl-project/mini-sglang #142 (open, 2026-07-08: duplicate prefix pages freed, the "
        "page table still naming them: a use after free)",
        "two requests of one family prefill the same prompt; the second's checkpoint finds "
        "the pages already in the tree, frees its own copies and leaves its row on them",
        "checkpoint_into_tree frees the duplicates and skips the row repoint",
        ("RX4", "RX1"), lambda cell: cell.radix, radix=True,
        # A chain's duplicate needs its two requests prefilled together: gpu_impl's search
        # missed it at some seeds (2 of 6); the tree cell's kill came at every seed tried.
        representative_cells=("ov-p1-none-radix", "ov-p1-v2tree-cpu-honest-radix")),
    Bug("B30", "a checkpoint that keeps the lock on the node before the insert",
        "#40681 (open, 2026-09-22: PD + EAGLE: inserted nodes left unlocked while they "
        "alias the request's slots)",
        "a checkpoint inserts past the request's prefix and moves cache_protected_len to the "
        "insert's end, but the lock stays where it was: the new nodes are evictable while "
        "the request reads them",
        "checkpoint_into_tree neither drops the old lock nor takes the new node's",
        ("RX4", "RX2"), lambda cell: cell.radix, radix=True,
        representative_cells=_RADIX_CELLS),
    Bug("B31", "a lock walk that skips the node itself",
        "sgl-project/mini-sglang #52 (merged 2025-12-29: lock_handle moved to the parent "
        "before counting, so the matched node stayed at ref_count 0 and evictable)",
        "a request locks a prefix node (admission, checkpoint): its ancestors are counted, "
        "the node itself is not, so it can be evicted under the request",
        "the tree's lock and unlock walks start at the node's parent", ("RX2",),
        lambda cell: cell.radix, radix=True, not_in_z3=_NO_NODES_IN_BMC,
        representative_cells=_RADIX_CELLS),
    # A finish only: a live holder's path would show RX5 first (the partial page's key).
    Bug("B32", "a finish inserts a key not cut to whole pages",
        "#23107 (merged 2026-04-17: the insert entry cuts the key, RadixKey.page_aligned, and "
        "slices the values to it); #28692 (open, 2026-06-19: MambaRadixCache matched an "
        "uncut key and built an invalid node); #10637 (merged 2025-09-19: the key cut on "
        "pages > 1)",
        "on pages > 1 a finish's checkpoint hands the tree its key uncut with the values of "
        "the whole pages: the leaf's key runs past its pages",
        "cache_finished_req's insert takes the uncut key", ("RX6", "RX5"),
        lambda cell: cell.radix and cell.page_size > 1, radix=True,
        not_in_z3=_NO_NODES_IN_BMC, representative_cells=_PAGED_RADIX_CELLS),
    Bug("B33", "EAGLE's tree keyed by tokens, not bigrams",
        "#10846 (merged 2025-09-24: with EAGLE the tree keys (t[i], t[i+1]) pairs, since the "
        "draft's KV at a position depends on the next token; acceptance fell with the cache "
        "on before it)",
        "a speculative cell's tree keys plain tokens: a prefix is shared between prompts "
        "whose draft KV differs, and a hit is not the request's own (bigram) key",
        "the tree is built with is_eagle False in speculative cells", ("RX5", "RX7"),
        lambda cell: cell.radix and cell.is_spec, radix=True, not_in_z3=_NO_NODES_IN_BMC,
        representative_cells=("ov-p1-v2chain-cpu-honest-radix",
                              "ov-p1-v2tree-cpu-honest-radix")),
    # The unit slip of #10637 (key against value lengths); here pages against tokens.
    Bug("B34", "an insert adds another unit to the evictable size",
        "#10637 (merged 2025-09-19: evictable_size_ moved by the key's length on one side "
        "and the value's on the other); UbiquitousLearning/mllm #656 (open, 2026-03-20: "
        "evictable + protected drifted from the tree's size)",
        "on pages > 1 a checkpoint or a finish inserts a new leaf: its page count is added "
        "to the evictable size, where the lock walks and eviction move its token count",
        "insert adds len(leaf.pages), not len(leaf.key), to evictable_size", ("RX3",),
        lambda cell: cell.radix and cell.page_size > 1, radix=True,
        not_in_z3=_NO_NODES_IN_BMC, representative_cells=_PAGED_RADIX_CELLS),
    Bug("B35", "a flush blind to the batch in flight",
        "#12107 (merged 2025-10-25: flush_cache's idle check missed the overlap scheduler's "
        "last batch and queued result; the request released later held a node of the old "
        "tree); #27446 (merged 2026-06-06: the same under pipeline parallelism)",
        "flush_cache right after a prefill is launched: the waiting queue and the running "
        "batch are empty, the prefilled requests are only in the batch in flight; the tree "
        "is reset and the pools cleared under them",
        "is_fully_idle checks the running batch, the chunked request and the waiting queue, "
        "not the last batch or the result queue", ("RX8", "RX1"),
        lambda cell: cell.radix, radix=True, representative_cells=_RADIX_CELLS),
    Bug("B36", "a retracted request re-prefilled from a stale prefix offset",
        "issue 43's scenario (no upstream report found): 0.5.23's Req.reset_for_retract "
        "clears prefix_len and extend_end (schedule_batch.py:2054, :2064); without that the "
        "re-prefill's writes start at the old offset",
        "a request prefilled and decoding is retracted, then re-admitted: its extend "
        "[0, fill) writes only [old prefill end, fill), the row allocated and owned in full",
        "reset_for_retract keeps prefix_len (the last prefill's end) and the re-admission "
        "starts the forward's extend writes there (cache_protected_len and the ghost are "
        "right); the page it gets back may still hold its own earlier holding's writes",
        ("KV14",), lambda cell: True,
        not_in_z3="the Z3 model keeps no KV contents (which write a slot holds)"),
    # A request lost to the scheduler (issue 43): the retraction's re-queue is the one road
    # back from the running batch (scheduler.py:4539-4540).
    Bug("B37", "a retracted request that leaves every queue",
        "no report of the silent drop found; #37260 (open, 2026-08-31) is the same road "
        "refusing: _add_request_to_queue's queued-request limit answers a retracted "
        "request 503 instead of re-queueing it (unreachable here: no max_queued_requests)",
        "a retraction (memory pressure or forced) releases a running request and takes it "
        "out of the running batch; it is in no queue, batch or slot, unfinished, and never "
        "runs again",
        "retract_decode's caller skips the re-queue of the retracted requests", ("RP10",),
        lambda cell: True,
        representative_cells=("ov-p1-none", "nov-p4-none", "ov-p1-v2chain-cpu-honest"),
        not_in_z3="the BMC's waiting queue is each request's waiting flag "
                  "(proofs/bmc_checks.py _membership_facts): a request out of the queue "
                  "with the flag set has no encoding, and RP10 no Z3 predicate"),
    # Admission's own inputs (issue 43): KV11 judges the scheduler's running load against
    # itself; KV13 re-derives it from the requests.
    Bug("B38", "finished requests still counted as running load at admission",
        "the family of #22518 (open, 2026-04-10: under overlap a prefill-only running "
        "batch kept its finished requests and its latch, and admission stalled; #22596, "
        "open, its fix) and #20273 (merged 2026-03-10: requests leaked into running_batch, "
        "never cleaned up, stalled admission at max_running_requests); 0.5.23 filters the "
        "running batch at every step, before PrefillAdder sums it (scheduler.py:3963-3968; "
        "the reference's realignment A10)",
        "a running request finishes early (EOS) with max_new_tokens left; at the next "
        "admission a waiting request fits the KV its departure left, with a row free",
        "the admission sums the remaining max_new_tokens x new_token_ratio of the requests "
        "the step's filter dropped as finished, besides the running batch's", ("KV13",),
        lambda cell: not cell.overshoot,
        representative_cells=("ov-p1-none", "nov-p1-none"),
        not_in_z3="KV11 and KV13 have no Z3 predicate (proofs/claims.py): the BMC's "
                  "admission meets only the state claims, which an admission that admits too "
                  "little leaves true"),
    Bug("B39", "a pause that forgets the just-prefilled requests",
        "no report of this exact mistake; the path's history: #20273 (merged 2026-04: the "
        "last batch's merge leaked prefill requests into the running batch on prefill "
        "nodes), #30675 (merged 2026-07-09: the retract path rewritten as request-level "
        "release and re-queue, which lists the unmerged extend batch, scheduler.py:5849-5861)",
        "pause_generation(mode=\"retract\") right after a prefill's launch: its requests are "
        "only in the last (extend) batch, which the pause drops (last_batch = None)",
        "pause_generation retracts the running batch and the chunked request but not the "
        "unmerged extend batch's requests: they keep their KV and are in no queue",
        ("RP10",), lambda cell: True,
        not_in_z3="the Z3 model has no pause_generation (and RP10 no Z3 predicate)"),
)

def get_bug(bug_id: str) -> Bug:
    for bug in BUGS:
        if bug.id == bug_id:
            return bug
    raise KeyError(f"unknown bug {bug_id!r}; known: {', '.join(BUG_IDS)}")


def get_bugs_expecting(faults: Iterable[str], crashed: Crash | None) -> list[str]:
    """The bugs of ``faults`` whose entry expects exactly ``crashed``: a kill by crash."""
    return [bug_id for bug_id in faults
            if (crash := get_bug(bug_id).crash) is not None and crash.matches(crashed)]

