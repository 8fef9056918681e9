"""The stand-in model worker: the environment the real scheduler runs against.

Upstream's ``tp_worker.forward_batch_generation`` (non-spec) and ``EAGLEWorkerV2``'s
(spec v2) need a model. This worker replaces only that: it takes accept lengths and EOS
positions from the environment's :class:`~spec.state.IterationChoices`, produces tokens,
publishes where ``eagle_worker_v2`` publishes (``on_publish(seq_lens)`` after a spec
prefill, ``on_publish(seq_lens + accept_lens)`` between verify and draft-extend; the
scheduler itself publishes ``seq_lens + 1`` for non-spec), writes each position's KV slot
through ``req_to_token`` and records every write outside what the request owns, and keeps
the ghost truth (:class:`spec.relation.Ghost`) beside each request, through the spec's
ghost transitions.

The ghost is the environment's own account (what it emitted, what KV it really wrote), kept
here and never read from a scheduler field it could get wrong.

The model is replaced; the ``ForwardBatch`` is not. Each launch hands the batch to the
release's ``ForwardBatch.init_new`` where its workers do (a spec decode: the draft's, then the
verify's through ``eagle_prepare_for_verify``, and after the publish the draft-extend's through
``prepare_for_draft_extend``), and the spec observes each (:mod:`upstream.forward_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlap_spec.spec.config import ModelConfig, SpecShape
from overlap_spec.spec.relation import ghost_forward_decode, ghost_forward_extend
from overlap_spec.spec.state import (
    EOS_TOKEN,
    IterationChoices,
    KvWrite,
    ObservationPoint,
    get_env_tokens,
)
from overlap_spec.spec.transitions import compute_draft_writes, compute_forward_write_width
from overlap_spec.spec.units import RequestId, StepId
from overlap_spec.upstream.forward_batch import StandInForwards, get_purpose

__all__ = ["EOS_TOKEN", "StandInWorker", "StepRecord"]


def get_input_tokens(batch: Any, reqs: list[Any], is_extend: bool, spec: bool,
                     decode_rows: int = 0) -> list[int]:
    """The token each request's forward runs on, where the release put it: a prefill's last
    input token (``origin_input_ids + output_ids``), a non-spec decode's ``input_ids``
    (gathered from the relay), a mixed batch's last ``decode_rows`` the tail of its
    ``input_ids`` (``output_tokens_buf[mix_running_indices]``), and a spec decode's
    ``spec_info.bonus_tokens`` (relayed under overlap, the last verify's without)."""
    if is_extend:
        tokens = [int(req.output_ids[-1]) if req.output_ids else int(req.origin_input_ids[-1])
                  for req in reqs]
        if decode_rows:
            if batch.input_ids is None:
                raise RuntimeError("the release launched a mixed batch without input_ids")
            tail = [int(v) for v in batch.input_ids.reshape(-1).tolist()[-decode_rows:]]
            tokens[len(tokens) - decode_rows:] = tail
        return tokens
    source = batch.spec_info.bonus_tokens if spec else batch.input_ids
    if source is None:
        raise RuntimeError("the release launched a decode without its input tokens "
                           "(input_ids / spec_info.bonus_tokens is None)")
    return [int(v) for v in source.reshape(-1).tolist()]


def get_paged_tree_gathers(seq_len: int, shape: SpecShape, page_size: int) -> list[int]:
    """The row positions a tree's draft on pages > 1 gathers with ``torch.gather`` from
    the request's row (``eagle_worker_common.py`` ``prepare_for_draft``): its draft slots,
    and in ``duplicate_prefix_tail_to_draft_branches`` the whole prefix-tail page and the
    whole first page of every other branch (masked to ``[0, lp)`` only after the gather).
    A gather past the row raises (a device assert on a GPU), where the page-1 kernels
    address the flat table."""
    slots, _ = compute_draft_writes(seq_len, shape, page_size)
    if shape.topk <= 1:
        return slots
    # Branch t's region starts lp before its first draft slot (compute_draft_writes).
    lp = seq_len % page_size
    starts = [slots[t * shape.steps] - lp for t in range(shape.topk)]
    return slots + [start + i for start in starts for i in range(page_size)]


@dataclass
class StepRecord:
    """What the environment produced for one launched batch (read at result time)."""

    step: StepId
    forward_mode: str
    rids: tuple[RequestId, ...]
    accept_lens: tuple[int, ...]
    eos_at: tuple[int | None, ...]
    stride: int


class StandInWorker:
    """What ``Scheduler`` reads off ``tp_worker`` plus the forward.

    ``host`` is the adapter (upstream/adapter.py): it maps upstream ``Req`` objects to the
    spec's request ids and ghosts, and builds the LAUNCH observation.
    """

    weight_load_time = 0.0
    graph_time_usage: dict[str, float] = {}

    def __init__(self, config: ModelConfig, model_runner: Any, model_config: Any,
                 host: Any) -> None:
        self.config = config
        self.model_runner = model_runner
        self.model_config = model_config
        self.host = host
        # The runners ForwardBatch.init_new is handed (upstream/forward_batch.py), built at
        # the first launch from the scheduler's own speculative algorithm.
        self.forwards: StandInForwards | None = None

    def __getattr__(self, item: str) -> Any:
        raise AttributeError(f"the stand-in worker has no {item!r} (upstream/worker.py)")

    def on_verify_complete_cpu(self, *args: Any, **kwargs: Any) -> None:
        return None  # the adaptive controller's feed; the rung is fixed in this tier

    def _get_forwards(self, batch: Any) -> StandInForwards:
        if self.forwards is None:
            self.forwards = StandInForwards(self.model_runner, self.config.page_size,
                                            batch.spec_algorithm)
        return self.forwards

    # ------------------------------------------------------------------ forward
    def forward_batch_generation(self, batch: Any, on_publish: Any = None,
                                 grammar_barrier: Any = None, **kwargs: Any) -> Any:
        import torch
        from sglang.srt.managers.utils import GenerationBatchResult

        host = self.host
        choices: IterationChoices = host.get_choices()
        step = host.next_step_id()
        is_extend = bool(batch.forward_mode.is_extend())
        reqs = list(batch.reqs)
        # A mixed batch's decode rows (decoding_reqs, after its prefill rows) decode.
        decoding = ({id(req) for req in batch.decoding_reqs or ()}
                    if batch.forward_mode.is_mixed() else set())
        rids = tuple(host.get_rid(req) for req in reqs)
        seq_lens = [int(v) for v in batch.seq_lens.tolist()]
        spec = self.config.cell.is_spec
        stride = 1 if (is_extend or not spec) else self.config.draft_tokens
        max_accept = self.config.max_accept_len
        accept_lens = [1 if is_extend else choices.get_accept_len(j, max_accept)
                       for j in range(len(reqs))]
        page = self.config.page_size
        shape = self.config.get_shape()  # the rung is fixed in this tier
        if is_extend:
            widths = [int(id(req) in decoding) for req in reqs]
        elif spec:
            widths = [int(compute_forward_write_width(shape, "decode", page, s))
                      for s in seq_lens]
        else:
            widths = [1] * len(reqs)
        host.on_launch(step, batch, reqs, seq_lens, widths, is_extend)
        inputs = get_input_tokens(batch, reqs, is_extend, spec, len(decoding))
        # The token at seq_len (decode) / after the fill (prefill) is the first emitted;
        # a spec run starts after the bonus token, which sits at seq_len.
        first = 1 if (spec and not is_extend) else 0
        runs = [get_env_tokens(int(rid), seq_len + first, inputs[j], stride)
                for j, (rid, seq_len) in enumerate(zip(rids, seq_lens, strict=True))]
        # A spec decode's draft: its slots and tail copies (eagle_worker_common.py
        # prepare_for_draft), a tree on pages > 1 first gathering from the row what the
        # release gathers there (raising past it, as its torch.gather does on CPU).
        drafts = ([compute_draft_writes(seq_len, shape, page) for seq_len in seq_lens]
                  if spec and not is_extend else [])
        if self.config.is_paged_tree and drafts:
            for req, seq_len in zip(reqs, seq_lens, strict=True):
                host.gather_row(req, get_paged_tree_gathers(seq_len, shape, page))
        forwards = self._get_forwards(batch)
        plan = None
        if is_extend or not spec:
            forward_batch = forwards.init_new(batch, spec)
            host.on_forward_batch(ObservationPoint.INIT_NEW, batch, forward_batch,
                                  get_purpose(forward_batch.forward_mode, False),
                                  shape.draft_tokens)
        else:
            forward_batch, plan = forwards.prepare_draft(
                batch, shape, [slots for slots, _ in drafts])
            host.on_forward_batch(ObservationPoint.INIT_NEW, batch, forward_batch,
                                  get_purpose(forward_batch.forward_mode, True),
                                  shape.draft_tokens)
            # The stand-in's draft proposes the environment's run after the bonus token
            # (the tree's root): the accept length says how much of it is taken.
            draft_tokens = torch.tensor([t for j, run in enumerate(runs)
                                         for t in [inputs[j], *run[:stride - 1]]],
                                        dtype=torch.int64)
            forward_batch = forwards.prepare_verify(batch, shape, draft_tokens, plan)
            host.on_forward_batch(ObservationPoint.INIT_NEW, batch, forward_batch,
                                  get_purpose(forward_batch.forward_mode, False),
                                  shape.draft_tokens)
        faults: list[KvWrite] = []
        tokens: list[int] = []
        eos_at: list[int | None] = []
        for j, (req, rid, seq_len) in enumerate(zip(reqs, rids, seq_lens, strict=True)):
            mixed_decode = id(req) in decoding
            if is_extend and not mixed_decode:
                # The prefill (or this chunk of it) writes from where earlier chunks
                # stopped (Req.prefix_len, 0 unless chunked) to the batch's seq_len.
                start, end = int(req.prefix_len), seq_len
            elif spec and not mixed_decode:
                # The draft's slots and its tail copies, then the verify window
                # [s, s + D_tok) (eagle_prepare_for_verify), as the reference writes them.
                slots, copies = drafts[j]
                faults += host.write_kv_at(req, rid, slots + [target for target, _ in copies])
                start, end = seq_len, seq_len + shape.draft_tokens
            else:  # the token being processed (a spec tail's: its pending bonus token)
                start, end = seq_len - 1, seq_len
            faults += host.write_kv(req, rid, start, end)
            if is_extend and not mixed_decode:
                host.update_ghost(req, ghost_forward_extend, step, len(req.origin_input_ids),
                                  seq_len)
            else:
                host.update_ghost(req, ghost_forward_decode, step, accept_lens[j])
            run = list(runs[j])
            eos = choices.get_eos_index(j, accept_lens[j])
            if eos is not None:
                run[eos] = EOS_TOKEN
            tokens += run
            eos_at.append(eos)
        mode = "mixed" if decoding else "extend" if is_extend else "decode"
        host.record_step(StepRecord(step, mode, rids,
                                    tuple(accept_lens), tuple(eos_at), stride), faults)
        ids = torch.tensor(tokens, dtype=torch.int64)
        if not spec:
            return GenerationBatchResult(next_token_ids=ids)
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        if is_extend:
            new_seq_lens = batch.seq_lens  # the batch's own tensor (eagle_worker_v2.py:1567)
            bonus = ids.to(torch.int32)
        else:
            new_seq_lens = batch.seq_lens + torch.tensor(accept_lens, dtype=batch.seq_lens.dtype)
            bonus = torch.tensor([tokens[j * stride + a - 1] for j, a in enumerate(accept_lens)],
                                 dtype=torch.int32)
        host.on_publish(step, reqs, seq_lens, None if is_extend else accept_lens,
                        [int(v) for v in new_seq_lens.tolist()])
        if on_publish is not None:
            on_publish(new_seq_lens)
        if not is_extend:
            # The draft-extend, after the publish (eagle_worker_v2.py:1490, :1503).
            forward_batch = forwards.prepare_draft_extend(
                batch, shape, torch.tensor(accept_lens, dtype=torch.int64), ids, plan)
            host.on_forward_batch(ObservationPoint.DRAFT_EXTEND, batch, forward_batch,
                                  get_purpose(forward_batch.forward_mode, True),
                                  shape.draft_tokens)
        draft_input = EagleDraftInput(bonus_tokens=bonus)
        if not self.config.cell.overlap:
            # Without overlap the draft input itself stays on the batch (no relay rows), and
            # its filter_batch / merge_batch slice the draft's top-k: the stand-in's have
            # the shape the release's draft-extend leaves (b, topk); their values are never
            # read by anything the model observes.
            topk = self.config.topk
            draft_input.topk_p = torch.ones((len(reqs), topk), dtype=torch.float32)
            draft_input.topk_index = bonus.to(torch.int64).reshape(-1, 1).repeat(1, topk)
        if is_extend:
            return GenerationBatchResult(next_token_ids=ids, new_seq_lens=new_seq_lens,
                                         next_draft_input=draft_input)
        return GenerationBatchResult(
            next_token_ids=ids,
            accept_lens=torch.tensor(accept_lens, dtype=torch.int64),
            new_seq_lens=new_seq_lens,
            speculative_num_draft_tokens=stride,
            next_draft_input=draft_input,
        )
