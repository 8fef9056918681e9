"""The project's Hypothesis state machines as pytest tests: HypoFuzz's fuzz targets.

One ``TestCase`` per configuration cell (minimal preset), each the machine
``harness/drive/stateful.py`` builds for ``overlap-spec check``: admit, admit_prebuilt,
iterate and abort on the reference, every applicable invariant checked at every
observation point. ``check`` runs them for a fixed budget under a fixed seed; HypoFuzz
(``pip install -e '.[fuzz]'``) runs them for as long as it is left, guided by coverage:

    hypothesis fuzz -n 2 -- tests/fuzz_targets.py
    hypothesis fuzz -n 2 -- tests/fuzz_targets.py -k "v2chain"    # some cells

The file's name is outside pytest's ``test_*.py`` pattern, so the default test run does not
collect it (``test_stateful.py`` runs the same machines under the fixed seed);
``pytest tests/fuzz_targets.py`` replays what the fuzzer saved in ``.hypothesis/``. A
violation is also saved as an operation script (``OVERLAP_SPEC_OUT``, default
``.overlap-spec/``): ``overlap-spec replay FILE`` re-runs it without Hypothesis.

Several machines share one example database through Redis: with ``OVERLAP_SPEC_REDIS_URL``
set (``redis://:PASSWORD@HOST:PORT/DB``), importing this file loads a Hypothesis profile that
is the current one with its database replaced by a ``RedisExampleDatabase`` on that server,
so every target, HypoFuzz and a plain pytest replay read and write there
(``docs/fuzzing-several-machines.md``). Unset, the database is Hypothesis's default.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from overlap_spec.harness.drive.script import Op, save_script
from overlap_spec.harness.drive.stateful import get_failure_dir, get_profile, make_machine
from overlap_spec.spec.config import MINIMAL, ModelConfig, enumerate_cells
from overlap_spec.spec.invariants import InvariantViolation

REDIS_URL_VARIABLE = "OVERLAP_SPEC_REDIS_URL"


def _use_redis_database() -> None:
    """With ``OVERLAP_SPEC_REDIS_URL`` set: register and load the current profile (the
    ``--hypothesis-profile`` pytest loaded, else ``default``) with a ``RedisExampleDatabase``
    on that URL, as ``<profile>+redis``; the server must answer now. The targets' settings
    below are made after this, so they take that database, which HypoFuzz requires to be
    ``settings().database`` itself."""
    url = os.environ.get(REDIS_URL_VARIABLE)
    if not url:
        return
    try:
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis import Redis
        from redis.exceptions import RedisError
    except ImportError as error:
        raise ImportError(f"{REDIS_URL_VARIABLE} is set, but the Redis client is not "
                          "installed: pip install redis") from error
    client = Redis.from_url(url)
    try:
        client.ping()
    except RedisError as error:  # the URL as given may hold the password: not repeated
        kwargs = client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        raise RuntimeError(f"{REDIS_URL_VARIABLE}: the Redis server at {where} "
                           f"(db {kwargs.get('db', 0)}) does not answer: {error}") from None
    name = settings.get_current_profile_name().removesuffix("+redis") + "+redis"
    settings.register_profile(name, settings.default, database=RedisExampleDatabase(client))
    settings.load_profile(name)


_use_redis_database()


@pytest.fixture(autouse=True)
def _failure_dir() -> None:
    """Overrides the suite's fixture of that name, whose ``tmp_path`` HypoFuzz cannot give (it
    sets fixtures up after its collecting session has ended): a violation's script goes
    where ``overlap-spec check`` puts it."""


def _fuzz_target(config: ModelConfig, faults: frozenset[str] = frozenset()) -> Any:
    """The cell's ``TestCase``; ``faults`` (catalogue IDs, ``harness/catalogue.py``) plants
    known bugs, for a test that needs a target with a failure to find (the targets below
    have none)."""
    base: Any = make_machine(config, faults)

    class Machine(base):  # type: ignore[misc]
        def _apply(self, op: Op) -> None:
            try:
                super()._apply(op)
            except InvariantViolation as violation:
                name = config.name.replace("@", "-")
                path = save_script(self.script, get_failure_dir() / f"fuzz-{name}.json")
                violation.add_note(f"replay: overlap-spec replay {path}")
                raise

    Machine.__name__ = base.__name__
    # Hypothesis keys a state machine's examples by its class's source, the same in every
    # cell: without the cell and the faults in the key, the 32 targets would share one
    # entry, and a clean cell's replay could delete a failure another cell saved.
    Machine._hypothesis_internal_add_digest = (  # read by hypothesis's function_digest
        f"{config.name}/{','.join(sorted(faults))}".encode())
    # HypoFuzz sets its own budget; these settings are for a plain pytest replay of what it
    # found (the database stays the default one, which HypoFuzz requires: Hypothesis's
    # own, or the Redis one loaded above).
    Machine.TestCase.settings = settings(stateful_step_count=get_profile().step_count,
                                         deadline=None,
                                         suppress_health_check=list(HealthCheck))
    return Machine.TestCase


for _cell in enumerate_cells():
    _name = "Test_" + _cell.name.replace("-", "_")
    globals()[_name] = type(_name, (_fuzz_target(ModelConfig(_cell, MINIMAL)),), {})
