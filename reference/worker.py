"""The model forward as an environment: ForwardBatch.init_new and a stand-in worker.

The worker writes KV exactly where the real model would (through req_to_token),
takes accept lengths and EOS from the environment's choices, and publishes
new_seq_lens through the ``on_publish`` callback between verify and
draft-extend (multi_layer_eagle_worker_v2.py). A write outside what the request
owns is recorded as a :class:`KvWrite` fault, so an accounting error shows up
as a wrong write instead of silently passing; a good write stores its request and
position in ``Runtime.kv_cache`` (a fault stores nothing), as gpu_impl's slot buffer
does, for the differential's ``kv_contents``. The WAR fence's read-done event
follows the last ``req_to_token`` read: in a spec-v2 decode the draft-extend's
attention metadata, after the publish (the ``early_fence`` proposal: before it);
a spec prefill records none, as EAGLE's does not.

Upstream: ``model_executor/forward_batch_info.py`` (init_new),
``speculative/eagle_worker_v2.py`` / ``multi_layer_eagle_worker_v2.py``
(forward_batch_generation), ``speculative/eagle_info_v2.py``
(prepare_for_extend_to_fill_draft_kvcache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import DeviceTensor, Runtime
from overlap_spec.reference.schedule_batch import ScheduleBatch
from overlap_spec.spec.relation import forward_decode, forward_extend
from overlap_spec.spec.state import (
    EOS_TOKEN,
    IterationChoices,
    KvWrite,
    PublishRecord,
    get_env_tokens,
)
from overlap_spec.spec.transitions import (
    compute_draft_extend_seq_lens,
    compute_draft_writes,
    compute_kv_writer,
    compute_verify_new_seq_len,
)
from overlap_spec.spec.units import StepId

READ_DONE = "shared_read_done"


@dataclass
class ForwardBatch:
    purpose: str
    draft_tokens: int
    batch_size: int
    seq_lens: list[int]
    seq_lens_cpu: list[int] | None
    seq_lens_sum: int | None


def init_new(rt: Runtime, batch: ScheduleBatch, purpose: str,
             seq_lens_cpu_cache: list[int] | None = None) -> ForwardBatch:
    """Build the ForwardBatch; backfill SB.seq_lens_sum when it is None (upstream does).

    ``seq_lens`` is aliased from SB, so the forward stream reads SB's tensor.
    """
    seq_lens = rt.read_tensor(rt.forward_stream, batch.seq_lens, f"init_new({purpose})")
    rt.read_tensor(rt.forward_stream, batch.req_pool_indices, f"init_new({purpose})")
    cpu = seq_lens_cpu_cache if seq_lens_cpu_cache is not None else batch.seq_lens_cpu
    if batch.seq_lens_sum is None and cpu is not None and not rt.has_fault("B2"):
        batch.seq_lens_sum = sum(cpu)
    return ForwardBatch(purpose, rt.shape.draft_tokens, len(seq_lens), seq_lens,
                        None if cpu is None else list(cpu), batch.seq_lens_sum)


@dataclass
class ForwardResult:
    step: StepId
    forward_mode: str
    reqs: list[Req]
    stride: int
    next_token_ids: list[int]  # stride tokens per request
    accept_lens: list[int]
    eos_at: list[int | None]  # index of EOS inside the request's run, if any
    new_seq_lens: list[int]
    publishes: list[PublishRecord] = field(default_factory=list)
    kv_write_faults: list[KvWrite] = field(default_factory=list)
    copy_done: str = ""
    decode_rows: int = 0  # a mixed batch's decode rows, its last ones
    decode_mode: str = "decode"  # theirs: "tail" for a spec decode (its pending bonus token)

    def get_row_mode(self, j: int) -> str:
        """The forward row ``j`` had: a mixed batch's last ``decode_rows`` decoded."""
        if self.forward_mode != "mixed":
            return self.forward_mode
        return self.decode_mode if j >= len(self.reqs) - self.decode_rows else "extend"


OnPublish = Callable[[list[int]], None]
Emit = Callable[..., None]
KvContent = tuple[int, int] | None  # a KV slot's (writer, position): compute_kv_writer
KvWrites = list[tuple[int, KvContent]]  # (slot, content) a forward stores


