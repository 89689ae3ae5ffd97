"""Result rows are flat, atomic, never overwritten, and load into pandas."""

import json
import os
import stat

import pytest

from analysis.rows import load_results
from memo.config import ConfigError
from memo.results import ResultWriter, flatten, write_json_atomic


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


def test_writer_refuses_a_directory_with_earlier_results(tmp_path):
    writer = ResultWriter(tmp_path)
    writer.append_step({"step": 1, "loss": 2.0})
    writer.append_step({"step": 2, "loss": 1.5})
    writer.write_result({"status": "ok"})
    before = (tmp_path / "result.json").read_bytes()
    with pytest.raises(ConfigError, match="exists from an earlier run"):
        ResultWriter(tmp_path)
    assert (tmp_path / "result.json").read_bytes() == before
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


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
