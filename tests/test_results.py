"""Result rows are flat, atomic, never overwritten, and load into pandas."""

import errno
import io
import json
import os
import signal
import stat
import sys
import weakref

import pytest
from omegaconf import OmegaConf

import memo.results
from analysis.rows import load_results
from memo.config import ConfigError
from memo.modes.frame import job_frame
from memo.results import ResultWriter, RunDirTaken, claim_run_dir, flatten, write_json_atomic

from conftest import file_hashes


def test_flatten_gives_dotted_keys_and_joins_lists():
    tree = {"model": {"name": "7b", "shape": {"layers": 32}}, "seq": 4096, "modules": ["core_attn", "mlp"]}
    assert flatten(tree) == {
        "model.name": "7b", "model.shape.layers": 32, "seq": 4096, "modules": "core_attn,mlp"
    }


def test_atomic_write_leaves_only_the_file(tmp_path):
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "ok", "mfu": 0.5})
    assert json.loads(path.read_text()) == {"mfu": 0.5, "status": "ok"}
    assert os.listdir(tmp_path) == ["result.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "ok"})
    with pytest.raises(TypeError):
        write_json_atomic(path, {1j: "complex keys are not JSON"})
    assert json.loads(path.read_text()) == {"status": "ok"}
    assert os.listdir(tmp_path) == ["result.json"]


def test_a_claimed_directory_is_refused_and_left_as_it_is(tmp_path):
    claim_run_dir(tmp_path, {"config.yaml": "seq: 1k\n"})
    writer = ResultWriter(tmp_path)
    writer.append_step({"step": 1, "loss": 2.0})
    writer.append_step({"step": 2, "loss": 1.5})
    writer.write_result({"status": "ok"})
    before = file_hashes(tmp_path)
    with pytest.raises(RunDirTaken, match=r"holds another run \(claimed .* by process \d+ on "):
        claim_run_dir(tmp_path, {"config.yaml": "seq: 2k\n"})
    assert file_hashes(tmp_path) == before
    assert writer.steps == 2


def test_a_directory_with_results_from_before_claims_is_refused(tmp_path):
    write_json_atomic(tmp_path / "result.json", {"status": "ok"})
    with pytest.raises(RunDirTaken, match="result.json exists from an earlier run and is kept"):
        claim_run_dir(tmp_path)
    assert os.listdir(tmp_path) == ["result.json"]


def test_a_full_disk_cuts_a_step_log_back_to_whole_lines(tmp_path, monkeypatch):
    claim_run_dir(tmp_path)
    writer = ResultWriter(tmp_path)
    writer.append_step({"step": 1})

    class HalfWritten(io.FileIO):  # the disk fills up in the middle of the line
        def write(self, data):
            super().write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memo.results, "open", lambda path, mode: HalfWritten(path, mode), raising=False)
    with pytest.raises(ConfigError, match=r"^cannot write .*metrics.jsonl: No space left on device; choose "):
        writer.append_step({"step": 2, "loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_row_that_cannot_be_written_leaves_nothing_behind(tmp_path, monkeypatch):
    claim_run_dir(tmp_path)
    real_fsync = os.fsync

    def full(fd):
        real_fsync(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ConfigError, match=r"^cannot write .*result.json: No space left on device"):
        ResultWriter(tmp_path).write_result({"status": "ok"})
    assert os.listdir(tmp_path) == [".memo-run"]


def test_a_read_only_directory_is_refused_in_one_line(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"^cannot write .*: Read-only file system; choose a writable "
                                          r"hydra.run.dir"):
        claim_run_dir(tmp_path / "run")


def test_disabled_writer_writes_nothing(tmp_path):
    writer = ResultWriter(tmp_path / "rank1", enabled=False)
    writer.append_step({"step": 1})
    assert writer.write_result({"status": "ok"}) is None
    assert not (tmp_path / "rank1").exists()


def test_rows_load_into_one_dataframe(tmp_path):
    for i, (seq, status) in enumerate([(1024, "ok"), (2048, "oom")]):
        (tmp_path / "sweep" / str(i)).mkdir(parents=True)
        write_json_atomic(tmp_path / "sweep" / str(i) / "result.json", {"seq": seq, "status": status})
    (tmp_path / "sweep" / "2").mkdir()  # a job still running: no row yet
    frame = load_results(tmp_path / "sweep")
    assert sorted(frame["seq"]) == [1024, 2048]
    assert set(frame["status"]) == {"ok", "oom"}
    assert all(frame["result_path"].str.endswith("result.json"))


@pytest.fixture
def signals_as_python_sets_them():
    """SIGINT and SIGTERM as a Python started in the foreground has them (a suite started in the
    background by a shell inherits SIGINT ignored, which a job rightly leaves alone)."""
    previous = {s: signal.signal(s, d) for s, d in ((signal.SIGINT, signal.default_int_handler),
                                                     (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_in_a_finalizer_ends_the_job_at_its_next_step_and_prints_nothing(tmp_path, monkeypatch, signum,
                                                                                       signals_as_python_sets_them):
    # Python prints and drops an exception raised inside a finalizer: a signal that lands there
    # (RoPE's tables are dropped by weakref.finalize every step) raises nothing there and still
    # stops the job
    class Table:
        pass

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    with pytest.raises(KeyboardInterrupt):
        with job_frame(OmegaConf.create({"a": 1}), tmp_path / "job") as job:
            table = Table()
            weakref.finalize(table, os.kill, os.getpid(), signum)
            del table  # the handler runs inside the finalizer and keeps its interrupt for the step's end
            assert len(job.stops) == 1 and dropped == []
            job.stop_if_signalled()
    row = json.loads((tmp_path / "job" / "result.json").read_text())
    assert row["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_job_that_finishes_after_a_dropped_stop_keeps_its_ok_row(tmp_path, monkeypatch, signals_as_python_sets_them):
    class Table:
        pass

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    with job_frame(OmegaConf.create({"a": 1}), tmp_path / "job") as job:
        table = Table()
        weakref.finalize(table, os.kill, os.getpid(), signal.SIGTERM)
        del table  # after the last step's check: nothing raises it
        assert len(job.stops) == 1
    assert json.loads((tmp_path / "job" / "result.json").read_text())["status"] == "ok"


def test_a_schedulers_exit_dropped_in_a_finalizer_makes_what_fails_after_it_an_interruption(tmp_path, monkeypatch):
    # submitit's handler of SIGUSR2 requeues the job and raises SystemExit; raised inside a fork's
    # callback (a checkpoint writer's) or a finalizer, Python drops it, the job goes on, and its save
    # fails once the scheduler has ended the writer's helper: the row must still say interrupted,
    # and the exit must still end the task (no result for submitit, so that the requeued attempt runs)
    def requeue_and_exit(signum, frame):
        raise SystemExit(-1)

    class Table:
        pass

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    before = signal.signal(signal.SIGUSR2, requeue_and_exit)
    try:
        with pytest.raises(SystemExit) as stopped, job_frame(OmegaConf.create({"a": 1}), tmp_path / "job"):
            table = Table()
            weakref.finalize(table, os.kill, os.getpid(), signal.SIGUSR2)
            del table
            raise BrokenPipeError(32, "Broken pipe")
        assert stopped.value.code == -1
        assert signal.getsignal(signal.SIGUSR2) is requeue_and_exit  # given back
    finally:
        signal.signal(signal.SIGUSR2, before)
    row = json.loads((tmp_path / "job" / "result.json").read_text())
    assert row["status"] == "interrupted"
    assert row["error"] == "interrupted by the scheduler (timeout or preemption) after 0 step(s)"


def test_a_run_killed_without_a_row_is_continued_its_logs_cut_back_and_a_live_one_never(tmp_path):
    import socket
    import subprocess

    from memo.results import continue_run_dir

    config = {"config.yaml": "seq: 128\ntrain:\n  steps: 4\n  resume: false\n"}
    claim_run_dir(tmp_path / "run", config)
    gone = subprocess.Popen(["true"])
    gone.wait()
    claim = {"host": socket.gethostname(), "pid": gone.pid, "claimed": "earlier"}
    (tmp_path / "run" / ".memo-run").write_text(json.dumps(claim))
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "run" / "layers.jsonl").write_text("".join(json.dumps({"step": s, "layer": 0}) + "\n"
                                                           for s in (0, 1, 2, 3)))
    with pytest.raises(RunDirTaken, match=r"holds a run with seq=128 \(this run: 256\)"):
        continue_run_dir(tmp_path / "run", {"config.yaml": "seq: 256\ntrain:\n  steps: 4\n"})
    continue_run_dir(tmp_path / "run", {"config.yaml": "seq: 128\ntrain:\n  steps: 9\n  resume: true\n"})
    ours = json.loads((tmp_path / "run" / ".memo-run").read_text())
    assert (ours["pid"], ours["continues"]) == (os.getpid(), claim)
    writer = ResultWriter(tmp_path / "run")
    writer.keep_steps_through(2)
    assert writer.steps == 2
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "layers.jsonl").read_text().splitlines()] == [1, 2]
    # now this process holds it: a second continuation is refused and changes nothing
    before = file_hashes(tmp_path / "run")
    with pytest.raises(RunDirTaken, match=rf"holds a run in progress \(claimed .* by process {os.getpid()} on "):
        continue_run_dir(tmp_path / "run", config)
    assert file_hashes(tmp_path / "run") == before


@pytest.mark.parametrize("status, goes_on", [("error", True), ("oom", True), ("interrupted", True), ("ok", False)])
def test_a_run_that_ended_without_finishing_is_continued_and_a_finished_one_never(tmp_path, status, goes_on):
    from memo.results import continue_run_dir

    config = {"config.yaml": "seq: 128\ntrain:\n  steps: 4\n  lr_decay_steps: null\n"}
    claim_run_dir(tmp_path / "run", config)
    claim = {"host": "another-host", "pid": 1, "claimed": "earlier"}  # this host cannot tell: the row says
    (tmp_path / "run" / ".memo-run").write_text(json.dumps(claim))
    write_json_atomic(tmp_path / "run" / "result.json", {"status": status})
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    longer = {"config.yaml": "seq: 128\ntrain:\n  steps: 8\n  lr_decay_steps: 4\n  resume: true\n"}
    if not goes_on:
        before = file_hashes(tmp_path / "run")
        with pytest.raises(RunDirTaken, match="holds a finished run"):
            continue_run_dir(tmp_path / "run", longer)
        assert file_hashes(tmp_path / "run") == before
        return
    continue_run_dir(tmp_path / "run", longer)
    kept = tmp_path / "run" / "interrupted" / "1"
    assert json.loads((kept / "result.json").read_text()) == {"status": status}
    assert (kept / "metrics.jsonl").read_text() == (tmp_path / "run" / "metrics.jsonl").read_text()
    assert not (tmp_path / "run" / "result.json").exists()
