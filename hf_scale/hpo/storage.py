"""Where the study lives: a SQLite file in the output folder by default, any Optuna RDB URL, or a journal file.

The default file makes an interrupted search resumable: started again with the same output_dir, it loads the study
and goes on. An RDB URL (PostgreSQL, MySQL) lets workers on several nodes share one study, each worker one launch on
its node. A journal file (`journal:PATH`) needs only a shared filesystem. A URL may carry a password: it is shown
only through `hf_scale.safety.mask_secrets`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from hf_scale.errors import ConfigError
from hf_scale.safety import mask_secrets

DEFAULT_STUDY_FILE = "optuna_study.db"
JOURNAL_PREFIX = "journal:"
HEARTBEAT_KEY = "hf_scale:heartbeat"
SCHEMA_RACE_ATTEMPTS = 5


@contextlib.contextmanager
def quiet_experimental() -> Iterator[None]:
    """Silence Optuna's "experimental feature" warnings: heartbeats and retries are what the search relies on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def open_storage(
    spec: str, heartbeat_interval: int = 60, grace_period: int | None = None, max_retry: int | None = 2
) -> optuna.storages.BaseStorage:
    """The Optuna storage for `spec`: an RDB URL (sqlite:///, postgresql://, mysql://) or `journal:PATH`.

    With an RDB, each running trial writes a heartbeat every `heartbeat_interval` seconds; a trial whose heartbeat
    is older than `grace_period` (default: twice the interval) belongs to a worker that died: it is marked FAIL and
    queued again with the same parameters, at most `max_retry` times. The journal storage gets the same through
    `JournalHeartbeat`, since Optuna gives it none."""
    if heartbeat_interval < 1:
        raise ConfigError(f"heartbeat_interval: must be at least 1 second, got {heartbeat_interval}")
    if spec.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = Path(spec.removeprefix(JOURNAL_PREFIX))
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in spec:
        raise ConfigError(
            f"storage: {mask_secrets(spec)!r} is neither a database URL (sqlite:///PATH, postgresql://...) nor "
            "journal:PATH"
        )
    engine_kwargs: dict[str, Any] = {}
    if spec.startswith("postgresql://") and not find_spec("psycopg") and find_spec("psycopg2"):
        spec = "postgresql+psycopg2://" + spec.removeprefix("postgresql://")  # SQLAlchemy 2.1 defaults to psycopg 3
    if spec.startswith("sqlite"):
        Path(spec.split(":///", 1)[-1]).parent.mkdir(parents=True, exist_ok=True)
        # Several workers (or the heartbeat thread) may write at once: wait for the lock instead of failing.
        engine_kwargs["connect_args"] = {"timeout": 60}
    else:
        engine_kwargs["pool_pre_ping"] = True  # a connection dropped during a long trial is replaced, not fatal
    from sqlalchemy.exc import IntegrityError

    # Workers started together on a fresh database all create Optuna's tables: the losers of that race get a
    # duplicate-key error from CREATE TYPE/TABLE, and the tables exist once the winner is done, so they try again.
    for attempt in range(SCHEMA_RACE_ATTEMPTS):
        time.sleep(attempt)  # none before the first try
        try:
            with quiet_experimental():
                return RDBStorage(
                    spec,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period or None,  # None: Optuna's default, twice the interval
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry),
                )
        except IntegrityError:
            pass
        except Exception as error:  # the driver's message, never the URL with its password
            raise ConfigError(f"storage {mask_secrets(spec)}: cannot open it: {mask_secrets(str(error))}") from None
    raise ConfigError(f"storage {mask_secrets(spec)}: another worker kept creating its tables")


def fail_trial(
    study: optuna.Study,
    storage: optuna.storages.BaseStorage,
    number: int,
    retry: RetryHeartbeatStaleTrialCallback | None,
) -> bool:
    """Mark a dead worker's running trial FAIL, and queue it again through `retry` (which keeps to its max_retry);
    False when another worker or check finished it first."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)
    try:
        if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    if retry is not None:
        retry(study, storage.get_trial(trial_id))
    return True


class JournalHeartbeat:
    """A heartbeat for the journal storage, kept as a trial system attribute (Optuna's covers RDB storages only)."""

    def __init__(
        self,
        study: optuna.Study,
        storage: optuna.storages.BaseStorage,
        interval: int,
        grace_period: int | None,
        max_retry: int | None,
    ) -> None:
        self.study, self.storage = study, storage
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.interval = interval
        self.grace = grace_period or 2 * interval
        with quiet_experimental():
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def fail_stale(self) -> list[int]:
        """Mark FAIL (and queue again) every running trial whose heartbeat is older than the grace period."""
        now = time.time()
        stale = [
            trial.number
            for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if now - trial.system_attrs.get(HEARTBEAT_KEY, trial.datetime_start.timestamp()) > self.grace
        ]
        return [number for number in stale if fail_trial(self.study, self.storage, number, self.retry)]

    def start(self, trial_number: int) -> None:
        self._stop.clear()
        trial_id = self.trial_id(trial_number)

        def beat() -> None:
            while True:
                try:
                    self.storage.set_trial_system_attr(trial_id, HEARTBEAT_KEY, time.time())
                except optuna.exceptions.UpdateFinishedTrialError:
                    return  # another worker judged it dead already; the trial's own end reports that
                except Exception as error:  # noqa: BLE001 -- a shared filesystem's hiccup must not end the heartbeats
                    # One missed beat is within the grace period (twice the interval by default); a thread that ended
                    # here would let another worker fail and queue again a trial that is still running.
                    warnings.warn(f"trial {trial_number}: heartbeat not written ({error}); trying again", stacklevel=1)
                if self._stop.wait(self.interval):
                    return

        self._thread = threading.Thread(target=beat, name="hf_scale-journal-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
