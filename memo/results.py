"""The files a run leaves in its output directory, written by rank 0 only.

* ``.memo-run``: the claim. It is created exclusively before anything else is written, so of two
  runs given one directory exactly one goes on; the other is refused and writes nothing there.
* ``.hydra/``: the composed configuration, the Hydra configuration and the overrides, written
  after the claim (Hydra's own copy is switched off: it would overwrite a refused run's).
* ``result.json``: one flat row (config fields as dotted keys, status, metrics, provenance),
  written once, atomically (a temporary file renamed over), so a reader never sees half a row.
* ``metrics.jsonl``: one JSON line per training step, appended and flushed as the step ends, so
  a long run shows progress and a crash keeps every finished step. An append that fails (a full
  disk) is cut back to the last whole line.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from memo.config import ConfigError

CLAIM_FILE = ".memo-run"
CONFIG_DIR = ".hydra"
SET_ASIDE_DIR = "interrupted"
# a run's checkpoints (train.save_dir's default): an interrupted attempt leaves them in place for
# the next attempt to go on from
CHECKPOINTS_DIR = "checkpoints"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
LAYERS_FILE = "layers.jsonl"  # per step and layer: activation bytes on device, on host, recomputed
STEP_FILES = (METRICS_FILE, LAYERS_FILE)  # appended while a run goes on


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys; lists become comma-separated strings."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = ",".join(str(v) for v in value)
        else:
            flat[name] = value
    return flat


def finite(value: Any) -> Any:
    """``value``, or None where it is an infinite or NaN float: JSON has no such numbers, and a
    row's reader takes None as "no figure" (an unbounded α bound, say)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def json_text(obj: Any) -> str:
    """``obj`` as the JSON that result files hold: indented, keys sorted, a final newline."""
    return json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n"


