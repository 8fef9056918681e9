"""The model forward as an environment, in torch: ForwardBatch.init_new and a stand-in worker.

Upstream: ``model_executor/forward_batch_info.py`` (``ForwardBatch.init_new``),
``speculative/eagle_worker_v2.py`` / ``multi_layer_eagle_worker_v2.py``
(``forward_batch_generation``: draft, verify, ``on_publish``, draft-extend),
``speculative/eagle_info_v2.py`` (``prepare_for_extend_to_fill_draft_kvcache``).

Everything here runs on the forward stream (the schedule stream without overlap). The
worker writes the KV cache exactly where the real model would, through ``req_to_token``
gathers at the positions the reference worker writes (prefill ``[prefix_len, end)``,
``[0, fill_len)`` unless a chunk continues; non-spec decode ``seq_len - 1``; spec draft
``[s, s + topk * steps)``, a tree's on pages > 1 the page-aligned branch slots and tail
copies of ``compute_draft_writes``, and verify ``[s, s + D_tok)``). A mixed batch runs the extend
forward: its prefill rows as a prefill's, its decode rows as a decode's (``[s - 1, s)``);
in a spec cell those are tails, which run one token from their pending bonus token.
A write through a -1 entry, past ``kv_allocated_len`` or into a page another request owns
is masked into the trash slot and counted as a kv_write_fault, all with tensor ops; a
request that holds no pool row counts one fault per write, as in the reference. A good
write stores its request and position (``memory.py``'s content model), which the
differential compares with the reference's (``RequestState.kv_contents``).

In a radix cell a request's row below its ``cache_protected_len`` holds the tree's pages
(``page_owner`` :data:`~gpu_impl.memory.TREE_OWNER`): read, never written, so a write into
one is a fault. One exception keeps the release's order, as the reference does
(``tests/test_radix_reference.py::test_a_mixed_decode_writes_below_the_checkpoint_it_
follows``): a mixed batch's decode row writes the token ``mix_with_running`` set its
``extend_end`` past, which its prefill's checkpoint may already have keyed into the tree.
The reference, which asks only whether the page is in the request's row, flags no write
into its own tree pages at all; a correct run makes no other such write.

The environment's choices (accept lengths, EOS) arrive by H2D copies enqueued on the
forward stream, so nothing the schedule stream owns has to outlive them. The read-done
event of the fine WAR fence (#28363) is recorded after the last ``req_to_token`` read:
non-spec, before the publish and the stash; in a spec-v2 decode, after the draft-extend's
attention metadata re-reads the rows, so after the publish and before the stash (the
``early_fence`` proposal: before the publish, with no re-read). A spec prefill records
none (EAGLE's does not), and the scheduler's barrier waits on the whole forward stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from overlap_spec.gpu_impl.memory import KV_POSITION_STRIDE, TREE_OWNER
from overlap_spec.gpu_impl.req import compute_env_tokens_tensor, get_env_chain_coefficients
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.gpu_impl.schedule_batch import ScheduleBatch
from overlap_spec.spec.state import EOS_TOKEN, IterationChoices
from overlap_spec.spec.transitions import compute_kv_writer
from overlap_spec.spec.units import StepId

READ_DONE = "shared_read_done"  # reference.worker.READ_DONE


@dataclass
class ForwardBatch:
    """What the model sees; ``seq_lens`` and ``req_pool_indices`` alias the ScheduleBatch's."""

    purpose: str  # "extend" | "mixed" | "decode" | "draft" | "verify" | "draft_extend"
    draft_tokens: int
    batch_size: int
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    seq_lens_sum: int | None

    @classmethod
    def init_new(cls, rt: Runtime, batch: ScheduleBatch, purpose: str,
                 seq_lens_cpu_cache: torch.Tensor | None = None) -> ForwardBatch:
        """Alias the batch tensors; backfill SB.seq_lens_sum when it is None (B2: don't)."""
        cpu = seq_lens_cpu_cache if seq_lens_cpu_cache is not None else batch.seq_lens_cpu
        if batch.seq_lens_sum is None and cpu is not None and not rt.has_fault("B2"):
            batch.seq_lens_sum = sum(rt.streams.to_list(cpu, "init_new seq_lens_sum"))
        if cpu is not None and batch.seq_lens_sum is None:
            # The attention backend sizes its flattened KV-index buffer by seq_lens_sum
            # (FlashInfer's init_forward_metadata); a None here is the #25818 crash (B2).
            raise SeqLensSumMissing(f"{purpose}: seq_lens_sum is None with a CPU mirror")
        return cls(purpose, rt.shape.draft_tokens, len(batch.reqs), batch.seq_lens,
                   batch.req_pool_indices, cpu, batch.seq_lens_sum)


