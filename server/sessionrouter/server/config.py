"""Server configuration from a TOML file and command-line flags (flags win).

The file mirrors the flags, for example::

    listen = "0.0.0.0:50051"
    heartbeat_timeout_s = 10
    [estimator]
    name = "grpo"
    eps = 1e-6
    ddof = 1
    [groups]
    deadline_s = 600
    min_members = 2
    [[workers]]
    worker_id = "w1"
    address = "10.0.0.7:30000"
    capacity = 8
    labels = { model = "qwen3-8b" }
    [journal]
    state_dir = "/var/lib/sessionrouter"   # or in_memory = true
    sync = "full"                          # or "normal"; see core.journal
    check_on_start = true

Without ``--state-dir``, ``--in-memory`` or a ``[journal]`` table the router journals to
``./state`` (``DEFAULT_STATE_DIR``): durable unless told otherwise, because rewards from real
users cannot be produced again; the directory is relative to where the router starts, as
Prometheus's ``data/`` is, and its lock refuses a second router on the same directory.

Every problem is a ConfigError whose message names the key and what is wrong, so the CLI can
print one line and exit non-zero instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sessionrouter.server.app import JournalConfig, ServerConfig, WorkerSpec
from sessionrouter.server.core.errors import RouterError
from sessionrouter.server.core.estimators import EstimatorParams, validate_params
from sessionrouter.server.core.journal import SyncMode
from sessionrouter.server.core.placement import PlacementMode
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.server.core.validation import check_id

DEMO_WORKER_BASE_PORT = 30000
DEFAULT_STATE_DIR = "state"
"""Where the journal lives when nothing says otherwise, relative to the working directory."""
_JOURNAL_KEYS = {"state_dir", "in_memory", "sync", "check_on_start"}


class ConfigError(ValueError):
    """Invalid configuration: the message says which key and why."""


@dataclass(frozen=True, slots=True)
class Overrides:
    """Values given on the command line; None means "not given"."""

    listen: str | None = None
    workers: tuple[str, ...] = ()
    demo_workers: int | None = None
    estimator: str | None = None
    eps: float | None = None
    ddof: int | None = None
    batch_std: bool | None = None
    deadline_s: float | None = None
    min_members: int | None = None
    heartbeat_timeout_s: float | None = None
    reducer_window_ms: float | None = None
    reducer_max_batch: int | None = None
    placement: str | None = None
    grace_s: float | None = None
    shutdown_delay_s: float | None = None
    max_connection_age_s: float | None = None
    keepalive_time_s: float | None = None
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    metrics_port: int | None = None
    feed_retention: int | None = None
    state_dir: str | None = None
    in_memory: bool = False
    journal_sync: str | None = None


_FILE_KEYS = {
    "listen",
    "heartbeat_timeout_s",
    "placement",
    "grace_s",
    "shutdown_delay_s",
    "max_connection_age_s",
    "keepalive_time_s",
    "metrics_port",
    "tls_cert_file",
    "tls_key_file",
    "auth_token_file",
    "demo_workers",
    "feed_retention",
    "estimator",
    "groups",
    "reducer",
    "workers",
    "journal",
}


def load_file(path: str) -> dict[str, Any]:
    """Reads a TOML config file, or raises ConfigError naming the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise ConfigError(f"config file {path!r}: unknown keys {unknown}")
    return data


def _get(section: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = section.get(key)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}{key} must be a {kind.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}{key} must be finite, got {value!r}")
    return value


def _pick(flag: Any, file_value: Any, default: Any) -> Any:
    if flag is not None:
        return flag
    return default if file_value is None else file_value


def parse_worker_flag(text: str) -> WorkerSpec:
    """``ID=ADDRESS[,CAPACITY]`` as given to ``--worker``."""
    worker_id, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ConfigError(f"--worker {text!r}: expected ID=ADDRESS[,CAPACITY]")
    address, _, capacity_text = rest.partition(",")
    try:
        capacity = int(capacity_text) if capacity_text else 1
    except ValueError:
        raise ConfigError(
            f"--worker {text!r}: capacity {capacity_text!r} is not a number"
        ) from None
    return _worker(worker_id, address, capacity, {}, f"--worker {text!r}")


