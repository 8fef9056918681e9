"""The one interface every implementation offers (reference/, gpu_impl/).

A driver (harness/) calls these operations; the implementation reports an
:class:`~spec.state.Observation` to its observer at every observation point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from spec.config import ModelConfig
from spec.state import IterationChoices, Observation
from spec.units import RequestId

Observer = Callable[[Observation], None]


class SchedulerModel(Protocol):
    config: ModelConfig

    def admit(self, prompt_len: int, max_new_tokens: int) -> RequestId:
        """A new request joins the waiting queue."""
        ...

    def admit_prebuilt(self, prompt_len: int, max_new_tokens: int) -> RequestId:
        """A PD-decode request whose KV and first token were produced elsewhere."""
        ...

    def abort(self, rid: RequestId) -> None:
        """Abort: immediate if waiting, deferred to its next result if running."""
        ...

    def run_iteration(self, choices: IterationChoices) -> None:
        """One pass of the event loop with the environment's choices."""
        ...

    def get_request_ids(self) -> tuple[RequestId, ...]:
        ...

    def set_step_index(self, index: int) -> None:
        """Which script operation is running (stamped on observations)."""
        ...


SchedulerFactory = Callable[[ModelConfig, frozenset[str], Observer | None], SchedulerModel]