class SeqLensSumMissing(TypeError):
    """A consumer of ``seq_lens_sum`` got None (what upstream's backend crashed on)."""


@dataclass
class ForwardResult:
    step: StepId
    forward_mode: str
    stride: int
    next_token_ids: torch.Tensor  # device [bs * stride]
    accept_lens: torch.Tensor  # device [bs]
    eos_at: list[int | None]  # index of EOS inside each request's run (the environment's)
    new_seq_lens: torch.Tensor  # device [bs]
    kv_write_faults: torch.Tensor  # device scalar: faulty writes of this forward
    next_token_ids_cpu: torch.Tensor | None = None  # host copies, valid after copy_done
    accept_lens_cpu: torch.Tensor | None = None
    copy_done: str = ""
    decode_rows: int = 0  # a mixed batch's decode rows: its last ones
    decode_mode: str = "decode"  # theirs: "tail" for a spec decode (its pending bonus token)

    def get_row_mode(self, j: int) -> str:
        """The forward row ``j`` had: ``decode_mode`` for a mixed batch's last
        ``decode_rows``."""
        if self.forward_mode != "mixed":
            return self.forward_mode
        return self.decode_mode if j >= len(self.eos_at) - self.decode_rows else "extend"


OnPublish = Callable[[torch.Tensor], None]


@dataclass
class RequestInputs:
    """Per-request host facts the stand-in forward needs, copied H2D on the forward stream."""

    rid: torch.Tensor
    writer: torch.Tensor  # compute_kv_writer: what its KV writes name
    kv_allocated_len: torch.Tensor
    holds_row: torch.Tensor  # bool
    # A radix cell's mixed batch: the rows that may write a tree page of their own row
    # (its decode rows; see the module header). None elsewhere: no row may.
    tree_writable: torch.Tensor | None = None  # bool

    def is_own(self, owner: torch.Tensor) -> torch.Tensor:
        """Whether each slot's ``owner`` ([bs, W]) lets its row write it."""
        own = owner == self.rid[:, None]
        if self.tree_writable is None:
            return own
        return own | ((owner == TREE_OWNER) & self.tree_writable[:, None])