def _worker(
    worker_id: str, address: str, capacity: int, labels: dict[str, str], where: str
) -> WorkerSpec:
    try:
        check_id("worker_id", worker_id)
    except RouterError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    if not address:
        raise ConfigError(f"{where}: address must not be empty")
    if not 1 <= capacity <= 1_000_000:
        raise ConfigError(f"{where}: capacity must be between 1 and 1000000, got {capacity}")
    return WorkerSpec(worker_id, address, capacity, labels)


def _file_workers(items: Any) -> list[WorkerSpec]:
    if not isinstance(items, list):
        raise ConfigError("workers must be an array of tables ([[workers]])")
    specs = []
    for i, item in enumerate(items):
        where = f"workers[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where} must be a table")
        labels = item.get("labels", {})
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ConfigError(f"{where}.labels must map strings to strings")
        specs.append(
            _worker(
                _get(item, "worker_id", str, f"{where}.") or "",
                _get(item, "address", str, f"{where}.") or "",
                _get(item, "capacity", int, f"{where}.") or 1,
                labels,
                where,
            )
        )
    return specs


def build_config(flags: Overrides, file_data: Mapping[str, Any] | None = None) -> ServerConfig:
    """Merges defaults, the config file and the flags into a validated ServerConfig."""
    data = dict(file_data or {})
    est = data.get("estimator", {}) or {}
    grp = data.get("groups", {}) or {}
    red = data.get("reducer", {}) or {}
    for name, section in (("estimator", est), ("groups", grp), ("reducer", red)):
        if not isinstance(section, dict):
            raise ConfigError(f"{name} must be a table")
    defaults = RouterSettings()
    estimator = EstimatorParams(
        name=_pick(flags.estimator, _get(est, "name", str, "estimator."), defaults.estimator.name),
        eps=_pick(flags.eps, _get(est, "eps", float, "estimator."), defaults.estimator.eps),
        ddof=_pick(flags.ddof, _get(est, "ddof", int, "estimator."), defaults.estimator.ddof),
        batch_std=_pick(
            flags.batch_std,
            _get(est, "batch_std", bool, "estimator."),
            defaults.estimator.batch_std,
        ),
    )
    try:
        validate_params(estimator)
    except ValueError as exc:
        raise ConfigError(f"estimator: {exc}") from None
    placement_name = _pick(flags.placement, _get(data, "placement", str, ""), "spread")
    try:
        placement = PlacementMode(placement_name)
    except ValueError:
        raise ConfigError(
            f"placement must be 'spread' or 'strict', got {placement_name!r}"
        ) from None
    window_ms = _pick(
        flags.reducer_window_ms,
        _get(red, "window_ms", float, "reducer."),
        defaults.reducer_window_s * 1000,
    )
    settings = RouterSettings(
        heartbeat_timeout_s=_pick(
            flags.heartbeat_timeout_s,
            _get(data, "heartbeat_timeout_s", float, ""),
            defaults.heartbeat_timeout_s,
        ),
        estimator=estimator,
        deadline_s=_pick(
            flags.deadline_s, _get(grp, "deadline_s", float, "groups."), defaults.deadline_s
        ),
        min_members=_pick(
            flags.min_members, _get(grp, "min_members", int, "groups."), defaults.min_members
        ),
        placement_mode=placement,
        reducer_window_s=window_ms / 1000,
        reducer_max_batch=_pick(
            flags.reducer_max_batch,
            _get(red, "max_batch", int, "reducer."),
            defaults.reducer_max_batch,
        ),
        feed_retention=_pick(
            flags.feed_retention, _get(data, "feed_retention", int, ""), defaults.feed_retention
        ),
    )
    _check_positive("heartbeat_timeout_s", settings.heartbeat_timeout_s)
    _check_positive("groups.deadline_s", settings.deadline_s)
    _check_positive("reducer.max_batch", settings.reducer_max_batch)
    _check_positive("feed_retention", settings.feed_retention)
    if settings.min_members < 1:
        raise ConfigError(f"groups.min_members must be at least 1, got {settings.min_members}")
    if settings.reducer_window_s < 0:
        raise ConfigError("reducer.window_ms must not be negative")

    workers = _file_workers(data.get("workers", []))
    workers += [parse_worker_flag(w) for w in flags.workers]
    demo = _pick(flags.demo_workers, _get(data, "demo_workers", int, ""), 0)
    if demo < 0:
        raise ConfigError("demo_workers must not be negative")
    workers += [
        WorkerSpec(f"demo-{i}", f"127.0.0.1:{DEMO_WORKER_BASE_PORT + i}", 8, {"pool": "demo"})
        for i in range(demo)
    ]
    ids = [w.worker_id for w in workers]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"workers: ids given twice: {duplicates}")

    token = flags.auth_token
    token_file = _get(data, "auth_token_file", str, "")
    if token is None and token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"auth_token_file {token_file!r}: {exc.strerror}") from None
    tls_cert = _pick(flags.tls_cert_file, _get(data, "tls_cert_file", str, ""), None)
    tls_key = _pick(flags.tls_key_file, _get(data, "tls_key_file", str, ""), None)
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("TLS needs both tls_cert_file and tls_key_file")
    base = ServerConfig()
    config = ServerConfig(
        listen=_pick(flags.listen, _get(data, "listen", str, ""), base.listen),
        router=settings,
        workers=tuple(workers),
        grace_s=_pick(flags.grace_s, _get(data, "grace_s", float, ""), base.grace_s),
        shutdown_delay_s=_pick(
            flags.shutdown_delay_s,
            _get(data, "shutdown_delay_s", float, ""),
            base.shutdown_delay_s,
        ),
        keepalive_time_s=_pick(
            flags.keepalive_time_s, _get(data, "keepalive_time_s", float, ""), base.keepalive_time_s
        ),
        max_connection_age_s=_pick(
            flags.max_connection_age_s, _get(data, "max_connection_age_s", float, ""), None
        ),
        auth_token=token or None,
        tls_cert_file=tls_cert,
        tls_key_file=tls_key,
        metrics_port=_pick(flags.metrics_port, _get(data, "metrics_port", int, ""), None),
    )
    _check_positive("grace_s", config.grace_s)
    if not 0 <= config.shutdown_delay_s <= 3600:
        raise ConfigError(
            f"shutdown_delay_s must be between 0 and 3600, got {config.shutdown_delay_s}"
        )
    return dataclasses.replace(config, journal=_journal(flags, data.get("journal", {}) or {}))