def new_file_mode() -> int:
    """The mode ``open`` gives a new file here: 0o666 less the process's umask (read from
    ``/proc`` where it can be, which leaves the umask untouched for other threads)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        mask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def _write_beside(path: Path, data: bytes) -> str:
    """A temporary file in ``path``'s directory holding ``data``, on disk; returns its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp's 0600 would hide results from the rest of a team
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def replace_file_atomic(path: Path, data: bytes) -> None:
    """Create or replace ``path`` with ``data`` so that a reader sees the old file or all of
    the new one, never a part."""
    path = Path(path)
    tmp = _write_beside(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so that ``path`` holds either nothing or all of it."""
    replace_file_atomic(path, json_text(obj).encode())


def read_cache(path: Path) -> dict:
    """The entries of the JSON cache at ``path``: none where it is missing, unreadable or not an object."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_cache(path: Path, entries: dict) -> None:
    """Record ``entries`` as the JSON cache at ``path`` (atomically, its folder made); a cache that
    cannot be written is passed over: the next process measures again."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, entries)
    except OSError:
        pass


def create_file_atomic(path: Path, text: Union[str, bytes]) -> None:
    """Write ``text`` (or bytes) to a new file ``path`` in one step; an existing file is never replaced.

    Raises:
        FileExistsError: if ``path`` exists (also if it appears while writing).
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists and is kept; choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_beside(path, text.encode() if isinstance(text, str) else text)
    try:
        os.link(tmp, path)  # unlike a rename, fails if the path appeared meanwhile
    finally:
        os.unlink(tmp)


def git_revision(repo: Path, paths: tuple[str, ...] = ()) -> tuple[Optional[str], Optional[bool]]:
    """(commit, dirty) of the checkout at ``repo``, or (None, None) outside a git checkout;
    ``paths`` limits "dirty" to changes under them."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--", *paths))
    except (OSError, subprocess.SubprocessError):
        return None, None


def now() -> str:
    """The current UTC time as the rows record it (ISO 8601, seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunDirTaken(ConfigError):
    """The run directory belongs to another run (finished, running, or stopped)."""


def _unwritable(path: Path, error: OSError) -> ConfigError:
    return ConfigError(f"cannot write {path}: {error.strerror or error}; "
                       "choose a writable hydra.run.dir (hydra.sweep.dir in a sweep) with free space")


def claim_run_dir(output_dir: Path, config_files: Optional[Mapping[str, str]] = None) -> None:
    """Make ``output_dir`` this run's before anything is written into it, then write
    ``config_files`` (name → text) into its ``.hydra/``.

    The claim is an exclusive create, so of two runs started into one directory at the same
    moment exactly one wins. A refused run changes nothing in the directory.

    Raises:
        RunDirTaken: if the directory holds another run's claim or files.
        ConfigError: if the directory cannot be written (read-only, full disk).
    """
    output_dir = Path(output_dir)
    marker = output_dir / CLAIM_FILE
    if marker.exists():
        raise _taken(output_dir)
    earlier = [name for name in (RESULT_FILE, *STEP_FILES) if (output_dir / name).exists()]
    if earlier:  # a run from before claims existed
        raise RunDirTaken(f"{output_dir / earlier[0]} exists from an earlier run and is kept; "
                          "give this run another hydra.run.dir (hydra.sweep.dir in a sweep)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:  # claimed a moment ago
        raise _taken(output_dir) from None
    except OSError as error:
        raise _unwritable(output_dir, error) from None
    owner = json_text({"host": socket.gethostname(), "pid": os.getpid(), "claimed": now()}).encode()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(owner)
        for name, text in (config_files or {}).items():
            create_file_atomic(output_dir / CONFIG_DIR / name, text)
    except OSError as error:
        raise _unwritable(output_dir, error) from None


def _taken(output_dir: Path) -> RunDirTaken:
    try:  # the claim may be still being written by its owner
        owner = json.loads((output_dir / CLAIM_FILE).read_text())
        who = f"claimed {owner['claimed']} by process {owner['pid']} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "claimed a moment ago"
    return RunDirTaken(f"{output_dir} holds another run ({who}); it is kept; "
                       "give this run another hydra.run.dir (hydra.sweep.dir in a sweep)")


def _read_row(output_dir: Path) -> Optional[dict]:
    """The row in ``output_dir``, None if there is none.

    Raises:
        ValueError: if the row cannot be read as one.
    """
    try:
        row = json.loads((Path(output_dir) / RESULT_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{Path(output_dir) / RESULT_FILE}: {error}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{Path(output_dir) / RESULT_FILE}: not a row")
    return row


def read_rows(*dirs: Union[str, Path]) -> list[dict]:
    """Every row (``result.json``) under ``dirs``, searched recursively, each with its
    ``result_path``.

    Raises:
        ValueError: if there is none, or one is not a JSON object.
    """
    paths = [path for d in dirs for path in sorted(Path(d).rglob(RESULT_FILE))]
    if not paths:
        missing = [str(d) for d in dirs if not Path(d).is_dir()]
        note = f" ({', '.join(missing)} not a directory)" if missing else ""
        raise ValueError(f"no {RESULT_FILE} under {', '.join(map(str, dirs)) or 'no directory'}{note}")
    rows = []
    for path in paths:
        try:
            row = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: not a JSON object")
        rows.append({**row, "result_path": str(path)})
    return rows


def finished_row(output_dir: Path) -> Optional[dict]:
    """The row in ``output_dir`` if its run finished (any status but ``interrupted``), else None
    (no row, an interrupted one, or one that cannot be read)."""
    try:
        row = _read_row(output_dir)
    except ValueError:
        return None
    return row if row is not None and row.get("status") != "interrupted" else None


def set_aside_unfinished(output_dir: Path) -> Optional[Path]:
    """Move an unfinished attempt's files (everything but earlier set-aside attempts and the
    checkpoints) to
    ``interrupted/<n>/`` so that a new attempt can claim ``output_dir``; returns where, or None.

    An attempt is unfinished when it claimed the directory (or left step logs) and has no row,
    its row says ``interrupted``, or its row cannot be read (damaged after it was written: moved
    with the rest, byte for byte, for whoever wants to look). A finished attempt is never moved.
    """
    output_dir = Path(output_dir)
    if finished_row(output_dir) is not None:
        return None
    present = [p for p in output_dir.iterdir() if p.name not in (SET_ASIDE_DIR, CHECKPOINTS_DIR)] \
        if output_dir.is_dir() else []
    if not any(p.name in (CLAIM_FILE, RESULT_FILE, *STEP_FILES) for p in present):
        return None
    n = 1
    while (output_dir / SET_ASIDE_DIR / str(n)).exists():
        n += 1
    target = output_dir / SET_ASIDE_DIR / str(n)
    target.mkdir(parents=True)
    for path in present:
        shutil.move(path, target / path.name)
    return target


class ResultWriter:
    """Writes one run's ``result.json`` and step logs into ``output_dir`` (if enabled).

    The directory must have been claimed (:func:`claim_run_dir`) by this run.
    """

    def __init__(self, output_dir: Path, enabled: bool = True):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.steps = 0  # step records appended

    def append_step(self, record: Mapping[str, Any]) -> None:
        """Append one step's record to ``metrics.jsonl``."""
        self._append(METRICS_FILE, [record])
        self.steps += 1

    def append_layers(self, records: list[Mapping[str, Any]]) -> None:
        """Append one step's per-layer records (activation accounting) to ``layers.jsonl``."""
        self._append(LAYERS_FILE, records)

    def _append(self, name: str, records: list[Mapping[str, Any]]) -> None:
        if not (self.enabled and records):
            return
        data = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records).encode()
        path = self.output_dir / name
        try:
            with open(path, "ab") as f:
                size = f.tell()
                try:
                    f.write(data)
                    f.flush()
                except OSError:
                    f.truncate(size)  # no half line: the log stays one JSON object per line
                    raise
        except OSError as error:
            raise _unwritable(path, error) from None

    def write_result(self, row: Mapping[str, Any]) -> Optional[Path]:
        """Write the run's row to ``result.json``; returns its path (None when disabled).

        Raises:
            ConfigError: if it cannot be written (nothing of it is left behind then).
        """
        if not self.enabled:
            return None
        path = self.output_dir / RESULT_FILE
        try:
            write_json_atomic(path, dict(row))
        except OSError as error:
            raise _unwritable(path, error) from None
        return path
