"""Our Llama and Qwen2 models against Hugging Face ``transformers``' (an implementation we did not
write), started from checkpoints ``transformers`` saved: logits, loss and gradients equal at
tp=1 and at tp=2 with sequence parallelism; checkpoints survive a round trip byte for byte; a
checkpoint of another shape is refused in one line; training from one works with every method."""

import json

import pytest
import torch

import hf_models
from memo.config import ConfigError
from memo.model import hf_checkpoint
from memo.policy import build_model

from conftest import resolve_config, run_in_process

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
    hf_checkpoint.load(gpt, run.workload.model, tmp_path / "theirs")
    hf_checkpoint.save(gpt, run.workload.model, tmp_path / "ours")
    weights = hf_checkpoint.WEIGHTS_FILE
    assert (tmp_path / "ours" / weights).read_bytes() == (tmp_path / "theirs" / weights).read_bytes()
    # transformers reads our config.json as the shape it wrote
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "theirs").to_dict()
    ours = transformers.AutoConfig.from_pretrained(tmp_path / "ours").to_dict()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "rope_parameters"):
        assert ours[key] == theirs[key], key
    with pytest.raises(FileExistsError, match="exists and is kept"):
        hf_checkpoint.save(gpt, run.workload.model, tmp_path / "ours")


def test_a_checkpoint_of_another_shape_or_format_is_refused_in_one_line(tmp_path):
    hf_models.make_checkpoint("tiny_qwen", tmp_path)
    llama = resolve_config("model=tiny_llama").workload.model
    with pytest.raises(ConfigError, match=r"ffn_hidden_size=704, and model.ffn_hidden_size=768; set model.ffn_hidden_size=704 "):
        hf_checkpoint.check_config(llama, tmp_path, tp=1)
    qwen = resolve_config("model=tiny_qwen", "model.vocab_size=4000").workload.model
    with pytest.raises(ConfigError, match=r"vocab_size=4096, and model.vocab_size=4000"):
        hf_checkpoint.check_config(qwen, tmp_path, tp=1)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type=mistral"):
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").write_text(json.dumps(config | {"use_sliding_window": True}))
    with pytest.raises(ConfigError, match="sliding window"):
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama", "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias=true"):  # transformers' Llama then biases o_proj
        hf_checkpoint.check_config(resolve_config("model=tiny_qwen").workload.model, tmp_path, tp=1)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="cannot read"):
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
        hf_checkpoint.load(gpt, run.workload.model, tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    with pytest.raises(ConfigError, match=r"lacks lm_head.weight \(1 missing, 0 unused\)"):
        hf_checkpoint.load(gpt, run.workload.model, tmp_path)


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
