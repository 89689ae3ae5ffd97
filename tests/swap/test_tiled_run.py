"""A training run whose layers are walked in tiles that swap: its row records the tiles, α per
tile (summarised; each tile's in ``layers.jsonl``) and the checkpoint interval, and its steps the
tile buffers and what each layer sent out."""

import pandas as pd
import pytest

from conftest import run_in_process


def test_a_run_records_alpha_per_tile_and_the_checkpoint_interval(tmp_path):
    row = run_in_process(tmp_path, "method=memo", "method.tile_tokens=64", "seq=256", "model=tiny_llama",
                         "model.num_layers=2", "model.vocab_size=1000", "train.steps=2",
                         "train.warmup_steps=1")
    assert row["status"] == "ok", row["error"]
    assert (row["tiles.tiles"], row["tiles.tile_tokens"], row["tiles.buffers"]) == (4, 64, 2)
    assert row["tiles.checkpoint_every"] == 1  # the host is this machine's: every input fits
    assert 0 <= row["tiles.alpha_min"] <= row["tiles.alpha_mean"] <= row["tiles.alpha_max"] <= 1
    # keys, values and their float32 gradients: 256 tokens of 2 groups of 32; the input store
    assert row["tiles.store_bytes"] == 4 * 256 * 64 * 4 + 256 * 256 * 4
    records = pd.read_json(tmp_path / "layers.jsonl", lines=True)
    tiles = records.dropna(subset=["tile"])
    assert tiles["tile"].tolist() == [0, 1, 2, 3]
    assert tiles["alpha"].mean() == pytest.approx(row["tiles.alpha_mean"])
    assert set(tiles["binding"]) <= {"bandwidth", "host", "none"}
    assert (tiles["keep_tokens"] == (tiles["alpha"] * 64).round()).all()
    steps = pd.read_json(tmp_path / "metrics.jsonl", lines=True)
    assert (steps["skeletal_device_bytes"] == row["tiles.tile_buffer_bytes"]).all()
    layers = records.dropna(subset=["host_bytes"])
    assert sorted(layers["layer"].unique()) == [0, 1]
    # every tile but the last layer's last two sends its part out, and both layers their input
    # (256 tokens of 256 in fp32), each step
    per_tile = row["tiles.skeletal_attention_bytes"] + row["tiles.skeletal_other_bytes"] * tiles["keep_tokens"] // 64
    inputs = 2 * 256 * 256 * 4
    assert layers.groupby("step")["host_bytes"].sum().tolist() == [per_tile.sum() + per_tile[:2].sum() + inputs] * 2
    assert row["tiles.host_bytes"] == per_tile.sum() + per_tile[:2].sum() + inputs