def _journal(flags: Overrides, section: Any) -> JournalConfig | None:
    """The journal settings: flags win over the file; no setting at all means ./state."""
    if not isinstance(section, dict):
        raise ConfigError("journal must be a table")
    unknown = sorted(set(section) - _JOURNAL_KEYS)
    if unknown:
        raise ConfigError(f"journal: unknown keys {unknown}")
    if flags.in_memory and flags.state_dir is not None:
        raise ConfigError("--in-memory and --state-dir exclude each other")
    file_dir = _get(section, "state_dir", str, "journal.")
    file_in_memory = _get(section, "in_memory", bool, "journal.") or False
    if file_in_memory and file_dir is not None:
        raise ConfigError("journal.in_memory and journal.state_dir exclude each other")
    sync_name = _pick(flags.journal_sync, _get(section, "sync", str, "journal."), "full")
    try:
        sync = SyncMode(sync_name)
    except ValueError:
        raise ConfigError(f"journal.sync must be 'full' or 'normal', got {sync_name!r}") from None
    check = _get(section, "check_on_start", bool, "journal.")
    if flags.in_memory:
        return None
    if flags.state_dir is None and file_in_memory:
        return None
    state_dir = flags.state_dir or file_dir or DEFAULT_STATE_DIR
    if not state_dir:
        raise ConfigError("the state directory must not be empty")
    return JournalConfig(state_dir, sync, True if check is None else check)


def _check_positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be positive, got {value}")


OVERRIDE_FIELDS = tuple(f.name for f in fields(Overrides))
