"""Every config option composes; bad input is refused with one line naming the key."""

import dataclasses
import json

import pytest

from memo.config import (
    ConfigError,
    HardwareConfig,
    Method,
    ModelConfig,
    ParallelConfig,
    SeqSearch,
    parse_alpha,
    parse_seq,
    resolve,
    validate,
)
from memo.config.choices import GROUPS, check_group_choices, options
from memo.execute.distributed import check_world_size

from conftest import CONF_DIR, compose_config


@pytest.mark.parametrize(
    "group, option", [(g, o) for g in GROUPS for o in options(CONF_DIR, g)]
)
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    added = group in ("experiment", "workload")  # not in the defaults list: selected with +
    # A layout search is a question for mode=fit about a number of devices (its sweep sets them).
    predicted = ("fit", "anchors", "frontier")
    fit = ["mode=fit", "cluster.gpus=8"] if option in ("search", *predicted) else []
    # Megatron's MLP recomputation is refused on a model with biases (the default tiny one has them).
    biasless = ["model=tiny_llama"] if option == "megatron_offload_recompute" else []
    # model=hf reads its shape from a checkpoint's config.json (Llama-3.1-8B's, its weights not read here)
    checkpoint = [f"model.init_from={_llama_config(tmp_path / 'hf')}"] if option == "hf" else []
    cfg = compose_config(f"{'+' if added else ''}{group}={option}", *fit, *biasless, *checkpoint)
    if option in predicted:  # mode=fit searches the longest sequence
        assert cfg.mode == "fit" and cfg.seq == "max" and validate(cfg).seq is None
        return
    assert validate(cfg).seq == parse_seq(cfg.seq) == (131072 if option == "convergence" else 1024)
    if group in ("model", "method", "hardware"):
        assert cfg[group].name == option


def _llama_config(directory):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}))
    return directory


def test_model_hf_reads_llama_3_1_8bs_config_json_as_the_shape_of_model_llama3_8b(tmp_path):
    read = compose_config("model=hf", f"model.init_from={_llama_config(tmp_path / 'Llama-3.1-8B')}").model
    written = compose_config("model=llama3_8b").model
    different = {k: (read[k], written[k]) for k in written if k not in ("name", "init_from") and read[k] != written[k]}
    assert read.name == "Llama-3.1-8B" and different == {}


def test_model_table_matches_the_paper():
    shapes = {
        name: (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.vocab_size)
        for name in ("7b", "13b", "30b", "65b")
        for m in [compose_config(f"model={name}").model]
    }
    assert shapes == {
        "7b": (32, 4096, 16384, 32, 50257),
        "13b": (40, 5120, 20480, 40, 50257),
        "30b": (48, 7168, 28672, 56, 50257),
        "65b": (80, 8192, 32768, 64, 50257),
    }


def test_megatron_methods_set_megatron_recompute_fields():
    full = compose_config("method=megatron_full_recompute").method
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full", "uniform", 1
    )
    selective = compose_config("method=megatron_selective").method
    assert selective.recompute_granularity == "selective"
    assert list(selective.recompute_modules) == ["core_attn"]
    assert compose_config("method=none").method.recompute_granularity is None


@pytest.mark.parametrize(
    "text, tokens",
    [("4096", 4096), (4096, 4096), ("4k", 4096), ("1408k", 1408 * 1024), ("64K", 65536), (" 1k ", 1024)],
)
def test_parse_seq(text, tokens):
    assert parse_seq(text) == tokens


@pytest.mark.parametrize("text", ["12q", "0", "0k", "-4k", "4.5k", "", "k", "4kk", "1m"])
def test_parse_seq_rejects_with_one_line(text):
    with pytest.raises(ConfigError) as err:
        parse_seq(text)
    message = str(err.value)
    assert message.startswith(f"seq={text} ") and "\n" not in message
    assert "4k" in message  # says what to write instead


