"""sglang 0.5.23, upstream finding U6 (RP5): an abort promoted by a verify result that holds a
stop token shows the tokens past the stop.

Where (sglang 0.5.23): python/sglang/srt/managers/schedule_batch.py:2011
(Req.update_finish_state returns on to_finish before the stop-token and length checks that
set finished_len).

The test follows:
- python/sglang/srt/managers/scheduler.py:5812 (abort_request: to_finish on a running
  request)
- python/sglang/srt/managers/scheduler_components/batch_result_processor.py:1046 and :1049
  (the accepted run appended, then update_finish_state)
- python/sglang/srt/managers/schedule_batch.py:1856 (_check_token_based_finish, never
  reached) and :1509 (output_ids_through_stop)

What happens: U5's mechanism as RP5 sees it, and with a stop token too: an abort promoted by
the verify result that crosses max_new_tokens or holds a stop token leaves
finished_len=None, so the client sees the whole accepted run, tokens past the stop or the
cap included.

The claim the test asserts: an aborted request's visible output is the environment's, cut at
the stop and the cap.

Scenario: A spec-decoding request (one output token from its prefill, max_new_tokens=8, so
the cap plays no part) is aborted while it runs, as Scheduler.abort_request does for a
request in the running batch (to_finish). Its next verify result accepts 4 tokens, the
second of them a stop token (the model's EOS, or one of the request's stop_token_ids), and
is processed as process_batch_result_decode does: the run appended to output_ids, then
Req.update_finish_state. The test asserts the finding's claim on what the client is sent
(Req.output_ids_through_stop): nothing past the stop. A control request without the abort
shows the release cutting the same run at the stop. (The cap's case is U5's test.)

Run it where sglang (and torch, pytest) is installed; it needs nothing else (copy it anywhere):

    pytest docs/findings/test_u6_abort_shows_output_past_the_stop.py

It fails on sglang 0.5.23 (the assertion message begins "U6 (RP5): ") and should pass once
the finding is fixed: a regression test.

Found by overlap-spec's upstream tier (docs/upstream-findings.md there); evidence: found by
RP5 in sglang 0.5.23 on CPU (the catalogue's B17); RP7 sees the stop-token case as a stop
token inside the visible output, or, where only the newest token is checked, as a token
after the stop. Written by 'overlap-spec upstream export U6'.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from array import array


def _stand_in_for_torchvision() -> None:
    """Serve an empty ``torchvision`` when the installed one does not import (none, or a
    CUDA build beside a CPU torch). sglang imports it at module level and the code this
    test runs never calls it. With a working torchvision this does nothing."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - a build for another torch raises more than ImportError
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    try:  # transformers caches the answer: ask before the stand-in exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # noqa: BLE001
        pass

    class _Module(types.ModuleType):
        def __getattr__(self, item: str) -> object:
            if item.startswith("__"):
                raise AttributeError(item)
            return type(item, (), {"__module__": self.__name__})

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] != "torchvision":
                return None
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

        def create_module(self, spec):
            module = _Module(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            return None

    sys.meta_path.insert(0, _Finder())


_stand_in_for_torchvision()

import pytest  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

EOS = 2  # the model's EOS (Req.eos_token_ids)
VOCAB = 1000
FIRST = 10  # the prefill's output token


def make_running_request(max_new_tokens: int, **sampling: object) -> Req:
    """A request after its prefill: one output token, not finished."""
    params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    params.normalize(None)
    req = Req("r0", "", array("q", [5]), params, eos_token_ids={EOS}, vocab_size=VOCAB)
    req.output_ids.append(FIRST)
    req.update_finish_state()
    assert not req.finished(), "setup: the request finished at its prefill"
    return req


def abort_while_running(req: Req) -> None:
    """Scheduler.abort_request on a request in the running batch
    (managers/scheduler.py:5812, "Abort method 3: set `to_finish`"): the request runs one
    more forward and its result promotes the abort."""
    req.to_finish = FINISH_ABORT()


def process_verify_result(req: Req, accepted: list[int]) -> None:
    """What process_batch_result_decode does with one request's spec verify result: the
    whole accepted run appended, then the finish check
    (managers/scheduler_components/batch_result_processor.py:1046 and :1049)."""
    req.output_ids.extend(accepted)
    req.update_finish_state(len(accepted))


def visible_output(req: Req) -> list[int]:
    """What the client is sent: Req.output_ids_through_stop (managers/schedule_batch.py:1509,
    all of output_ids when finished_len is None)."""
    return list(req.output_ids_through_stop)

USER_STOP = 7  # a stop token the request asks for (SamplingParams.stop_token_ids)


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_u6_an_abort_promoted_by_a_verify_holding_a_stop_shows_no_token_past_it(
        stop: str) -> None:
    stop_token = EOS if stop == "eos" else USER_STOP
    sampling: dict[str, object] = {} if stop == "eos" else {"stop_token_ids": [USER_STOP]}
    max_new_tokens = 8  # the cap plays no part: 1 + 4 output tokens
    accepted = [11, stop_token, 13, 14]
    through_stop = [FIRST, 11, stop_token]

    # Control: without the abort the release cuts the same run at the stop.
    control = make_running_request(max_new_tokens, **sampling)
    process_verify_result(control, accepted)
    assert visible_output(control) == through_stop, (
        f"control: without an abort the run is not cut at the stop: {visible_output(control)}")

    req = make_running_request(max_new_tokens, **sampling)
    abort_while_running(req)
    process_verify_result(req, accepted)
    assert req.finished(), "the verify result did not finish the aborted request"
    visible = visible_output(req)
    assert visible == through_stop, (
        f"U6 (RP5): the aborted request shows {len(visible)} output tokens {visible}, past "
        f"its stop token {stop_token} at position {through_stop.index(stop_token)}: the "
        f"environment ended it at {len(through_stop)} {through_stop} (finished_len="
        f"{req.finished_len}, finished_reason={type(req.finished_reason).__name__})")
