"""Our Llama and Qwen2 models against Hugging Face ``transformers``' (an implementation we did not
write), started from checkpoints ``transformers`` saved: logits, loss and gradients equal at
tp=1 and at tp=2 with sequence parallelism; checkpoints survive a round trip byte for byte; a
checkpoint of another shape is refused in one line; training from one works with every method."""

import dataclasses
import json
import subprocess

import pytest
import torch

import hf_models
from memo.config import ConfigError
from memo.model import hf_checkpoint
from memo.policy import build_model

from conftest import one_process, resolve_config, run_in_process

pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e '.[dev]')")

MODELS = ["tiny_llama", "tiny_qwen"]


@pytest.mark.parametrize("model", MODELS)
def test_logits_loss_and_gradients_equal_transformers(single_process, tmp_path, model):
    hf = hf_models.make_checkpoint(model, tmp_path)
    ids = hf_models.tokens(hf.config.vocab_size)
    compared = hf_models.compare(hf_models.our_figures(model, tmp_path, ids), hf_models.hf_figures(hf, ids))
    assert compared == 2 + len(list(hf.parameters()))


@pytest.mark.torchrun(2, *(f"hf_models.check_tensor_parallel {model}" for model in MODELS))
def test_logits_loss_and_gradients_equal_transformers_at_tp2_with_sequence_parallelism(torchrun_results):
    for model, result in zip(MODELS, torchrun_results, strict=True):
        for message in result.passed():
            assert message.startswith(f"{model}: logits, loss and "), message


CP_EXCHANGES = ["all_gather", "p2p", "a2a"]


@pytest.mark.torchrun(2, *(f"hf_models.check_context_parallel tiny_llama {comm}" for comm in CP_EXCHANGES))
def test_loss_and_gradients_equal_transformers_at_cp2_with_every_exchange(torchrun_results):
    for comm, result in zip(CP_EXCHANGES, torchrun_results, strict=True):
        for message in result.passed():
            assert message.endswith(f"equal transformers' at cp=2 ({comm})"), message


@pytest.mark.parametrize("model", MODELS)
def test_a_checkpoint_survives_a_round_trip_byte_for_byte(single_process, tmp_path, model):
    import transformers

    hf_models.make_checkpoint(model, tmp_path / "theirs")
    run = resolve_config(f"model={model}", "seq=64")
    gpt = build_model(run.workload, "cpu").module
    hf_checkpoint.load([gpt], run.workload.model, tmp_path / "theirs")
    hf_checkpoint.save([gpt], run.workload.model, tmp_path / "ours")
    weights = hf_checkpoint.WEIGHTS_FILE
    assert (tmp_path / "ours" / weights).read_bytes() == (tmp_path / "theirs" / weights).read_bytes()
    # transformers reads our config.json as the shape it wrote
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "theirs").to_dict()
    ours = transformers.AutoConfig.from_pretrained(tmp_path / "ours").to_dict()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "rope_parameters"):
        assert ours[key] == theirs[key], key
    with pytest.raises(FileExistsError, match="exists and is kept"):
        hf_checkpoint.save([gpt], run.workload.model, tmp_path / "ours")


def test_a_checkpoint_of_another_shape_or_format_is_refused_in_one_line(tmp_path):
    hf_models.make_checkpoint("tiny_qwen", tmp_path)
    llama = resolve_config("model=tiny_llama").workload.model
    with pytest.raises(ConfigError, match=r"ffn_hidden_size=704, and model.ffn_hidden_size=768; set model.ffn_hidden_size=704, "
                                          "or model=hf to read every field from the checkpoint"):
        hf_checkpoint.check_config(llama, tmp_path, tp=1)
    # the value suggested is one the command line takes (config.json's rope_theta is 1000000.0)
    based = resolve_config("model=tiny_qwen", "model.rotary_base=10000").workload.model
    with pytest.raises(ConfigError, match=r"rotary_base=1000000, and model.rotary_base=10000; set "
                                          r"model.rotary_base=1000000, or model=hf"):
        hf_checkpoint.check_config(based, tmp_path, tp=1)
    hf_checkpoint.check_config(resolve_config("model=tiny_qwen", "model.rotary_base=1000000").workload.model,
                               tmp_path, tp=1)
    qwen = resolve_config("model=tiny_qwen", "model.vocab_size=4000").workload.model
    with pytest.raises(ConfigError, match=r"vocab_size=4096, and model.vocab_size=4000"):
        hf_checkpoint.check_config(qwen, tmp_path, tp=1)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type=mistral"):
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").write_text(json.dumps(config | {"use_sliding_window": True}))
    with pytest.raises(ConfigError, match="use_sliding_window=true: our attention is causal over the whole sequence"):
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama", "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias=true"):  # transformers' Llama then biases o_proj
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json; give a directory that transformers' save_pretrained"):
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)