def test_seq_sweep_values_compose_as_strings():
    assert validate(compose_config("seq=4096")).seq == 4096
    assert validate(compose_config("seq=1408k")).seq == 1441792


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.tp=3"], "parallel.tp=3"),
        (["parallel.pp=3"], "parallel.pp=3"),
        (["parallel.dp=0"], "parallel.dp=0"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "seq=1025"], "seq=1025"),
        (["parallel.cp=2", "seq=1026"], "seq=1026"),
        (["train.warmup_steps=-1"], "train.warmup_steps=-1"),
        (["train.steps=0"], "train.steps=0"),
        (["train.dtype=fp8"], "train.dtype=fp8"),
        (["train.lr=0"], "train.lr=0"),
        (["train.attention_backend=fast"], "train.attention_backend=fast"),
        (["train.data=/no/such/file.txt"], "train.data=/no/such/file.txt"),
        (["mode=dance"], "mode=dance"),
        (["method.recompute_granularity=some"], "method.recompute_granularity=some"),
        (["model.hidden_size=250"], "model.hidden_size=250"),
        (["method=memo", "alpha=1.5"], "alpha=1.5"),
        (["method=memo", "alpha=-0.1"], "alpha=-0.1"),
        (["method=memo", "alpha=half"], "alpha=half"),
        (["alpha=0.5"], "alpha=0.5 applies to method=memo only"),
        (["method=full_swap", "alpha=0.5"], "alpha=0.5 has no effect with method=full_swap"),
        (["method=memo", "method.recompute_granularity=full"], "method.recompute_granularity=full"),
        (["method=memo", "method.layer_activations=offload"], "method.layer_activations=offload"),
        (["hardware.peak_flops=-1"], "hardware.peak_flops=-1.0 must be positive"),
        (["hardware.peak_flops=0"], "hardware.peak_flops=0.0 must be positive"),
        (["hardware.host_memory_gib=-1"], "hardware.host_memory_gib=-1.0 must be positive"),
        (["hardware.devices_per_node=0"], "hardware.devices_per_node=0 must be positive"),
        (["hardware.host_link_gbps=0"], "hardware.host_link_gbps=0.0 must be positive"),
        (["+train.stepz=3"], "train.stepz is not a key of this configuration; did you mean train.steps?"),
        (["+fit.layout=all"], "fit.layout is not a key of this configuration; did you mean fit.layouts?"),
        (["+sequence=4k"], "sequence is not a key of this configuration"),
        (["parallel.cp_comm_type=ring"], "parallel.cp_comm_type=ring is not allowed"),
        (["method=deepspeed_ulysses", "parallel.cp=2"],
         "method=deepspeed_ulysses exchanges by DeepSpeed-Ulysses' all-to-all, not parallel.cp_comm_type="
         "all_gather; set parallel.cp_comm_type=a2a"),
        (["method=deepspeed_ulysses", "method.recompute_granularity=null", "method.layer_activations=swap"],
         "method.cp_attention=deepspeed runs on Megatron's layers"),
        (["method.cp_attention=ring"], "method.cp_attention=ring is not allowed"),
        (["parallel.cp=8", "parallel.cp_comm_type=a2a", "seq=16k"],
         "parallel.cp_comm_type=a2a splits the heads over tp·cp = 8 ranks and model.num_attention_heads=4"),
        (["model=tiny_llama", "parallel.cp=4", "parallel.cp_comm_type=a2a", "seq=16k"],
         "parallel.cp_comm_type=a2a splits the heads over tp·cp = 4 ranks and model.num_query_groups=2"),
        (["model=tiny_llama", "parallel.tp=4"], "parallel.tp=4 does not divide model.num_query_groups=2"),
        (["model=tiny_llama", "model.num_query_groups=3"], "model.num_query_groups=3 does not divide"),
        (["model.activation=relu"], "model.activation=relu is not allowed; choose one of: gelu, swiglu"),
        (["model.normalization=ScaleNorm"], "model.normalization=ScaleNorm is not allowed"),
        (["model.norm_epsilon=0"], "model.norm_epsilon=0.0 must be positive"),
        (["model=tiny_llama", "model.rope_scaling_factor=0.5"], "model.rope_scaling_factor=0.5"),
        (["mode=fit", "fit.seq_limit=0"], "fit.seq_limit=0 is not a sequence length"),
        (["mode=fit", "fit.seq_step=4q"], "fit.seq_step=4q is not a sequence length"),
        (["launch.processes=3", "parallel.cp=2"], "launch.processes=3 but parallel.tp·cp·pp·dp = 1·2·1·1 = 2; make "
                                                  "them equal, or use parallel=auto"),
        (["launch.processes=4", "parallel.cp=2"], "launch.processes=4 but parallel.tp·cp·pp·dp = 1·2·1·1 = 2; set "
                                                  "parallel.dp=2, make them equal"),
        (["launch.processes=0"], "launch.processes=0 must be"),
        (["mode=fit", "launch.processes=2"], "launch.processes=2 starts the processes of a training run"),
        (["train.resume=true", "train.load=null"], "train.resume=true continues a training run from its own last "
                                                   "checkpoint, and mode=train, train.load=None"),
    ],
)
def test_validation_errors_name_the_key_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(*overrides))
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize("text, alpha", [("auto", None), ("0", 0.0), ("0.125", 0.125), ("1", 1.0)])
def test_alpha_is_auto_or_a_fraction(text, alpha):
    cfg = compose_config("method=memo", f"alpha={text}")
    assert validate(cfg).method.alpha == parse_alpha(cfg.alpha) == alpha