class ModelWorker:
    def __init__(self, rt: Runtime, emit: Emit) -> None:
        self.rt = rt
        self.emit = emit
        # The runner's ``shared_read_done_event``: set by a forward that publishes one,
        # taken (and cleared) by the scheduler's WAR barrier, which without it waits on
        # the whole forward stream (0.5.23's scheduler.py:2012-2023).
        self.shared_read_done_event: str | None = None

    def _record_reads_done(self) -> None:
        """The forward's last read of req_to_token: the fine-grained WAR fence point
        (#28363 read-done event).

        Non-spec: after the KV writes, before the publish and the stash. Spec-v2 decode:
        after the draft-extend's attention metadata, the last req_to_token read, so after
        the publish and before the stash (the ``early_fence`` proposal: before the publish).
        """
        self.rt.hb.record(READ_DONE, self.rt.forward_stream)
        self.shared_read_done_event = READ_DONE

    def _write_kv(self, req: Req, start: int, end: int, faults: list[KvWrite],
                  writes: KvWrites) -> None:
        """The forward writes KV for positions [start, end) through req_to_token."""
        self._write_kv_at(req, range(start, end), faults, writes)

    def _write_kv_at(self, req: Req, positions: Iterable[int], faults: list[KvWrite],
                     writes: KvWrites, sources: Sequence[int | None] = ()) -> None:
        """The forward writes KV for ``positions`` through req_to_token.

        A good write (a row, inside it and below ``kv_allocated_len``, a slot of the
        request's pages) goes to ``writes`` as (slot, content): the request and the
        position, or where ``sources`` names a position, that position's content read now
        (a tail copy, ``move_kv_cache``; through an unset entry, None). The caller stores
        them with :meth:`_store` once every read of the forward is done, as gpu_impl's
        batched writes do; a fault writes nothing (gpu_impl's trash slot).
        """
        rt = self.rt
        p = rt.config.page_size
        positions = list(positions)
        if req.req_pool_idx is None:
            faults.append(KvWrite(req.rid, min(positions), None, "request holds no pool row"))
            return
        rt.hb.read(rt.forward_stream, ("req_to_token", req.req_pool_idx), "forward KV write")
        row = rt.req_to_token.rows[req.req_pool_idx]
        for k, position in enumerate(positions):
            slot = row[position] if 0 <= position < len(row) else -1
            if position < 0 or position >= req.kv_allocated_len:
                faults.append(KvWrite(req.rid, position, slot, "beyond kv_allocated_len"))
            elif slot < 0 or slot // p not in req.pages:
                faults.append(KvWrite(req.rid, position, slot, "slot not owned by the request"))
            else:
                source = sources[k] if k < len(sources) else None
                writes.append((slot, (compute_kv_writer(req.rid, req.ghost.epoch), position)
                               if source is None else self._read_kv(row, source)))

    def _read_kv(self, row: list[int], position: int) -> KvContent:
        """The content of the row's ``position`` (clamped into the row, as gpu_impl's
        gather is); None through an unset entry or where nothing was written."""
        slot = row[min(max(position, 0), len(row) - 1)]
        return self.rt.kv_cache.get(slot) if slot >= 0 else None

    def _store(self, writes: KvWrites) -> None:
        """The forward's good writes land in the KV slots, in order."""
        for slot, content in writes:
            self.rt.kv_cache[slot] = content

    def forward_batch_generation(self, batch: ScheduleBatch, step: StepId,
                                 choices: IterationChoices, on_publish: OnPublish) -> ForwardResult:
        cfg = self.rt.config
        if batch.forward_mode in ("extend", "mixed"):
            return self._forward_extend(batch, step, choices, on_publish)
        if cfg.cell.is_spec:
            return self._forward_decode_spec_v2(batch, step, choices, on_publish)
        return self._forward_decode(batch, step, choices)

    def _sample(self, batch: ScheduleBatch, j: int, run_len: int, choices: IterationChoices,
                stride: int, position: int) -> tuple[list[int], int | None]:
        """``stride`` tokens of the stand-in model for batch member ``j``, the first at
        absolute ``position``, chained from the forward's input token (``input_ids``: the
        relayed one under overlap); EOS where the environment puts it."""
        assert batch.input_ids is not None, "the forward runs without input_ids"
        tokens = get_env_tokens(batch.reqs[j].rid, position, batch.input_ids[j], stride)
        eos_at = choices.get_eos_index(j, run_len)
        if eos_at is not None:
            tokens[eos_at] = EOS_TOKEN
        return tokens, eos_at

    def _forward_extend(self, batch: ScheduleBatch, step: StepId, choices: IterationChoices,
                        on_publish: OnPublish) -> ForwardResult:
        rt = self.rt
        fb = init_new(rt, batch, batch.forward_mode)
        self.emit("init_new", forward=fb, batch=batch)
        faults: list[KvWrite] = []
        writes: KvWrites = []
        tokens: list[int] = []
        eos: list[int | None] = []
        decode_rows = len(batch.decoding_reqs or ())
        for j, (req, fill_len) in enumerate(zip(batch.reqs, fb.seq_lens, strict=True)):
            if batch.is_decode_row(j):  # a mixed batch's decode: the token being processed
                self._write_kv(req, fill_len - 1, fill_len, faults, writes)
                req.apply(forward_decode, step, 1)
            else:  # the chunk (or all)
                self._write_kv(req, req.prefix_len, fill_len, faults, writes)
                req.apply(forward_extend, step, fill_len)
            run, eos_at = self._sample(batch, j, 1, choices, 1, fill_len)
            tokens += run
            eos.append(eos_at)
        self._store(writes)
        if not rt.config.cell.is_spec or rt.config.cell.early_fence:
            self._record_reads_done()
        if rt.config.cell.is_spec:
            # The spec extend publishes s (the prompt length). EAGLE's prefill records no
            # read-done (supports_prefill_shared_read_done() is False, spec_info.py:138),
            # so the release's barrier falls back to S.wait_stream(F) after it.
            on_publish(list(fb.seq_lens))
        spec = rt.config.cell.is_spec  # a spec extend returns its seq_lens as they are
        new_seq_lens = [s + (batch.is_decode_row(j) and not spec)
                        for j, s in enumerate(fb.seq_lens)]
        return ForwardResult(step, batch.forward_mode, list(batch.reqs), 1, tokens,
                             [1] * len(batch.reqs), eos, new_seq_lens, kv_write_faults=faults,
                             decode_rows=decode_rows, decode_mode="tail" if spec else "decode")

    def _forward_decode(self, batch: ScheduleBatch, step: StepId,
                        choices: IterationChoices) -> ForwardResult:
        rt = self.rt
        fb = init_new(rt, batch, "decode")
        self.emit("init_new", forward=fb, batch=batch)
        faults: list[KvWrite] = []
        writes: KvWrites = []
        tokens: list[int] = []
        eos: list[int | None] = []
        for j, (req, seq_len) in enumerate(zip(batch.reqs, fb.seq_lens, strict=True)):
            # The token being processed.
            self._write_kv(req, seq_len - 1, seq_len, faults, writes)
            req.apply(forward_decode, step, 1)
            run, eos_at = self._sample(batch, j, 1, choices, 1, seq_len)
            tokens += run
            eos.append(eos_at)
        self._store(writes)
        self._record_reads_done()
        return ForwardResult(step, "decode", list(batch.reqs), 1, tokens,
                             [1] * len(batch.reqs), eos, [s + 1 for s in fb.seq_lens],
                             kv_write_faults=faults)

    def _forward_decode_spec_v2(self, batch: ScheduleBatch, step: StepId,
                                choices: IterationChoices, on_publish: OnPublish) -> ForwardResult:
        rt = self.rt
        shape = rt.shape
        draft = init_new(rt, batch, "draft")
        self.emit("init_new", forward=draft, batch=batch)
        # Verify copies seq_lens_cpu / seq_lens_sum from SB (TBO reads them).
        verify = init_new(rt, batch, "verify")
        self.emit("init_new", forward=verify, batch=batch)
        faults: list[KvWrite] = []
        # gpu_impl writes every request's draft (its tail copies read first), then every
        # request's verify: the contents are stored in that order after the loop.
        drafts: KvWrites = []
        verifies: KvWrites = []
        tokens: list[int] = []
        accept_lens: list[int] = []
        eos: list[int | None] = []
        new_seq_lens: list[int] = []
        stride = shape.draft_tokens
        for j, (req, seq_len) in enumerate(zip(batch.reqs, verify.seq_lens, strict=True)):
            slots, copies = compute_draft_writes(seq_len, shape, rt.config.page_size)
            self._write_kv_at(req, slots + [target for target, _ in copies], faults, drafts,
                              [None] * len(slots) + [source for _, source in copies])
            self._write_kv(req, seq_len, seq_len + shape.draft_tokens, faults, verifies)
            accept = choices.get_accept_len(j, shape.max_accept_len)
            req.apply(forward_decode, step, accept)
            # The bonus token sits at seq_len; the run starts after it.
            run, eos_at = self._sample(batch, j, accept, choices, stride, seq_len + 1)
            tokens += run
            accept_lens.append(accept)
            eos.append(eos_at)
            new_seq_lens.append(compute_verify_new_seq_len(seq_len, accept))
        self._store(drafts + verifies)
        early_fence = rt.config.cell.early_fence
        if early_fence:
            self._record_reads_done()
        on_publish(new_seq_lens)  # between verify and draft_extend
        self._draft_extend(batch)
        if not early_fence:  # the release: the draft runner's event, after draft-extend
            self._record_reads_done()
        return ForwardResult(step, "decode", list(batch.reqs), stride, tokens, accept_lens, eos,
                             new_seq_lens, kv_write_faults=faults)

    def _draft_extend(self, batch: ScheduleBatch) -> None:
        """prepare_for_extend_to_fill_draft_kvcache: +D_tok on the ForwardBatch only."""
        rt = self.rt
        fb = init_new(rt, batch, "draft_extend")
        # The attention metadata (init_forward_metadata_out_graph) re-reads each row's
        # req_to_token entries after the publish. The early fence's premise is a
        # draft-extend that does not, which is what its cell models.
        if not rt.config.cell.early_fence:
            for req in batch.reqs:
                if req.req_pool_idx is not None:
                    rt.hb.read(rt.forward_stream, ("req_to_token", req.req_pool_idx),
                               "draft_extend attention metadata")
        d_tok = rt.shape.draft_tokens
        fb.seq_lens = list(compute_draft_extend_seq_lens(tuple(fb.seq_lens), d_tok))
        if rt.has_fault("B7"):
            batch.seq_lens = DeviceTensor(batch.seq_lens.tensor_id, list(fb.seq_lens))
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = [s + d_tok for s in batch.seq_lens_cpu]
        if fb.seq_lens_cpu is not None:
            fb.seq_lens_cpu = [s + d_tok for s in fb.seq_lens_cpu]
            fb.seq_lens_sum = sum(fb.seq_lens_cpu)
        self.emit("draft_extend", forward=fb, batch=batch)
