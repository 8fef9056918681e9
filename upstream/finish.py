"""sglang's finish reasons under the spec's names (RP5), for the adapter and the trace shim."""

from __future__ import annotations

# Upstream's finish reasons (``managers/schedule_batch.py`` ``FINISH_*``) by the spec's
# names: a stop token or stop string is "stop", the length cap "length", an abort "abort".
FINISH_REASON_NAMES = {
    "FINISH_MATCHED_TOKEN": "stop",
    "FINISH_MATCHED_STR": "stop",
    "FINISH_LENGTH": "length",
    "FINISH_ABORT": "abort",
}


def get_finish_reason_name(reason: object) -> str | None:
    """An upstream ``finished_reason`` object under the spec's name; None stays None, and
    a reason the spec does not model keeps its class name (so it cannot match silently)."""
    if reason is None:
        return None
    name = type(reason).__name__
    return FINISH_REASON_NAMES.get(name, name)