class ModelWorker:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        # The runner's ``shared_read_done_event``, taken and cleared by the WAR barrier.
        self.shared_read_done_event: str | None = None

    def forward_batch_generation(self, batch: ScheduleBatch, step: StepId,
                                 choices: IterationChoices, on_publish: OnPublish) -> ForwardResult:
        rt = self.rt
        with rt.streams.use(rt.forward_stream):
            inputs = self._get_request_inputs(batch)
            if batch.forward_mode in ("extend", "mixed"):
                return self._forward_extend(batch, step, choices, inputs, on_publish)
            if rt.config.cell.is_spec:
                return self._forward_decode_spec_v2(batch, step, choices, inputs, on_publish)
            return self._forward_decode(batch, step, choices, inputs)

    # -- pieces -------------------------------------------------------------------
    def _get_request_inputs(self, batch: ScheduleBatch) -> RequestInputs:
        streams = self.rt.streams
        stream = self.rt.forward_stream
        reqs = batch.reqs
        tree_writable = None
        if self.rt.config.cell.radix and batch.forward_mode == "mixed":
            tree_writable = streams.device_tensor(
                [batch.is_decode_row(j) for j in range(len(reqs))], stream) > 0
        # The request ids and the KV writers (compute_kv_writer) in one copy.
        ids = streams.device_tensor([req.rid for req in reqs]
                                    + [compute_kv_writer(req.rid, req.epoch) for req in reqs],
                                    stream)
        return RequestInputs(
            rid=ids[:len(reqs)], writer=ids[len(reqs):],
            kv_allocated_len=streams.device_tensor([req.kv_allocated_len for req in reqs],
                                                   stream),
            holds_row=streams.device_tensor([req.req_pool_idx is not None for req in reqs],
                                            stream) > 0,
            tree_writable=tree_writable,
        )

    def _write_kv(self, fb: ForwardBatch, inputs: RequestInputs, starts: torch.Tensor,
                  lengths: torch.Tensor, max_width: int) -> torch.Tensor:
        """Write KV for positions [starts, starts + lengths) per request; count bad writes.

        A position is written when its request holds a pool row, it lies inside the row
        and below ``kv_allocated_len``, its ``req_to_token`` entry is set and that slot's
        page is the request's own; every other wanted position of a request with a row is
        a fault, and a request without a row counts one. A written slot holds ``rid *
        KV_POSITION_STRIDE + position`` (who wrote which position: ``memory.py``, compared
        by the differential). Few tensor ops on purpose: on
        CPU each one is a launch the race detector follows (profiled: this function was
        two fifths of a differential run's launches).
        """
        rt = self.rt
        pool = rt.req_to_token_pool
        kv = rt.kv
        offsets = torch.arange(max_width, dtype=torch.int64, device=rt.streams.device)
        positions = starts[:, None] + offsets
        slots = pool.req_to_token[fb.req_pool_indices[:, None], positions.clamp(0, pool.width - 1)]
        # An unset entry (-1) reads page -1, any page: ``slots >= 0`` below masks it out.
        owner = kv.page_owner[slots // kv.page_size]
        # Past this offset a position is outside the row or the allocation (0: no row).
        end = (torch.minimum(lengths, inputs.kv_allocated_len.clamp(max=pool.width) - starts)
               * inputs.holds_row)
        live = (offsets < lengths[:, None]) & inputs.holds_row[:, None]
        good = ((offsets < end[:, None]) & (positions >= 0) & (slots >= 0)
                & inputs.is_own(owner))
        faults = (live ^ good).sum() + (~inputs.holds_row).sum()  # good is a subset of live
        target = torch.where(good, slots, kv.trash_slot)
        values = torch.add(positions, inputs.writer[:, None], alpha=KV_POSITION_STRIDE)  # one op
        kv.kv_cache.index_put_((target,), values)
        return faults

    def _write_kv_at(self, fb: ForwardBatch, inputs: RequestInputs, positions: torch.Tensor,
                     live: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """Write KV at ``positions`` ([bs, W]) where ``live``; count bad writes.

        :meth:`_write_kv`'s masking and fault count over any positions: a live position is
        written when the request holds a row, it lies inside the row and below
        ``kv_allocated_len``, and its entry is a slot of the request's own; every other
        live position is a fault, and a request without a row counts one (the reference's
        ``_write_kv_at``). Where ``sources`` (positions, [bs, W]) is >= 0 the write is a
        copy of that position's KV (``move_kv_cache``), read before anything is written
        (through an unset entry: ``UNWRITTEN_KV``); elsewhere the draft's own KV, its
        request and position as :meth:`_write_kv` stores them. No boolean indexing: the
        shapes never depend on data.
        """
        rt = self.rt
        pool = rt.req_to_token_pool
        kv = rt.kv
        rows = fb.req_pool_indices[:, None]
        slots = pool.req_to_token[rows, positions.clamp(0, pool.width - 1)]
        # An unset entry (-1) reads page -1, any page: ``slots >= 0`` below masks it out.
        owner = kv.page_owner[slots // kv.page_size]
        live = live & inputs.holds_row[:, None]
        end = inputs.kv_allocated_len.clamp(max=pool.width)[:, None]
        good = (live & (positions >= 0) & (positions < end) & (slots >= 0)
                & inputs.is_own(owner))
        faults = (live ^ good).sum() + (~inputs.holds_row).sum()  # good is a subset of live
        source_slots = pool.req_to_token[rows, sources.clamp(0, pool.width - 1)]
        # Through an unset entry a copy reads the slot no write reaches: UNWRITTEN_KV.
        copied = kv.kv_cache[torch.where(source_slots >= 0, source_slots, kv.unwritten_slot)]
        values = torch.where(sources >= 0, copied,
                             torch.add(positions, inputs.writer[:, None], alpha=KV_POSITION_STRIDE))
        kv.kv_cache.index_put_((torch.where(good, slots, kv.trash_slot),), values)
        return faults

    def _write_draft_paged_tree(self, fb: ForwardBatch, inputs: RequestInputs) -> torch.Tensor:
        """The draft of a tree on pages > 1 (``prepare_for_draft``, PR 26972): the positions
        of :func:`spec.transitions.compute_draft_writes`, from the device ``seq_lens``.

        With lp = s % page and span = ceil((lp + steps) / page) * page, branch t drafts at
        s + t * span + j; the partial last page's KV, [s - lp, s), is copied into the same
        lp holes of every other branch, s - lp + t * span + i (``duplicate_prefix_tail_to_
        draft_branches``). The copies take (topk - 1) * (page - 1) columns, the live ones
        ``i < lp``: a fixed shape, where the release selects with boolean masks.
        """
        rt = self.rt
        shape = rt.shape
        page, steps, topk = rt.config.page_size, shape.steps, shape.topk
        slots = [(t, j, 0) for t in range(topk) for j in range(steps)]
        copies = [(t, i, 1) for t in range(1, topk) for i in range(page - 1)]
        # Per column, broadcast over the batch: branch t, offset j or i, whether a copy.
        branch, offset, is_copy = (rt.streams.device_tensor(column, rt.forward_stream)
                                   for column in zip(*(slots + copies), strict=True))
        seq_lens = fb.seq_lens[:, None]
        lp = seq_lens % page
        base = seq_lens - lp
        span = (lp + (steps + page - 1)) // page * page
        # A draft slot sits at offset lp + j of its branch's region, a copy target at i.
        positions = base + branch * span + offset + (1 - is_copy) * lp
        live = (is_copy == 0) | (offset < lp)
        sources = torch.where(is_copy > 0, base + offset, -1)
        return self._write_kv_at(fb, inputs, positions, live, sources)

    def _sample(self, batch: ScheduleBatch, inputs: RequestInputs, positions: torch.Tensor,
                stride: int, eos_at: list[int | None]) -> torch.Tensor:
        """``stride`` tokens per request (flat) from the stand-in model, the first at
        ``positions``, chained from the forward's input token (``input_ids``: relayed under
        overlap); EOS where the environment put it.

        Built flat from the start: a view of a temporary would outlive the tensor the race
        detector tracks, and its accesses would then look like someone else's.
        """
        streams = self.rt.streams
        forward = self.rt.forward_stream
        assert batch.input_ids is not None, "the forward runs without input_ids"
        flat = torch.arange(len(eos_at) * stride, dtype=torch.int64, device=streams.device)
        owner = flat // stride
        offset = flat % stride
        g, s, t = (streams.device_tensor(c, forward)[offset]
                   for c in get_env_chain_coefficients(stride))
        tokens = compute_env_tokens_tensor(inputs.rid[owner], positions[owner],
                                           batch.input_ids[owner], g, s, t)
        eos = streams.device_tensor([-1 if e is None else e for e in eos_at], forward)
        return torch.where(offset == eos[owner], EOS_TOKEN, tokens)

    def _fill(self, fb: ForwardBatch, value: int) -> torch.Tensor:
        """A per-request constant on the forward stream (``torch.full``, not ``full_like``:
        the race detector tracks the lifetime of factory outputs, not of ``*_like`` ones)."""
        return torch.full((fb.batch_size,), value, dtype=torch.int64, device=self.rt.streams.device)

    def _record_reads_done(self) -> None:
        """The forward's last req_to_token read: the fine-grained WAR fence point."""
        self.rt.streams.record(READ_DONE, self.rt.forward_stream)
        self.shared_read_done_event = READ_DONE

    # -- forwards -----------------------------------------------------------------
    def _forward_extend(self, batch: ScheduleBatch, step: StepId, choices: IterationChoices,
                        inputs: RequestInputs, on_publish: OnPublish) -> ForwardResult:
        rt = self.rt
        fb = ForwardBatch.init_new(rt, batch, batch.forward_mode)
        assert fb.seq_lens_cpu is not None, "a prefill always carries its host lengths"
        ends = rt.streams.to_list(fb.seq_lens_cpu, "extend width")
        decode_rows = batch.get_decode_rows()
        # A mixed batch's decode rows were appended after its prefill rows.
        assert decode_rows == list(range(len(ends) - len(decode_rows), len(ends))), (
            f"decode rows {decode_rows} are not the last of {len(ends)}")
        # The chunk, [prefix_len, end): all of it from 0 unless a chunk continues; a mixed
        # batch's decode row writes the token being processed, [end - 1, end).
        prefixes = [end - 1 if j in decode_rows else req.prefix_len
                    for j, (req, end) in enumerate(zip(batch.reqs, ends, strict=True))]
        widest = max(end - prefix for end, prefix in zip(ends, prefixes, strict=True))
        if any(prefixes):
            starts = rt.streams.device_tensor(prefixes, rt.forward_stream)
            faults = self._write_kv(fb, inputs, starts, fb.seq_lens - starts, widest)
        else:
            faults = self._write_kv(fb, inputs, self._fill(fb, 0), fb.seq_lens, widest)
        eos_at = [choices.get_eos_index(j, 1) for j in range(len(batch.reqs))]
        tokens = self._sample(batch, inputs, fb.seq_lens, 1, eos_at)  # at fill_len
        spec = rt.config.cell.is_spec
        if not spec or rt.config.cell.early_fence:
            self._record_reads_done()  # EAGLE's prefill records none (spec_info.py:138)
        if decode_rows and not spec:  # a decode row advances past the token it processed
            advanced = rt.streams.device_tensor(
                [int(j in decode_rows) for j in range(len(ends))], rt.forward_stream)
            new_seq_lens = fb.seq_lens + advanced
        else:
            # A spec extend publishes its seq_lens as they are: the prompt length, and a
            # tail's length once its bonus slot is committed (the sampled token is the
            # next bonus, as after a verify).
            new_seq_lens = fb.seq_lens.clone()
        if spec:
            on_publish(new_seq_lens)
        return ForwardResult(step, batch.forward_mode, 1, tokens, self._fill(fb, 1), eos_at,
                             new_seq_lens, faults, decode_rows=len(decode_rows),
                             decode_mode="tail" if spec else "decode")

    def _forward_decode(self, batch: ScheduleBatch, step: StepId, choices: IterationChoices,
                        inputs: RequestInputs) -> ForwardResult:
        rt = self.rt
        fb = ForwardBatch.init_new(rt, batch, "decode")
        # The token being processed sits at column seq_len - 1.
        faults = self._write_kv(fb, inputs, fb.seq_lens - 1, self._fill(fb, 1), 1)
        eos_at = [choices.get_eos_index(j, 1) for j in range(len(batch.reqs))]
        tokens = self._sample(batch, inputs, fb.seq_lens, 1, eos_at)
        self._record_reads_done()
        new_seq_lens = fb.seq_lens + 1
        return ForwardResult(step, "decode", 1, tokens, self._fill(fb, 1), eos_at,
                             new_seq_lens, faults)

    def _forward_decode_spec_v2(self, batch: ScheduleBatch, step: StepId,
                                choices: IterationChoices, inputs: RequestInputs,
                                on_publish: OnPublish) -> ForwardResult:
        rt = self.rt
        shape = rt.shape
        ForwardBatch.init_new(rt, batch, "draft")
        # Verify copies seq_lens_cpu / seq_lens_sum from SB (TBO reads them).
        verify = ForwardBatch.init_new(rt, batch, "verify")
        if rt.config.page_size > 1 and shape.topk > 1:  # compute_draft_writes' page tree
            draft_faults = self._write_draft_paged_tree(verify, inputs)
            verify_lens = self._fill(verify, shape.draft_tokens)
        else:  # page 1, or a chain: [s, s + topk * steps)
            draft_width = shape.topk * shape.steps
            draft_lens = self._fill(verify, draft_width)
            verify_lens = self._fill(verify, shape.draft_tokens)
            draft_faults = self._write_kv(verify, inputs, verify.seq_lens, draft_lens,
                                          draft_width)
        faults = draft_faults + self._write_kv(verify, inputs, verify.seq_lens, verify_lens,
                                               shape.draft_tokens)
        accept = [choices.get_accept_len(j, shape.max_accept_len)
                  for j in range(len(batch.reqs))]
        accept_lens = rt.streams.device_tensor(accept, rt.forward_stream)
        eos_at = [choices.get_eos_index(j, a) for j, a in enumerate(accept)]
        # The bonus token sits at seq_len; the run starts after it.
        tokens = self._sample(batch, inputs, verify.seq_lens + 1, shape.draft_tokens, eos_at)
        new_seq_lens = verify.seq_lens + accept_lens  # compute_verify_new_seq_len, batched
        early_fence = rt.config.cell.early_fence
        if early_fence:
            self._record_reads_done()
        on_publish(new_seq_lens)  # between verify and draft-extend
        self._draft_extend(batch)
        if not early_fence:  # the release: the draft runner's event, after draft-extend
            self._record_reads_done()
        return ForwardResult(step, "decode", shape.draft_tokens, tokens, accept_lens, eos_at,
                             new_seq_lens, faults)

    def _draft_extend(self, batch: ScheduleBatch) -> None:
        """prepare_for_extend_to_fill_draft_kvcache: +D_tok on the ForwardBatch only.

        B7 adds it in place to the tensors the ForwardBatch aliases, i.e. to the
        ScheduleBatch's own ``seq_lens`` and ``seq_lens_cpu``; the isolation snapshot
        holds the same tensor objects, so restoring it does not undo the mutation.
        """
        rt = self.rt
        fb = ForwardBatch.init_new(rt, batch, "draft_extend")
        if not rt.config.cell.early_fence:
            # The attention metadata re-reads the rows after the publish (the early
            # fence's premise is a draft-extend that does not).
            rt.req_to_token_pool.req_to_token[fb.req_pool_indices]
        d_tok = rt.shape.draft_tokens
        host = rt.streams.on_host()
        if rt.has_fault("B7"):
            fb.seq_lens.add_(d_tok)
            if fb.seq_lens_cpu is not None:
                with host:
                    fb.seq_lens_cpu.add_(d_tok)
        else:
            fb.seq_lens = fb.seq_lens + d_tok
            if fb.seq_lens_cpu is not None:
                with host:
                    fb.seq_lens_cpu = fb.seq_lens_cpu + d_tok
        if fb.seq_lens_cpu is not None:
            fb.seq_lens_sum = sum(rt.streams.to_list(fb.seq_lens_cpu, "draft_extend sum"))