def test_divisibility_message_names_the_divisor():
    tp2_cp2_sp = ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"2·cp × tp = 8"):
        validate(compose_config(*tp2_cp2_sp, "seq=1028"))
    assert validate(compose_config(*tp2_cp2_sp, "seq=1k")).seq == 1024


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        check_group_choices(["model=foo"], CONF_DIR)
    message = str(err.value)
    assert message.startswith("model=foo is not a known model") and "tiny" in message and "65b" in message
    with pytest.raises(ConfigError, match="method=mem0"):
        check_group_choices(["-m", "method=none,mem0", "seq=1k,2k"], CONF_DIR)
    check_group_choices(["-m", "model=tiny,7b", "method=none", "hardware=a800", "train.steps=3"], CONF_DIR)
    with pytest.raises(ConfigError, match=r"^experiment=x is not a known experiment; choose one of: abl"):
        check_group_choices(["+experiment=x"], CONF_DIR)
    with pytest.raises(ConfigError, match=r"^workload=7b is not a known workload; .* 7b_8gpus"):
        check_group_choices(["-m", "+workload=7b_8gpus,7b"], CONF_DIR)
    check_group_choices(["+experiment=ablation", "hydra/launcher=basic"], CONF_DIR)


def test_world_size_must_match_parallel_sizes():
    cfg = compose_config("parallel.tp=2")
    check_world_size(cfg.parallel, 2)
    with pytest.raises(ConfigError, match=r"set parallel.dp=2"):
        check_world_size(cfg.parallel, 4)
    with pytest.raises(ConfigError, match=r"= 2 but 3 process"):
        check_world_size(cfg.parallel, 3)


# ---------------------------------------------------------------- resolved once


def test_a_run_is_resolved_into_typed_values():
    run = resolve(compose_config("model=7b", "method=memo", "alpha=0.25", "seq=64k", "parallel.tp=4",
                                 "parallel.sequence_parallel=true", "train.micro_batch_size=2",
                                 "train.loss_tile_tokens=512", "hardware=a800", "mode=fit"),
                  gpu_visible=False)
    w = run.workload
    assert isinstance(w.model, ModelConfig) and isinstance(w.method, Method)
    assert isinstance(w.parallel, ParallelConfig) and isinstance(run.hardware, HardwareConfig)
    assert (w.model.num_layers, w.seq, w.parallel.tp, w.micro_batch_size, w.loss_tile_tokens) == \
        (32, 65536, 4, 2, 512)
    # an A800 is a GPU although none is visible here: bf16, and the method's tiled loss
    assert (run.device_type, w.dtype, w.dtype_bytes, w.loss) == ("cuda", "bf16", 2, "tiled")
    assert (w.method.alpha, w.method.swaps, w.layer_tile_tokens, run.seq_search) == (0.25, True, None, None)
    assert w.at(ParallelConfig(tp=2), 4096) == dataclasses.replace(w, parallel=ParallelConfig(tp=2), seq=4096)


@pytest.mark.parametrize("overrides, gpu, device, dtype", [
    ([], False, "cpu", "fp32"),
    ([], True, "cuda", "bf16"),
    (["hardware=cpu"], True, "cpu", "fp32"),
    (["hardware=cpu", "train.dtype=bf16"], False, "cpu", "bf16"),
    (["hardware=h100", "mode=fit"], False, "cuda", "bf16"),
    (["mode=profile"], False, "cuda", "bf16"),  # traced as a GPU run, with fake tensors
    (["mode=profile", "profile.backend=cpu"], False, "cpu", "fp32"),
])
def test_the_device_and_dtype_follow_hardware_backend_and_what_is_visible(overrides, gpu, device, dtype):
    run = resolve(compose_config(*overrides), gpu_visible=gpu)
    assert (run.device_type, run.workload.dtype) == (device, dtype)


@pytest.mark.parametrize("overrides, alpha", [
    (["method=memo"], None),  # solved at run time
    (["method=memo", "alpha=0.5"], 0.5),
    (["method=full_swap"], 1.0),  # the method's own
    (["method=none"], None),
])
def test_alpha_is_the_one_value_a_run_swaps(overrides, alpha):
    assert resolve(compose_config(*overrides), gpu_visible=False).workload.method.alpha == alpha


def test_seq_max_searches_between_the_fit_bounds():
    fit = compose_config("+experiment=fit", "cluster.gpus=8", "fit.seq_step=32k", "fit.seq_limit=256k")
    run = resolve(fit, gpu_visible=False)
    assert run.seq_search == SeqSearch(step=32768, limit=262144) and run.workload.seq == 262144


@pytest.mark.parametrize("overrides, message", [
    (["hardware=a800"], "hardware=a800 trains on a GPU and none is visible here"),
    (["hardware=cpu", "train.dtype=fp16"], "train.dtype=fp16 needs a GPU"),
    (["seq=1k0"], "seq=1k0 is not a sequence length"),
    (["train.dtype=fp64"], "train.dtype=fp64 is for numerical checks on the CPU"),
])
def test_what_cannot_run_here_is_refused_when_resolving(overrides, message):
    gpu = "fp64" in overrides[0]  # float64 is refused where a GPU would train
    with pytest.raises(ConfigError, match=message) as error:
        resolve(compose_config(*overrides), gpu_visible=gpu)
    assert "\n" not in str(error.value)
