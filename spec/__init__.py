"""The spec: the state SGLang's overlap scheduler keeps about sequence lengths and KV, the
transitions that change it, and the invariants that must hold. Everything else in
overlap-spec (the reference, gpu_impl, the proofs, the upstream driver) is checked
against what is written here; nothing here imports anything else of the project.

**The three homes of a seq_len.** A request's length lives on the GPU (``seq_lens``, the
forward's input), on the host (``seq_lens_cpu``, its mirror, and the lazily computed
``seq_lens_sum``) and in the request's own KV accounting (``kv_committed_len``: KV the
request's tokens really own; ``kv_allocated_len``: slots reserved for it). Under
speculative decoding v2 a fourth copy travels through the FutureMap relay
(publish / stash / resolve_seq_lens_cpu, ordered by the ``publish_ready`` event).

**The overlapped timeline.** The host prepares iteration n+1 while the GPU runs n, on
four streams (S schedule, F forward, D relay copy, C result copy; ``happens_before``)::

    host : prepare(B_i) ── run_batch(B_i) ── fence ── process(R_{i-1}) ──▶
    F    :  ...F_{i-1}...  | wait(S) → inputs → verify → publish → draft_extend → stash
    D    :                   wait publish_ready_{i-1} → copy → (host blocks)
    C    :                                               copy R_i → copy_done_i

so a result arrives one iteration late and must not touch a request that finished or was
retracted since.

**Observation points** (``state.ObservationPoint``): after every prepare, filter, merge,
retract and resolve, at the launch, at each ``ForwardBatch.init_new``, after draft-extend,
at the end of ``run_batch``, at result processing, at abort and at the end of an
iteration. An implementation's refinement function builds an ``Observation`` there.

**Five invariant families** (``invariants/``, a module each; IDs from the digest): SL
(seq_len mirrors and sums agree), KV (committed vs allocated under retract, finish and
release), FM (the FutureMap relay: publish before consume), ST (stream ordering, no race),
RP (result processing touches only live requests). Each invariant is written once, in its
family's module: its ID and cells on the decorator, its claim and source in the docstring.

**Reading order:**

1. ``units``: the kinds of number (tokens, pages, rows, slots, steps);
2. ``config``: cells (overlap x page size x spec mode x era) and presets;
3. ``state``: the observed state and the ghost truth;
4. ``transitions`` and ``relation``: the arithmetic and the per-request transition
   relation, each transition with its guard, its frame and its ghost update;
5. ``happens_before``: streams, events and races;
6. ``invariants``: ``registry`` (what the families share), then ``sl``, ``kv``, ``fm``,
   ``st``, ``rp``: the claims, each with its ID, cells and source;
7. ``interface``: what an implementation offers the harness (``SchedulerModel``);
8. ``bugs``: the IDs of the historical bugs (``BUG_IDS``), each a fault switch; what
   each bug was lives in ``harness/catalogue.py``.
"""
