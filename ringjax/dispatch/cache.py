"""Persistent store of tuned configs: one JSON file per device kind.

User entries live in `$RINGJAX_CACHE_DIR` (default `$XDG_CACHE_HOME/ringjax`,
else `~/.cache/ringjax`); configs that ship with ringjax live in
`ringjax/configs/<device kind>.json`. Files are replaced atomically (temporary
file + `os.replace`) and every write merges with what is on disk under an
exclusive `flock` on a sibling lock file, so concurrent tuners lose no entry.
A file that is corrupt or of another schema is reported once, renamed aside and
ignored: a bad cache costs tuning time, never a crash.

An entry's key (see `cache_key`) holds everything that can change which config is
fastest, including the jax, jaxlib and ringjax versions; shipped files use the
same key without versions (`portable_key`), so they outlive upgrades.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
FORMAT = "ringjax-config-cache"

# option fields that do not change the kernel (values, not structure)
# axis_size: top level of the key. deterministic changes neither the function nor the best config (no tuning
# candidate has a fused backward), and keys (shipped ones too) stay as they were
_NOT_IN_KEY = ("softmax_scale", "axis_name", "axis_size", "deterministic")


# ---------------------------------------------------------------------------- keys


def versions() -> dict[str, Any]:
    """Versions an entry is valid for; read at call time so an upgrade misses old entries."""
    import jax
    import jaxlib

    from ringjax import _version

    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or jaxlib.version.__version__,
        "ringjax": _version.__version__,
        "schema": SCHEMA_VERSION,
    }


def _json_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return repr(value)


def portable_key(op: str, implementation: str, problem) -> dict[str, Any]:
    """The key without versions: op, implementation, per-device shapes, ring size, features, device."""
    opts = problem.opts
    features = {}
    for f in dataclasses.fields(opts):
        if f.name in _NOT_IN_KEY:
            continue
        value = getattr(opts, f.name)
        if f.name == "logits_soft_cap":  # the cap's value is data; its presence changes the kernel
            value = value is not None
        features[f.name] = _json_value(value)
    features["gqa_ratio"] = problem.gqa_ratio
    # float32 tiles compute in TF32 or full float32 as jax's matmul precision says: different kernels,
    # different fastest configs. Other dtypes ignore it, and their keys (shipped ones too) stay as they were.
    precision = {"precision": problem.precision} if problem.dtype == "float32" else {}
    # v with a head_dim of its own (multi-head latent attention) is another problem; keys where v's equals
    # q's (every shipped one) stay as they were
    v_head_dim = {} if problem.v_head_dim == problem.head_dim else {"v_head_dim": problem.v_head_dim}
    return {
        "op": op,
        "implementation": implementation,
        "shape": {
            "batch": problem.batch,
            "seq": problem.seq,
            "heads": problem.heads,
            "kv_heads": problem.kv_heads,
            "head_dim": problem.head_dim,
            **v_head_dim,
        },
        "dtype": problem.dtype,
        **precision,
        "axis_size": opts.axis_size,
        "features": features,
        "platform": problem.platform,
        "device_kind": problem.device_kind,
    }


def cache_key(op: str, implementation: str, problem) -> dict[str, Any]:
    """Full key of a tuned entry: `portable_key` plus `versions()`."""
    return {**portable_key(op, implementation, problem), "versions": versions()}


def key_id(key: dict[str, Any]) -> str:
    """Stable short id of a key (the entry's name in the file)."""
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------- locations


def cache_dir() -> Path:
    """Directory of the user store, resolved from the environment on every call."""
    explicit = os.environ.get("RINGJAX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ringjax"


def file_stem(device_kind: str) -> str:
    """File name (without .json) for a device kind: unsafe characters become '_'."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind.strip()).strip("._")
    return stem or "unknown"


def user_path(device_kind: str) -> Path:
    return cache_dir() / f"{file_stem(device_kind)}.json"


def shipped_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "configs"


def shipped_path(device_kind: str) -> Path:
    return shipped_dir() / f"{file_stem(device_kind)}.json"


# ---------------------------------------------------------------------------- file format

_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


def _warn_once(path: Path, message: str) -> None:
    with _warn_lock:
        if (str(path), message) in _warned:
            return
        _warned.add((str(path), message))
    warnings.warn(f"ringjax config cache: {message}", RuntimeWarning, stacklevel=3)


def empty_document(device_kind: str) -> dict[str, Any]:
    return {"format": FORMAT, "schema": SCHEMA_VERSION, "device_kind": device_kind, "entries": {}}


class CacheFileError(ValueError):
    """A cache file that is not valid JSON of this schema."""


def parse_document(text: str) -> dict[str, Any]:
    """Validate a cache file's text; CacheFileError says what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CacheFileError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CacheFileError(f"not a {FORMAT} file")
    if doc.get("schema") != SCHEMA_VERSION:
        raise CacheFileError(f"schema {doc.get('schema')!r}, this ringjax reads schema {SCHEMA_VERSION}")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise CacheFileError("'entries' is not an object")
    for name, entry in entries.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("key"), dict)
                and isinstance(entry.get("config"), dict)):
            raise CacheFileError(f"entry {name!r} lacks a 'key' or 'config' object")
    return doc