def test_a_checkpoint_with_tensors_the_model_has_no_place_for_is_refused(single_process, tmp_path):
    from safetensors.torch import load_file, save_file

    hf_models.make_checkpoint("tiny_llama", tmp_path)
    weights = tmp_path / hf_checkpoint.WEIGHTS_FILE
    tensors = load_file(weights)
    run = resolve_config("model=tiny_llama", "seq=64")
    gpt = build_model(run.workload, "cpu").module
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(256)}, weights)
    with pytest.raises(ConfigError, match=r"holds model.layers.0.self_attn.o_proj.bias, which the model has no "
                                          r"place for \(0 missing, 1 unused\)"):
        hf_checkpoint.load([gpt], run.workload.model, tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    with pytest.raises(ConfigError, match=r"lacks lm_head.weight \(1 missing, 0 unused\)"):
        hf_checkpoint.load([gpt], run.workload.model, tmp_path)


def test_megatrons_distributed_checkpoint_sees_every_weight(single_process):
    for model in MODELS:
        gpt = build_model(resolve_config(f"model={model}", "seq=64").workload, "cpu").module
        sharded = gpt.sharded_state_dict()
        assert {name for name, _ in gpt.named_parameters()} <= set(sharded), model


def test_tensor_parallel_shards_follow_megatrons_partition_stride():
    # FC1 of SwiGLU: [gate; up], each rank holds its rows of both
    full = torch.arange(8.0).unsqueeze(1)
    param = torch.nn.Parameter(torch.empty(4, 1))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    assert hf_checkpoint.shard(full, param, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert hf_checkpoint.shard(full, param, 1, 2).flatten().tolist() == [2, 3, 6, 7]


@pytest.mark.slow
def test_a_converted_llama_trains_and_memo_follows_keeping_everything(tmp_path):
    hf_models.make_checkpoint("tiny_llama", tmp_path / "checkpoint")
    rows = {method: run_in_process(tmp_path / method, f"method={method}", "model=tiny_llama", "seq=256",
                                   f"model.init_from={tmp_path / 'checkpoint'}", "train.steps=20",
                                   "train.warmup_steps=1")
            for method in ("none", "memo")}
    assert {row["status"] for row in rows.values()} == {"ok"}
    losses = {method: [json.loads(line)["loss"] for line in (tmp_path / method / "metrics.jsonl").open()]
              for method in rows}
    assert len(losses["none"]) == 20 and losses["none"][-1] < losses["none"][0]
    assert losses["memo"] == pytest.approx(losses["none"], abs=1e-5)
    # the first step's loss is the checkpoint's own on the first batch: not a random model's log(V)
    assert abs(losses["none"][0] - torch.log(torch.tensor(8192.0)).item()) > 1e-3


@pytest.mark.parametrize("name", list(hf_models.NEW_SHAPES))
def test_a_model_read_from_its_directory_trains_and_equals_transformers(tmp_path, name):
    hf = hf_models.make_new_checkpoint(name, tmp_path / name)
    ids = hf_models.tokens(hf.config.vocab_size)
    with one_process():
        compared = hf_models.compare(hf_models.our_figures("hf", tmp_path / name, ids), hf_models.hf_figures(hf, ids))
    assert compared == 2 + len(list(hf.parameters()))
    row = run_in_process(tmp_path / "run", "model=hf", f"model.init_from={tmp_path / name}", "seq=64",
                         "train.steps=1")
    assert row["status"] == "ok", row["error"]
    # named after its directory, every field from its config.json: the model transformers has
    assert row["model.name"] == name and row["model.num_layers"] == hf.config.num_hidden_layers
    assert row["params"] == hf.num_parameters()


def test_what_a_directory_holds_is_checked_before_a_model_is_built_each_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "llama_tied_plain"
    hf_models.make_new_checkpoint("llama_tied_plain", directory)
    with pytest.raises(ConfigError, match="model=hf reads the model's shape from a checkpoint: set model.init_from"):
        resolve_config("model=hf")
    model = resolve_config("model=hf", f"model.init_from={directory}").workload.model
    assert (model.name, model.vocab_size, model.make_vocab_size_divisible_by) == ("llama_tied_plain", 1000, 8)
    # a divisor that leaves the vocabulary unpadded at tp=2, in a form the command line takes
    with pytest.raises(ConfigError, match=r"would be padded to 1024 rows at tp=2, .*; set "
                                          r"model.make_vocab_size_divisible_by=125$"):
        hf_checkpoint.check(dataclasses.replace(model, make_vocab_size_divisible_by=128), directory, tp=2)
    fixed = resolve_config("model=hf", f"model.init_from={directory}", "model.make_vocab_size_divisible_by=125",
                           "parallel.tp=2").workload.model
    hf_checkpoint.check_config(fixed, directory, tp=2)

    config = json.loads((directory / "config.json").read_text())
    for change, message in (
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"config.json has rope_scaling=\{\"rope_type\": "
                                                                     r"\"yarn\", .*Megatron-core applies Llama-3.1's only"),
            ({"hidden_act": "gelu"}, "config.json has hidden_act=gelu: our MLP is SwiGLU"),
            ({"rope_theta": 10000.5}, "config.json has rope_theta=10000.5: model.rotary_base is a whole number"),
            ({"model_type": "mistral"}, r"config.json has model_type=mistral: Llama 3.x \(llama\), Qwen2/2.5 "
                                        r"\(qwen2\) and Qwen3")):
        (directory / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ConfigError, match=message):
            resolve_config("model=hf", f"model.init_from={directory}")
    # the file edited: the weights are not of its shape
    (directory / "config.json").write_text(json.dumps(config | {"intermediate_size": 600}))
    edited = resolve_config("model=hf", f"model.init_from={directory}").workload.model
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj.weight is \(512, 192\), and the model's "
                                          r"config.json makes it \(600, 192\)"):
        hf_checkpoint.check(edited, directory, tp=1)
    (directory / "config.json").write_text(json.dumps(config))
    weights = directory / hf_checkpoint.WEIGHTS_FILE
    tensors = load_file(weights)
    index = {"weight_map": {name: f"part-{i % 2}.safetensors" for i, name in enumerate(tensors)}}
    (directory / hf_checkpoint.INDEX_FILE).write_text(json.dumps(index))
    save_file({n: t for n, t in tensors.items() if index["weight_map"][n] == "part-0.safetensors"},
              directory / "part-0.safetensors")
    with pytest.raises(ConfigError, match=r"part-1.safetensors is named by model.safetensors.index.json and "
                                          r"missing \(1 of 2 files\)"):
        hf_checkpoint.check(model, directory, tp=1)
    (directory / hf_checkpoint.INDEX_FILE).unlink()
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=r"model.safetensors cannot be read \(Error while deserializing header: "
                                          r"incomplete metadata, file not fully covered\); copy it again, whole$"):
        hf_checkpoint.check(model, directory, tp=1)


