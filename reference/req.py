"""``Req``: one request's host-side state, and the ghost truth kept beside it.

Upstream: ``managers/schedule_batch.py`` (Req, reset_for_retract,
update_finish_state), fields later moved under ``req.kv.*`` (M2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap_spec.spec.units import PageId, PoolRow, RequestId, StepId, TokenCount

EOS_TOKEN = 0


@dataclass
class Ghost:
    """Truth the scheduler does not keep. Written only by :class:`GhostBook`."""

    epoch: int = 0
    kv_len_true: int = 0
    settled_len: int = 0
    inflight_steps: int = 0
    prepared_steps: int = 0  # decode steps prepared (claims made) but not yet launched
    extend_inflight: bool = False
    output_len_true: int = 0
    finished: bool = False
    abort_requested: bool = False
    inflight_at_release: int = 0  # launched, unprocessed steps at the finish release
    claimed_at_release: int = 0  # the same plus a prepared, never-launched step
    step_epoch: dict[StepId, int] = field(default_factory=dict)
    step_kv_len: dict[StepId, int] = field(default_factory=dict)
    step_kind: dict[StepId, str] = field(default_factory=dict)


@dataclass
class Req:
    rid: RequestId
    prompt_len: TokenCount
    max_new_tokens: TokenCount
    output_ids: list[int] = field(default_factory=list)
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    req_pool_idx: PoolRow | None = None
    pages: list[PageId] = field(default_factory=list)  # page k holds columns [k*p, (k+1)*p)
    finished_reason: str | None = None
    to_finish: str | None = None  # deferred abort, promoted by update_finish_state
    is_retracted: bool = False
    prebuilt: bool = False  # PD decode: KV and the first token arrive without a prefill
    waiting: bool = True
    holds_kv: bool = False
    release_count: int = 0
    cached_len: int | None = None
    committed_at_release: int | None = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    ghost: Ghost = field(default_factory=Ghost)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def seqlen(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def update_finish_state(self, hit_eos: bool) -> None:
        if self.to_finish is not None:
            self.finished_reason = self.to_finish
        elif hit_eos:
            self.finished_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"

    def reset_for_retract(self) -> None:
        """Frame: zeroes KV lengths and the pool row; keeps output_ids."""
        self.is_retracted = True
        self.prebuilt = False  # a retracted request is re-prefilled here
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.req_pool_idx = None
        self.pages = []
        self.holds_kv = False
        self.waiting = True
        self.release_count = 0


class GhostBook:
    """Maintains every request's ghost from the environment's point of view.

    The scheduler calls these hooks at fixed places (launch, forward, result, retract,
    release); none of them reads a scheduler decision it could get wrong, except which
    requests exist. Faults never change these calls.
    """

    def on_retract(self, req: Req) -> None:
        g = req.ghost
        g.epoch += 1
        g.kv_len_true = 0
        g.settled_len = 0
        g.inflight_steps = 0
        g.prepared_steps = 0
        g.extend_inflight = False

    def on_prepare_decode(self, req: Req) -> None:
        req.ghost.prepared_steps = 1

    def on_prepare_extend(self, req: Req) -> None:
        """A prefill claims its whole fill length at prepare time; nothing is settled yet."""
        req.ghost.extend_inflight = True

    def on_launch(self, step: StepId, req: Req, is_extend: bool) -> None:
        req.ghost.inflight_steps += 1
        req.ghost.prepared_steps = 0
        req.ghost.step_epoch[step] = req.ghost.epoch

    def on_forward_extend(self, step: StepId, req: Req) -> None:
        g = req.ghost
        g.kv_len_true = req.prompt_len + g.output_len_true
        g.step_kv_len[step] = g.kv_len_true
        g.step_kind[step] = "extend"

    def on_forward_decode(self, step: StepId, req: Req, advanced_by: int) -> None:
        g = req.ghost
        g.kv_len_true += advanced_by
        g.step_kv_len[step] = g.kv_len_true

    def on_result(
        self, step: StepId, req: Req, accept_len: int, eos_at: int | None
    ) -> None:
        """Settle a step by the environment's own cut (spec.transitions.compute_run_len)."""
        g = req.ghost
        epoch = g.step_epoch.pop(step, None)
        kv_len = g.step_kv_len.pop(step, None)
        if epoch != g.epoch:
            return
        g.inflight_steps -= 1
        if kv_len is not None and g.extend_inflight and g.step_kind.pop(step, "") == "extend":
            g.extend_inflight = False
        if g.finished:
            return
        # The environment's own cut, written out here rather than shared with the
        # scheduler so that a wrong cut in one cannot hide in the other.
        run_len = accept_len
        if g.output_len_true + run_len > req.max_new_tokens:
            run_len = max(req.max_new_tokens - g.output_len_true, 0)
        if eos_at is not None and eos_at + 1 < run_len:
            run_len = eos_at + 1
        g.settled_len = kv_len if kv_len is not None else g.settled_len
        g.output_len_true += run_len
        hit_eos = eos_at is not None and eos_at < run_len
        if hit_eos or g.abort_requested or g.output_len_true >= req.max_new_tokens:
            g.finished = True

    def on_prebuilt(self, req: Req) -> None:
        """The prefill ran elsewhere: its KV and first output token arrive settled."""
        g = req.ghost
        g.kv_len_true = g.settled_len = req.prompt_len
        g.output_len_true = 1
        g.extend_inflight = False

    def on_abort(self, req: Req, waiting: bool) -> None:
        req.ghost.abort_requested = True
        if waiting:
            req.ghost.finished = True

    def on_release(self, req: Req) -> None:
        g = req.ghost
        g.inflight_at_release = g.inflight_steps
        g.claimed_at_release = g.inflight_steps + g.prepared_steps
