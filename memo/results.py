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

import fcntl
import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import yaml

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


def config_row(cfg) -> dict[str, Any]:
    """A composed configuration (a DictConfig, its ``hydra`` node left out: its runtime fields
    exist only inside a running job) as a row's flat columns: resolved, or as written where an
    interpolation cannot be (``model=hf`` without a readable checkpoint, which the job refuses)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    def tree(resolve: bool) -> dict:
        return {key: OmegaConf.to_container(cfg[key], resolve=resolve) if OmegaConf.is_config(cfg[key]) else cfg[key]
                for key in cfg if key != "hydra"}

    try:
        return flatten(tree(resolve=True))
    except InterpolationResolutionError:
        return flatten(tree(resolve=False))


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


def _owner(output_dir: Path) -> Optional[dict]:
    """Who claimed ``output_dir`` (host, pid, claimed), or None: no claim, or one still being written."""
    try:
        owner = json.loads((output_dir / CLAIM_FILE).read_text())
        return owner if isinstance(owner, dict) and {"host", "pid", "claimed"} <= owner.keys() else None
    except (OSError, ValueError):
        return None


def _stopped(output_dir: Path, owner: Optional[dict]) -> bool:
    """Whether the run in ``output_dir`` has stopped without finishing: its claim's process is gone
    from this host (killed before it could write a row, or after), or, for a claim this host cannot
    check (another host's, or none), its row (written as a run ends) says it did not finish: any
    status but ``ok``. A run killed on another host leaves no row: it cannot be told from a running
    one here."""
    if owner is not None and owner["host"] == socket.gethostname():
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            return False
        return False
    try:
        row = _read_row(output_dir)
    except ValueError:
        row = None
    return row is not None and row.get("status") != "ok"


def _who(owner: Optional[dict]) -> str:
    return f"claimed {owner['claimed']} by process {owner['pid']} on {owner['host']}" if owner else "claimed a moment ago"


def _taken(output_dir: Path) -> RunDirTaken:
    owner = _owner(output_dir)
    who = _who(owner)
    hint = "; train.resume=true continues it" if _stopped(output_dir, owner) else ""
    return RunDirTaken(f"{output_dir} holds another run ({who}){hint}; it is kept; "
                       "give this run another hydra.run.dir (hydra.sweep.dir in a sweep)")


# what a continuation may change: how far it goes (a decaying schedule's end with it, which the
# checkpoint's own check holds to the rates it was trained at), and that it is one
_FREE_SETTINGS = ("train.steps", "train.resume", "train.lr_decay_steps", "train.lr_wsd_decay_steps")


def continue_run_dir(output_dir: Path, config_files: Mapping[str, str]) -> None:
    """``train.resume=true``: take over ``output_dir`` from the stopped run of the same settings in
    it (interrupted, failed, or its process gone), or claim it afresh (:func:`claim_run_dir`) where
    it holds no run. The earlier run's ``.hydra/`` is kept; its row and a copy of its step logs go
    to ``interrupted/<n>/``, and the logs are cut back by the run once it knows the step it goes on
    from (:meth:`ResultWriter.keep_steps_through`).

    Of two continuations started at once exactly one goes on: each checks and takes the claim
    under an exclusive lock of it, and the second finds the first's claim, running. A refused
    continuation changes nothing in the directory.

    Raises:
        RunDirTaken: a finished run, one still running, or one of other settings (the first named).
        ConfigError: if the directory cannot be written.
    """
    output_dir = Path(output_dir)
    if not any((output_dir / name).exists() for name in (CLAIM_FILE, RESULT_FILE, *STEP_FILES)):
        claim_run_dir(output_dir, config_files)
        return
    with _locked_claim(output_dir) as unclaimed:
        try:
            row = _read_row(output_dir)
        except ValueError:
            row = None
        if row is not None and row.get("status") == "ok":
            raise RunDirTaken(f"{output_dir} holds a finished run (status ok); it is kept; give this run another "
                              "hydra.run.dir")
        owner = _owner(output_dir)
        if not unclaimed and not _stopped(output_dir, owner):
            raise RunDirTaken(f"{output_dir} holds a run in progress ({_who(owner)}); it is kept; give this run "
                              "another hydra.run.dir")
        _check_same_settings(output_dir, config_files.get("config.yaml", ""))
        claim = json_text({"host": socket.gethostname(), "pid": os.getpid(), "claimed": now(),
                           "continues": owner})
        try:
            replace_file_atomic(output_dir / CLAIM_FILE, claim.encode())
            # the stopped attempt's row and step logs, kept whole beside its successor's
            target = _set_aside_dir(output_dir)
            target.mkdir(parents=True)
            for name in STEP_FILES:
                if (output_dir / name).exists():
                    shutil.copyfile(output_dir / name, target / name)
            if (output_dir / RESULT_FILE).exists():
                os.replace(output_dir / RESULT_FILE, target / RESULT_FILE)
        except OSError as error:
            raise _unwritable(output_dir, error) from None


@contextmanager
def _locked_claim(output_dir: Path) -> Iterator[bool]:
    """An exclusive lock of ``output_dir``'s claim, released when the block ends or the process
    dies; yields whether the directory had no claim (one is made, empty, and removed again if the
    block fails). The claim is opened for writing: NFS locks a file so, and Lustre where mounted
    with ``flock``.

    Raises:
        ConfigError: the claim cannot be made, or this file system cannot lock it.
    """
    path = output_dir / CLAIM_FILE
    try:
        try:
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, made = os.open(path, os.O_RDWR), False
    except OSError as error:
        raise _unwritable(path, error) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as error:
            raise ConfigError(f"cannot lock {path} ({error.strerror}): this file system does not lock files; continue "
                              "the run where it does, or start a new one in another hydra.run.dir") from None
        yield made
    except BaseException:
        if made:
            path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _check_same_settings(output_dir: Path, config_text: str) -> None:
    """Refuse to continue the run in ``output_dir`` with settings (``config_text``, the composed
    configuration as YAML) other than its own, but for :data:`_FREE_SETTINGS`."""
    try:
        theirs = flatten(yaml.safe_load((output_dir / CONFIG_DIR / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError) as error:
        raise RunDirTaken(f"{output_dir} holds a run whose settings cannot be read ({CONFIG_DIR}/config.yaml: "
                          f"{getattr(error, 'strerror', None) or error}); it is kept; give this run another "
                          "hydra.run.dir") from None
    ours = flatten(yaml.safe_load(config_text) or {})
    for key in sorted(theirs.keys() & ours.keys()):  # (a key one version lacks: its default, unknown here)
        if key not in _FREE_SETTINGS and theirs.get(key) != ours.get(key):
            raise RunDirTaken(f"{output_dir} holds a run with {key}={theirs.get(key)} (this run: {ours.get(key)}); "
                              "continue it with its own settings (train.steps may be raised), or give this run "
                              "another hydra.run.dir")


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


def _set_aside_dir(output_dir: Path) -> Path:
    """Where the next unfinished attempt's files go: ``interrupted/<n>/``, n the first free."""
    n = 1
    while (output_dir / SET_ASIDE_DIR / str(n)).exists():
        n += 1
    return output_dir / SET_ASIDE_DIR / str(n)


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
    target = _set_aside_dir(output_dir)
    target.mkdir(parents=True)
    for path in present:
        shutil.move(path, target / path.name)
    return target


def _step_of(line: str) -> int:
    """The step of a step log's line; -1 for a line that is not a record."""
    try:
        record = json.loads(line)
    except ValueError:
        return -1
    return record.get("step", -1) if isinstance(record, dict) else -1


class ResultWriter:
    """Writes one run's ``result.json`` and step logs into ``output_dir`` (if enabled).

    The directory must have been claimed (:func:`claim_run_dir`) by this run.
    """

    def __init__(self, output_dir: Path, enabled: bool = True):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.steps = 0  # step records appended

    def keep_steps_through(self, step: int) -> None:
        """A continued run (``train.resume``) goes on after ``step``: the step logs keep the records
        of steps 1..``step`` only (those after it are trained again; the placement records of step
        0 are the new attempt's), each file replaced whole."""
        if not self.enabled:
            return
        for name in STEP_FILES:
            path = self.output_dir / name
            if not path.exists():
                continue
            try:
                lines = [line for line in path.read_text().splitlines(keepends=True) if 1 <= _step_of(line) <= step]
                replace_file_atomic(path, "".join(lines).encode())
            except OSError as error:
                raise _unwritable(path, error) from None
            if name == METRICS_FILE:
                self.steps = len(lines)

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