def make_entry(key: dict[str, Any], config_type: str, config: dict[str, Any], **measured) -> dict[str, Any]:
    """One tuned result; `measured` holds timings and provenance (median_s, candidates, ...)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return {"key": key, "config_type": config_type, "config": config, "tuned_at": stamp, **measured}


# ---------------------------------------------------------------------------- store


class Store:
    """One JSON file of entries, safe against concurrent writers and bad files."""

    def __init__(self, path: Path, device_kind: str, *, writable: bool = True):
        self.path = Path(path)
        self.device_kind = device_kind
        self.writable = writable
        self._memo: tuple[Any, dict[str, Any]] | None = None

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no flock (Windows): atomic replace only, last writer wins
            yield
            return
        while True:
            with open(self.lock_path, "a+") as lock:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                try:
                    # `clear` may have removed the lock file while we waited: lock the current one
                    current = os.path.exists(self.lock_path) and (
                        os.stat(self.lock_path).st_ino == os.fstat(lock.fileno()).st_ino)
                    if current:
                        yield
                        return
                finally:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _set_aside(self, why: str) -> None:
        """Rename a bad file to <name>.bad-<time>-<pid> (under the lock, if it is still bad)."""
        if not self.writable:
            _warn_once(self.path, f"ignoring {self.path}: {why}")
            return
        try:
            with self._locked():
                try:
                    parse_document(self.path.read_text())
                    return  # another process already replaced it with a good file
                except FileNotFoundError:
                    return
                except (CacheFileError, OSError, UnicodeDecodeError):
                    pass
                stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
                aside = self.path.with_name(f"{self.path.name}.bad-{stamp}-{os.getpid()}")
                os.replace(self.path, aside)
            _warn_once(self.path, f"{self.path} {why}; moved it to {aside.name} and continuing without it")
        except OSError as e:
            _warn_once(self.path, f"{self.path} {why}; could not move it aside ({e}), ignoring it")

    def _read_unlocked(self) -> dict[str, Any] | None:
        """The document on disk, None if absent; raises CacheFileError if bad."""
        try:
            text = self.path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except UnicodeDecodeError:
            raise CacheFileError("not UTF-8 text") from None
        return parse_document(text)

    def entries(self) -> dict[str, Any]:
        """All entries on disk (empty if the file is absent or bad); reads are lock-free."""
        try:
            st = self.path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            _warn_once(self.path, f"cannot read {self.path} ({e}), ignoring it")
            return {}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._memo is not None and self._memo[0] == stamp:
            return self._memo[1]
        try:
            doc = self._read_unlocked()
        except CacheFileError as e:
            self._set_aside(str(e))
            return {}
        except OSError as e:
            _warn_once(self.path, f"cannot read {self.path} ({e}), ignoring it")
            return {}
        entries = {} if doc is None else doc["entries"]
        self._memo = (stamp, entries)
        return entries

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        entry = self.entries().get(key_id(key))
        return entry if entry is not None and entry.get("key") == key else None

    def _rewrite(self, change) -> bool:
        """Under the lock: read, apply `change(entries)`, write atomically. False if it could not."""
        if not self.writable:
            raise PermissionError(f"{self.path} is read-only")
        try:
            with self._locked():
                try:
                    doc = self._read_unlocked()
                except CacheFileError as e:
                    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
                    aside = self.path.with_name(f"{self.path.name}.bad-{stamp}-{os.getpid()}")
                    os.replace(self.path, aside)
                    _warn_once(self.path, f"{self.path} {e}; moved it to {aside.name} and starting a new file")
                    doc = None
                if doc is None:
                    doc = empty_document(self.device_kind)
                change(doc["entries"])
                fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(doc, f, indent=1, sort_keys=True)
                        f.write("\n")
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            _warn_once(self.path, f"cannot write {self.path} ({e}); tuned configs stay in memory only")
            return False
        return True

    def merge(self, new_entries: dict[str, Any]) -> bool:
        """Add or replace entries by id, keeping everything else on disk."""
        return self._rewrite(lambda entries: entries.update(new_entries))

    def put(self, entry: dict[str, Any]) -> bool:
        return self.merge({key_id(entry["key"]): entry})

    def remove(self, ids) -> bool:
        ids = set(ids)

        def drop(entries):
            for name in ids & set(entries):
                del entries[name]

        return self._rewrite(drop)

    def clear(self) -> bool:
        """Delete the file (under the lock)."""
        try:
            with self._locked():
                for path in (self.path, self.lock_path):  # the lock goes too: nothing is left behind
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        except OSError as e:
            _warn_once(self.path, f"cannot clear {self.path} ({e})")
            return False
        self._memo = None
        return True


_stores: dict[tuple[str, bool], Store] = {}
_stores_lock = threading.Lock()


def user_store(device_kind: str) -> Store:
    path = user_path(device_kind)
    with _stores_lock:
        store = _stores.get((str(path), True))
        if store is None:
            store = _stores[(str(path), True)] = Store(path, device_kind)
        return store


def shipped_store(device_kind: str) -> Store:
    path = shipped_path(device_kind)
    with _stores_lock:
        store = _stores.get((str(path), False))
        if store is None:
            store = _stores[(str(path), False)] = Store(path, device_kind, writable=False)
        return store


def lookup(op: str, implementation: str, problem) -> tuple[str, dict[str, Any]] | None:
    """("persistent" | "shipped", entry) for `problem`, user store first, or None."""
    entry = user_store(problem.device_kind).get(cache_key(op, implementation, problem))
    if entry is not None:
        return "persistent", entry
    entry = shipped_store(problem.device_kind).get(portable_key(op, implementation, problem))
    if entry is not None:
        return "shipped", entry
    return None


def is_current(entry: dict[str, Any]) -> bool:
    """Whether a user-store entry was tuned with the versions installed now."""
    return entry.get("key", {}).get("versions") == versions()


def user_files() -> list[Path]:
    directory = cache_dir()
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("*.json") if p.is_file())


def shipped_files() -> list[Path]:
    return sorted(p for p in shipped_dir().glob("*.json") if p.is_file())


def read_document(path: Path) -> dict[str, Any]:
    """Parse any cache/export file (raises CacheFileError or OSError)."""
    return parse_document(Path(path).read_text())
