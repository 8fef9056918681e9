"""The vector-clock engine on its own: each fence removes exactly the race it should."""

from __future__ import annotations

from overlap_spec.spec.happens_before import D2H, FORWARD, HOST, SCHEDULE, HappensBefore


def test_unsynchronised_cross_stream_read_is_a_race() -> None:
    hb = HappensBefore()
    hb.write(FORWARD, ("new_seq_lens_buf", 3), "publish")
    races = hb.read(SCHEDULE, ("new_seq_lens_buf", 3), "resolve")
    assert len(races) == 1
    assert "resolve on schedule" in races[0].describe()
    assert "publish on forward" in races[0].describe()


def test_event_record_and_wait_orders_the_read() -> None:
    hb = HappensBefore()
    hb.write(FORWARD, ("new_seq_lens_buf", 3), "publish")
    hb.record("publish_ready", FORWARD)
    assert hb.wait_event(SCHEDULE, "publish_ready")
    assert hb.read(SCHEDULE, ("new_seq_lens_buf", 3), "resolve") == []


def test_event_recorded_before_the_write_does_not_cover_it() -> None:
    hb = HappensBefore()
    hb.record("publish_ready", FORWARD)
    hb.write(FORWARD, ("new_seq_lens_buf", 3), "publish")
    hb.wait_event(SCHEDULE, "publish_ready")
    assert not hb.event_covers("publish_ready", hb.last_write[("new_seq_lens_buf", 3)])
    assert len(hb.read(SCHEDULE, ("new_seq_lens_buf", 3), "resolve")) == 1


def test_waiting_on_a_never_recorded_event_orders_nothing() -> None:
    hb = HappensBefore()
    hb.write(FORWARD, ("x", 0), "w")
    assert not hb.wait_event(SCHEDULE, "never")
    assert len(hb.read(SCHEDULE, ("x", 0), "r")) == 1


def test_host_enqueue_orders_host_writes_before_stream_work() -> None:
    hb = HappensBefore()
    hb.write(HOST, ("pinned", 0), "host fill")
    assert hb.read(SCHEDULE, ("pinned", 0), "h2d") == []


def test_device_to_host_needs_a_synchronize() -> None:
    hb = HappensBefore()
    hb.write(D2H, ("pinned", 0), "copy")
    assert len(hb.read(HOST, ("pinned", 0), "host read")) == 1
    hb2 = HappensBefore()
    hb2.write(D2H, ("pinned", 0), "copy")
    hb2.synchronize_stream(D2H)
    assert hb2.read(HOST, ("pinned", 0), "host read") == []
    assert hb2.host_syncs == ["stream:d2h"]


def test_write_after_read_needs_the_reader_ordered_first() -> None:
    hb = HappensBefore()
    hb.read(FORWARD, ("req_to_token", 1), "forward")
    assert len(hb.write(SCHEDULE, ("req_to_token", 1), "alloc")) == 1
    hb2 = HappensBefore()
    hb2.read(FORWARD, ("req_to_token", 1), "forward")
    hb2.wait_stream(SCHEDULE, FORWARD)
    assert hb2.write(SCHEDULE, ("req_to_token", 1), "alloc") == []


def test_free_before_the_reader_completed_is_a_race_and_owner_stream_reuse_is_not() -> None:
    hb = HappensBefore()
    hb.write(SCHEDULE, ("tensor", 1), "create")
    hb.wait_stream(FORWARD, SCHEDULE)
    hb.read(FORWARD, ("tensor", 1), "forward")
    assert len(hb.free(("tensor", 1), "drop")) == 1
    hb2 = HappensBefore()
    hb2.write(SCHEDULE, ("tensor", 1), "create")
    hb2.read(SCHEDULE, ("tensor", 1), "filter")
    assert hb2.free(("tensor", 1), "drop") == []


def test_checked_pairs_count_cross_participant_conflicts_ordered_or_not() -> None:
    """The stream claims' witnesses: each conflicting pair of two participants is counted
    once it is judged; a pair on one stream (FIFO) or a lone access is not."""
    hb = HappensBefore()
    hb.write(SCHEDULE, ("req_to_token", 1), "alloc")
    hb.write(SCHEDULE, ("req_to_token", 1), "alloc again")  # same stream: not counted
    assert hb.checked == []
    hb.wait_stream(FORWARD, SCHEDULE)
    hb.read(FORWARD, ("req_to_token", 1), "forward")  # ordered: counted, no race
    assert len(hb.checked) == 1 and hb.races == []
    hb.write(SCHEDULE, ("req_to_token", 1), "next alloc")  # WAR with no fence: a race
    assert len(hb.checked) == 2 and len(hb.races) == 1
    hb.read(D2H, ("other", 0), "lone read")
    assert len(hb.checked) == 2
