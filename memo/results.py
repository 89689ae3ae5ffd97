"""The files a run leaves in its output directory, written by rank 0 only.

* ``result.json``: one flat row (config fields as dotted keys, status, metrics, provenance),
  written once, atomically (a temporary file renamed over), so a reader never sees half a row.
* ``metrics.jsonl``: one JSON line per training step, appended and flushed as the step ends, so
  a long run shows progress and a crash keeps every finished step.

Neither file is ever overwritten: a directory that already holds them is refused up front.
"""

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

from memo.config import ConfigError

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


def json_text(obj: Any) -> str:
    """``obj`` as the JSON that result files hold: indented, keys sorted, a final newline."""
    return json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n"


def _write_beside(path: Path, data: bytes) -> str:
    """A temporary file in ``path``'s directory holding ``data``, on disk; returns its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide results from the rest of a team
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


def create_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a new file ``path`` in one step; an existing file is never replaced.

    Raises:
        FileExistsError: if ``path`` exists (also if it appears while writing).
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists and is kept; choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_beside(path, text.encode())
    try:
        os.link(tmp, path)  # unlike a rename, fails if the path appeared meanwhile
    finally:
        os.unlink(tmp)


def git_revision(repo: Path) -> tuple[Optional[str], Optional[bool]]:
    """(commit, dirty) of the checkout at ``repo``, or (None, None) outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


class ResultWriter:
    """Writes one run's ``result.json`` and ``metrics.jsonl`` into ``output_dir`` (if enabled).

    Raises:
        ConfigError: if ``output_dir`` already holds a result of an earlier run.
    """

    def __init__(self, output_dir: Path, enabled: bool = True):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        if not enabled:
            return
        for name in (RESULT_FILE, METRICS_FILE, LAYERS_FILE):
            if (self.output_dir / name).exists():
                raise ConfigError(
                    f"{self.output_dir / name} exists from an earlier run and is kept; "
                    "give this run another hydra.run.dir"
                )
        self.output_dir.mkdir(parents=True, exist_ok=True)

    def append_step(self, record: Mapping[str, Any]) -> None:
        """Append one step's record to ``metrics.jsonl``."""
        self._append(METRICS_FILE, [record])

    def append_layers(self, records: list[Mapping[str, Any]]) -> None:
        """Append one step's per-layer records (activation accounting) to ``layers.jsonl``."""
        self._append(LAYERS_FILE, records)

    def _append(self, name: str, records: list[Mapping[str, Any]]) -> None:
        if self.enabled and records:
            with open(self.output_dir / name, "a") as f:
                f.writelines(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records)

    def write_result(self, row: Mapping[str, Any]) -> Optional[Path]:
        """Write the run's row to ``result.json``; returns its path (None when disabled)."""
        if not self.enabled:
            return None
        path = self.output_dir / RESULT_FILE
        write_json_atomic(path, dict(row))
        return path