def test_truncated_weights_end_a_run_in_one_line_with_an_error_row_and_the_files_untouched(tmp_path):
    from conftest import PYTHON, REPO, file_hashes

    directory = tmp_path / "checkpoint"
    hf_models.make_new_checkpoint("qwen2_tied_groups", directory)
    weights = directory / hf_checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    before = file_hashes(directory)
    done = subprocess.run([PYTHON, str(REPO / "run.py"), "model=hf", f"model.init_from={directory}",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: model.init_from: {weights} cannot be read (Error while deserializing header: incomplete metadata, "
        "file not fully covered); copy it again, whole"]
    row = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (row["status"], row["model.name"], row["params"]) == ("error", "checkpoint", None)
    assert file_hashes(directory) == before


def test_qwen3_read_from_its_directory_trains_with_memo_in_whole_layers_and_tiles_as_keeping_everything(tmp_path):
    hf_models.make_new_checkpoint("qwen3_wide_heads", tmp_path / "qwen3")
    common = ("model=hf", f"model.init_from={tmp_path / 'qwen3'}", "seq=128", "train.steps=3", "train.warmup_steps=1")
    runs = {"none": ("method=none",), "memo": ("method=memo", "alpha=0.5"),
            "memo_tiles": ("method=memo", "alpha=0.5", "method.tile_tokens=32")}
    losses = {}
    for name, method in runs.items():
        row = run_in_process(tmp_path / name, *common, *method)
        assert row["status"] == "ok", row["error"]
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
    assert losses["memo"] == pytest.approx(losses["none"], abs=1e-5)
    assert losses["memo_tiles"] == pytest.approx(losses["none"], abs=1e-5)
    assert losses["none"][-1] != losses["none"][0]


@pytest.mark.parametrize("name", list(hf_models.NEW_SHAPES))
def test_a_model_read_from_its_directory_is_counted_as_built_and_saved_back_byte_for_byte(tmp_path, name):
    import transformers

    from memo.model.gpt import parameter_count, parameter_numels

    hf = hf_models.make_new_checkpoint(name, tmp_path / "theirs")
    model = resolve_config("model=hf", f"model.init_from={tmp_path / 'theirs'}", "seq=64").workload
    with one_process():
        gpt = build_model(model, "cpu").module
        hf_checkpoint.load([gpt], model.model, tmp_path / "theirs")
        hf_checkpoint.save([gpt], model.model, tmp_path / "ours")
    assert parameter_numels(model.model) == [p.numel() for p in gpt.parameters()]
    assert parameter_count(model.model) == hf.num_parameters()
    weights = hf_checkpoint.WEIGHTS_FILE
    assert (tmp_path / "ours" / weights).read_bytes() == (tmp_path / "theirs" / weights).read_bytes()
    configs = [transformers.AutoConfig.from_pretrained(tmp_path / side) for side in ("theirs", "ours")]
    theirs, ours = ({**c.to_dict(), "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads}
                    for c in configs)
    for key in ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "tie_word_embeddings", "rope_parameters"):
        assert ours[key] == theirs[key], key
