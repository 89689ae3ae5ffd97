"""Checks on a composed run configuration that types alone cannot express, and the settings they
parse, each once.

Every failure is a :class:`ConfigError` whose message is one line naming the key, its value
and what to write instead; ``run.py`` prints it without a traceback.
"""

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from memo.config.method import Method, method_of, parse_layer_tiles
from memo.config.values import ConfigError, at_least, choice, parse_seq

MODES = ("train", "profile", "plan", "fit")
# how OmegaConf prefixes the message of an error its resolver raised (memo.config.hf_model's)
RESOLVER_ERROR = " raised while resolving interpolation: "
SEARCH_SEQ = "max"  # seq=max: mode=fit searches the longest sequence that fits
PROFILE_BACKENDS = ("auto", "fake", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "fp16", "fp64")
ATTENTION_BACKENDS = ("auto", "te", "cudnn", "flash", "efficient", "math")
# train.lr_schedule (memo.execute.schedule) and how warmup-stable-decay decays
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd", "inverse_sqrt")
DECAYING_SCHEDULES = ("linear", "cosine", "wsd")  # those that reach min_lr at lr_decay_steps
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
CP_COMM_TYPES = ("all_gather", "p2p", "a2a")  # as Megatron-core names them
# train.optimizer_offload: where Adam's states live (auto: the run chooses, memo.fit.choice)
OPTIMIZER_OFFLOADS = ("auto", "none", "host")
OPTIMIZER_PLACEMENTS = OPTIMIZER_OFFLOADS[1:]  # fit.optimizer_offload: the placements a search tries
ACTIVATIONS = ("gelu", "swiglu")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MEGATRON_DATA = "megatron:"  # train.data's prefix for Megatron's indexed datasets
TRAINING_LOSSES = ("auto", "tiled", "megatron")  # train.loss: auto takes the method's


@dataclass(frozen=True)
class SeqSearch:
    """``mode=fit seq=max``: the lengths tried are multiples of ``step`` up to ``limit`` (tokens)."""

    step: int
    limit: int


@dataclass(frozen=True)
class Settings:
    """The settings of a configuration that are written as text, parsed (each once) by
    :func:`validate`."""

    seq: Optional[int]  # tokens; None for seq=max, which mode=fit searches
    method: Method
    layer_tile_tokens: Optional[int]  # method.tile_tokens; None: whole layers (or chosen: auto)
    chooses_layer_tiles: bool  # method.tile_tokens=auto for a method that walks tiles
    seq_search: Optional[SeqSearch]  # mode=fit seq=max
    # mode=fit parallel=search: the layers' tiles tried (fit.tile_tokens; None: whole layers)
    fit_layer_tiles: tuple[Optional[int], ...]
    document_tokens: Optional[int] = None  # fit.document_tokens, with train.document_mask in mode=fit


def validate(cfg) -> Settings:
    """Check ``cfg`` (a composed :class:`memo.config.RunConfig`) and return its :class:`Settings`.

    Raises:
        ConfigError: on the first problem found.
    """
    _check_known_keys(cfg)
    _check_interpolations(cfg)
    choice("mode", cfg.mode, MODES)
    search_seq = str(cfg.seq).strip() == SEARCH_SEQ
    if search_seq and cfg.mode != "fit":
        raise ConfigError(f"seq=max is searched by mode=fit only; give mode={cfg.mode} a length such as 64k")
    seq = None if search_seq else parse_seq(cfg.seq)

    m = cfg.model
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
        at_least(f"model.{key}", getattr(m, key))
    if m.kv_channels is not None:
        at_least("model.kv_channels", m.kv_channels)
    elif m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}; set model.kv_channels, the heads' width"
        )

    _check_model_shape(m)
    method, tiles, chooses_tiles = method_of(cfg.method, cfg.alpha)
    _check_hardware(cfg.hardware)
    _check_parallel(cfg.parallel, m, seq)
    _check_cp_attention(method, cfg.parallel)
    _check_pipeline(method, cfg.parallel, m)
    _check_tiles(cfg, method, tiles, seq)
    _check_cluster(cfg)
    t = cfg.train
    if cfg.plan and cfg.mode == "train":
        if min(t.warmup_steps, t.steps - 1) < 1:
            raise ConfigError(f"plan=true records and plans the last warm-up step, and train.warmup_steps="
                              f"{t.warmup_steps} with train.steps={t.steps} leaves none (the last step is timed); "
                              "set train.warmup_steps=1 or more and train.steps=2 or more")
        if t.micro_batches != 1:
            raise ConfigError(f"plan=true plans one micro-batch per step, and train.micro_batches="
                              f"{t.micro_batches}; set train.micro_batches=1")
        if cfg.parallel.pp > 1:
            raise ConfigError(f"plan=true plans one stage's step of one micro-batch, and parallel.pp={cfg.parallel.pp} "
                              "interleaves micro-batches; set parallel.pp=1 or plan=false")
    at_least("train.steps", t.steps)
    at_least("train.warmup_steps", t.warmup_steps, minimum=0)
    at_least("train.micro_batch_size", t.micro_batch_size)
    at_least("train.micro_batches", t.micro_batches)
    p = cfg.parallel
    if not p.search and p.vpp > 1 and t.micro_batches % p.pp:
        # Megatron's interleaved schedule runs them in groups of pp per virtual stage
        raise ConfigError(f"parallel.vpp={p.vpp} runs micro-batches in groups of parallel.pp={p.pp}, and "
                          f"train.micro_batches={t.micro_batches}; set train.micro_batches to a multiple of {p.pp}")
    at_least("train.lr_warmup_steps", t.lr_warmup_steps, minimum=0)
    if t.timeline_step is not None and not 1 <= t.timeline_step <= min(t.warmup_steps, t.steps - 1):
        raise ConfigError(f"train.timeline_step={t.timeline_step} is not one of the run's warm-up steps "
                          f"1..{min(t.warmup_steps, t.steps - 1)} (the profiler slows the step it watches, and a "
                          "timed step's time is the run's figure); choose one of them, raise train.warmup_steps "
                          "and train.steps, or set it to null")
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    _check_schedule(t)
    choice("train.dtype", t.dtype, DTYPES)
    choice("train.attention_backend", t.attention_backend, ATTENTION_BACKENDS)
    choice("train.loss", t.loss, TRAINING_LOSSES)
    if t.loss_tile_tokens is not None:
        at_least("train.loss_tile_tokens", t.loss_tile_tokens)
    _check_optimizer_offload(t)
    if t.save_interval is not None:
        at_least("train.save_interval", t.save_interval)
    if t.resume and (cfg.mode != "train" or t.load != "auto"):
        raise ConfigError(f"train.resume=true continues a training run from its own last checkpoint, and mode="
                          f"{cfg.mode}, train.load={t.load}; use it with mode=train and train.load=auto")
    _check_validation(cfg, seq)
    document_tokens = _check_documents(cfg, method, tiles)
    if method.recompute_granularity == "selective" and "mlp" in (method.recompute_modules or ()) \
            and cfg.model.add_bias_linear:
        # (its output bias, returned by the checkpointed MLP outside Transformer Engine, comes back
        # as an output of the checkpoint, whose backward then never ends: seen on the CPU)
        raise ConfigError(f"method.recompute_modules with mlp on model={cfg.model.name}, whose linear layers have "
                          "biases: Megatron's checkpointed MLP does not finish its backward pass with them here; "
                          "recompute other modules, or use a model without them (model.add_bias_linear=false)")
    if t.data.startswith(MEGATRON_DATA):
        megatron_blend(t)
    elif t.data != "synthetic" and not Path(t.data).is_file():
        raise ConfigError(
            f"train.data={t.data} is neither 'synthetic', 'megatron:<prefix>' nor an existing text file"
        )
    choice("profile.backend", cfg.profile.backend, PROFILE_BACKENDS)
    choice("planner.mip", cfg.planner.mip, ("gurobi", "highs", "none"))
    if not cfg.planner.time_limit_s > 0:
        raise ConfigError(f"planner.time_limit_s={cfg.planner.time_limit_s} must be positive (seconds)")
    search, tried = _check_fit(cfg.fit)  # a training run that chooses its settings asks the fit too
    return Settings(seq, method, tiles, chooses_tiles, search if seq is None else None,
                    tried if cfg.mode == "fit" else (), document_tokens)


def _check_optimizer_offload(t) -> None:
    choice("train.optimizer_offload", t.optimizer_offload, OPTIMIZER_OFFLOADS)
    fraction = t.optimizer_offload_fraction
    if not 0 < fraction <= 1:
        raise ConfigError(f"train.optimizer_offload_fraction={fraction} must be a fraction in (0, 1]: "
                          "the share of parameters whose Adam states live on the host")
    if t.optimizer_offload != "host" and fraction != 1:
        raise ConfigError(f"train.optimizer_offload_fraction={fraction} applies to "
                          "train.optimizer_offload=host only; drop it or set train.optimizer_offload=host")
    if t.optimizer_offload == "host" and t.distributed_optimizer is False:
        raise ConfigError("train.optimizer_offload=host runs inside Megatron's distributed optimizer "
                          "and train.distributed_optimizer=false; drop that setting or set it true")


def _check_interpolations(cfg) -> None:
    """Resolve every interpolation once (``model=hf``'s fields read the checkpoint's config.json,
    :mod:`memo.config.hf_model`), so that what fails says so in one line, not in OmegaConf's report.

    Raises:
        ConfigError: the resolver's own message, or OmegaConf's first line.
    """
    for key in cfg:
        if key == "hydra":
            continue
        try:
            node = cfg._get_node(key)
            OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else cfg[key]
        except InterpolationResolutionError as error:
            message = str(error).splitlines()[0]
            raise ConfigError(message.split(RESOLVER_ERROR, 1)[-1]) from None


def _check_known_keys(node, prefix: str = "") -> None:
    """Refuse keys the schema does not have: an appended ``+train.<typo>=...`` would otherwise
    be carried along and ignored."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        if key == "hydra" and not prefix:  # the launcher checks a job's config with Hydra's own part
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            raise ConfigError(f"{prefix}{key} is not a key of this configuration; {hint}"
                              f"the keys of {prefix.rstrip('.') or 'the top level'} are: {', '.join(fields)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_known_keys(child, f"{prefix}{key}.")


def _check_model_shape(m) -> None:
    choice("model.activation", m.activation, ACTIVATIONS)
    choice("model.normalization", m.normalization, NORMALIZATIONS)
    if m.num_query_groups is not None:
        at_least("model.num_query_groups", m.num_query_groups)
        if m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"model.num_query_groups={m.num_query_groups} does not divide "
                              f"model.num_attention_heads={m.num_attention_heads}")
    if not m.norm_epsilon > 0:
        raise ConfigError(f"model.norm_epsilon={m.norm_epsilon} must be positive")
    if not m.rope_scaling_factor >= 1:
        raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be at least 1")
    at_least("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)
    at_least("model.rotary_base", m.rotary_base)


def _check_hardware(hw) -> None:
    for key in ("peak_flops", "device_memory_gib", "host_memory_gib", "host_link_gbps", "intra_node_gbps",
                "inter_node_gbps", "devices_per_node"):
        value = getattr(hw, key)
        if value is not None and not value > 0:
            raise ConfigError(f"hardware.{key}={value} must be positive (or left out to take "
                              f"hardware={hw.name}'s figure)")


def _check_cluster(cfg) -> None:
    p, gpus = cfg.parallel, cfg.cluster.gpus
    at_least("launch.processes", cfg.launch.processes)
    if cfg.launch.processes > 1 and cfg.mode != "train":
        raise ConfigError(f"launch.processes={cfg.launch.processes} starts the processes of a training run, and "
                          f"mode={cfg.mode} runs in this one; drop launch.processes")
    if gpus is not None:
        at_least("cluster.gpus", gpus)
    if p.search:
        if cfg.mode not in ("fit", "train"):
            raise ConfigError(f"a layout search is done by mode=fit (parallel=search) or mode=train (parallel=auto); "
                              f"give mode={cfg.mode} a layout such as parallel.tp=4 parallel.cp=2")
        processes = cfg.launch.processes
        if cfg.mode == "train" and processes > 1 and gpus is not None and gpus != processes:
            raise ConfigError(f"parallel=auto chooses a layout of the launch.processes={processes} processes, and "
                              f"cluster.gpus={gpus}; make them equal or drop cluster.gpus")
        if cfg.mode == "train":  # the launcher's processes, or cluster.gpus where they agree
            return
        if gpus is None:
            raise ConfigError("parallel=search needs the number of devices: set cluster.gpus, "
                              "e.g. cluster.gpus=8")
        return
    world = p.tp * p.cp * p.pp * p.dp
    processes = cfg.launch.processes
    if processes > 1 and processes != world:
        fixed = p.tp * p.cp * p.pp
        hint = f"set parallel.dp={processes // fixed}, " if processes % fixed == 0 else ""
        raise ConfigError(f"launch.processes={processes} but parallel.tp·cp·pp·dp = {p.tp}·{p.cp}·{p.pp}·{p.dp} = "
                          f"{world}; {hint}make them equal, or use parallel=auto")
    if gpus is not None and gpus != world:
        raise ConfigError(f"cluster.gpus={gpus} but parallel.tp·cp·pp·dp = {world}; make them equal "
                          "or use parallel=search")


def _check_fit(fit) -> tuple[SeqSearch, tuple[Optional[int], ...]]:
    """Check ``fit`` and return the lengths ``seq=max`` searches and the layers' tiles
    ``parallel=search`` tries."""
    search = SeqSearch(parse_seq(fit.seq_step, "fit.seq_step"), parse_seq(fit.seq_limit, "fit.seq_limit"))
    if search.limit < search.step:
        raise ConfigError(f"fit.seq_limit={fit.seq_limit} is below fit.seq_step={fit.seq_step}")
    at_least("fit.runners_up", fit.runners_up, minimum=0)
    choice("fit.layouts", fit.layouts, ("runnable", "all"))
    if fit.device_reserved_gib < 0:
        raise ConfigError(f"fit.device_reserved_gib={fit.device_reserved_gib} must be at least 0 (GiB)")
    at_least("fit.nccl_channels", fit.nccl_channels)
    if fit.device_workspace_mib < 0:
        raise ConfigError(f"fit.device_workspace_mib={fit.device_workspace_mib} must be at least 0 (MiB)")
    if not 0 <= fit.memory_margin < 0.5:
        raise ConfigError(f"fit.memory_margin={fit.memory_margin} must be a fraction of the device's memory in "
                          "[0, 0.5), e.g. 0.03")
    for key in ("host_usable_fraction", "gemm_efficiency", "attention_forward_efficiency",
                "attention_backward_efficiency", "link_efficiency"):
        value = getattr(fit, key)
        if not 0 < value <= 1:
            raise ConfigError(f"fit.{key}={value} must be a fraction in (0, 1]")
    for key in ("tp_comm_overlap", "dp_comm_overlap"):
        value = getattr(fit, key)
        if not 0 <= value <= 1:
            raise ConfigError(f"fit.{key}={value} must be a fraction in [0, 1]")
    if not fit.host_adam_gbps > 0:
        raise ConfigError(f"fit.host_adam_gbps={fit.host_adam_gbps} must be positive (GB/s)")
    if not fit.tile_tokens:
        raise ConfigError("fit.tile_tokens is empty; list the tiles parallel=search tries, e.g. [whole,16k]")
    tiles = tuple(dict.fromkeys(parse_layer_tiles(value, "fit.tile_tokens") for value in fit.tile_tokens))
    if not fit.optimizer_offload:
        raise ConfigError("fit.optimizer_offload is empty; list the placements parallel=search tries, e.g. [none,host]")
    for value in fit.optimizer_offload:
        choice("fit.optimizer_offload", value, OPTIMIZER_PLACEMENTS)
    return search, tiles


def _check_validation(cfg, seq: Optional[int]) -> None:
    t = cfg.train
    if t.eval_interval is None:
        return
    at_least("train.eval_interval", t.eval_interval)
    at_least("train.eval_iters", t.eval_iters)
    at_least("train.eval_buckets", t.eval_buckets)
    if seq is not None and t.eval_buckets > seq:
        raise ConfigError(f"train.eval_buckets={t.eval_buckets} is more than the seq={seq} positions to bucket")


def _check_documents(cfg, method: Method, tiles: Optional[int]) -> Optional[int]:
    """Check packed documents kept apart against the run's other settings; returns the documents'
    tokens a prediction assumes (``fit.document_tokens``), None for the sequence."""
    t, p = cfg.train, cfg.parallel
    documents = cfg.fit.document_tokens
    if documents is not None and cfg.mode != "fit":
        raise ConfigError(f"fit.document_tokens={documents} is the documents' length mode=fit assumes; mode="
                          f"{cfg.mode} reads its documents from train.data; drop fit.document_tokens")
    if not t.document_mask:
        if documents is not None:
            raise ConfigError(f"fit.document_tokens={documents} is the length of the documents kept apart; set "
                              "train.document_mask=true as well, or drop fit.document_tokens")
        return None
    if cfg.mode == "profile":
        raise ConfigError("train.document_mask: mode=profile traces attention over whole sequences, not over "
                          "documents; set train.document_mask=false, or mode=train or mode=fit")
    if cfg.mode == "train" and not str(t.data).startswith(MEGATRON_DATA):
        raise ConfigError(f"train.document_mask needs documents, which train.data={t.data} does not mark; "
                          "train on Megatron data (python -m memo.data.prepare, train.data=megatron:<prefix>)")
    if t.micro_batch_size != 1:
        raise ConfigError(f"train.document_mask keeps the documents of one sequence per micro-batch apart; set "
                          f"train.micro_batch_size=1 (not {t.micro_batch_size}) and raise train.micro_batches")
    if t.attention_backend == "te":
        raise ConfigError("train.document_mask runs in memo's own attention, not Transformer Engine's; set "
                          "train.attention_backend to flash, cudnn or efficient, or train.document_mask=false")
    if p.cp > 1 and tiles is not None:
        raise ConfigError(f"train.document_mask: memo's sequence tiles keep documents apart without context "
                          f"parallelism so far; set parallel.cp=1 or method.tile_tokens=whole (not "
                          f"{cfg.method.tile_tokens}), or train.document_mask=false")
    if method.cp_attention == "deepspeed" or method.offloads:
        raise ConfigError(f"train.document_mask runs in memo's own attention, not in method={cfg.method.name}'s "
                          "(DeepSpeed's or Transformer Engine's); choose another method or train.document_mask=false")
    return None if documents is None else parse_seq(documents, "fit.document_tokens")


def megatron_blend(train) -> tuple[list[str], Optional[list[float]]]:
    """The prefixes of ``train.data="megatron:..."`` and their weights (None for one prefix), as
    Megatron-LM's ``--data-path`` takes them: ``<prefix>`` or ``<weight> <prefix> <weight> <prefix>``.

    Raises:
        ConfigError: a malformed blend, a prefix without its ``.bin`` or ``.idx``, or no tokenizer.
    """
    words = train.data[len(MEGATRON_DATA):].split()
    if not words:
        raise ConfigError(f"train.data={train.data} names no prefix: write megatron:<prefix> (its .bin and .idx)")
    if len(words) == 1:
        prefixes, weights = words, None
    else:
        prefixes, weights = words[1::2], []
        for weight in words[0::2]:
            try:
                weights.append(float(weight))
            except ValueError:
                weights.append(-1.0)
        if len(words) % 2 or not all(w > 0 for w in weights):  # (nan is not above 0)
            raise ConfigError(f"train.data={train.data} is not a blend: write megatron:<prefix> or "
                              "'megatron:<weight> <prefix> <weight> <prefix> ...' with positive weights")
    for prefix in prefixes:
        for suffix in (".idx", ".bin"):
            if not Path(prefix + suffix).is_file():
                raise ConfigError(f"train.data: {prefix}{suffix} does not exist; give the prefix of a .bin/.idx pair "
                                  "(python -m memo.data.prepare writes one)")
    if train.tokenizer is None or not Path(train.tokenizer).is_file():
        raise ConfigError(f"train.tokenizer={train.tokenizer} is not a file: megatron data needs the "
                          "tokenizer.json its corpus was prepared with")
    split = train.data_split.split(",")
    try:
        shares = [float(x) for x in split]
    except ValueError:
        shares = []
    if len(shares) != 3 or min(shares) < 0 or shares[0] <= 0:
        raise ConfigError(f"train.data_split={train.data_split} must be three non-negative weights "
                          "train,valid,test with train above 0, as 969,30,1")
    return prefixes, weights


def lr_decay_steps(train) -> int:
    """The step count at which the learning rate reaches ``train.min_lr``."""
    return train.lr_decay_steps if train.lr_decay_steps is not None else train.steps


def lr_wsd_decay_steps(train) -> int:
    """The final steps over which warmup-stable-decay decays: ``train.lr_wsd_decay_steps``, or a
    tenth of the decay steps after the warm-up (at least one)."""
    if train.lr_wsd_decay_steps is not None:
        return train.lr_wsd_decay_steps
    return max((lr_decay_steps(train) - train.lr_warmup_steps) // 10, 1)


def _check_schedule(t) -> None:
    choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    choice("train.lr_wsd_decay_style", t.lr_wsd_decay_style, WSD_DECAY_STYLES)
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    for key in ("lr_decay_steps", "lr_wsd_decay_steps"):
        if getattr(t, key) is not None:
            at_least(f"train.{key}", getattr(t, key))
    decay = lr_decay_steps(t)
    if t.lr_schedule in DECAYING_SCHEDULES and decay <= t.lr_warmup_steps:
        raise ConfigError(f"the learning rate decays until step {decay} (train.lr_decay_steps, else train.steps), "
                          f"not after its warm-up of train.lr_warmup_steps={t.lr_warmup_steps}; lower the "
                          "warm-up or set train.lr_decay_steps above it")
    if t.lr_schedule == "wsd" and lr_wsd_decay_steps(t) > decay - t.lr_warmup_steps:  # (it is at least 1)
        raise ConfigError(f"train.lr_wsd_decay_steps={t.lr_wsd_decay_steps} must be between 1 and the "
                          f"{decay - t.lr_warmup_steps} steps between the warm-up and step {decay}")


def _check_tiles(cfg, m: Method, tile: Optional[int], seq: Optional[int]) -> None:
    p, text = cfg.parallel, cfg.method.tile_tokens
    if tile is None:
        return
    keep = "or use method.tile_tokens=whole"
    if p.cp > 1 and p.sequence_parallel:
        raise ConfigError(f"method.tile_tokens={text} runs context parallelism without sequence "
                          f"parallelism so far; set parallel.sequence_parallel=false {keep}")
    if p.cp > 1 and seq is not None and seq % (2 * p.cp * tile):
        raise ConfigError(f"method.tile_tokens={text} does not divide the {2 * p.cp} chunks of "
                          f"seq={seq} that parallel.cp={p.cp} ranks hold; choose a tile that divides "
                          f"{seq // (2 * p.cp)} tokens {keep}")
    if p.sequence_parallel and tile % p.tp:
        raise ConfigError(f"method.tile_tokens={text} is gathered over parallel.tp={p.tp} ranks "
                          f"under sequence parallelism; choose a multiple of {p.tp} {keep}")
    if seq is not None and seq % tile:
        raise ConfigError(f"method.tile_tokens={text} does not divide seq={seq}; choose a tile "
                          f"that divides the sequence {keep}")


def _check_cp_attention(method: Method, p) -> None:
    if method.cp_attention == "deepspeed" and p.cp > 1 and p.cp_comm_type != "a2a":
        raise ConfigError(f"method={method.name} exchanges by DeepSpeed-Ulysses' all-to-all, not "
                          f"parallel.cp_comm_type={p.cp_comm_type}; set parallel.cp_comm_type=a2a")


def _check_pipeline(method, p, model) -> None:
    """What a pipeline's chunks of layers (``num_layers / (pp·vpp)`` each) rule out."""
    if p.search and p.vpp > 1:
        raise ConfigError(f"parallel=search tries layouts of plain 1F1B stages, and parallel.vpp={p.vpp}; "
                          "set parallel.vpp=1 (or give the layout's sizes instead of parallel=search)")
    if p.search or method.recompute_granularity != "full" or method.recompute_method != "uniform":
        return
    per_chunk = model.num_layers // (p.pp * p.vpp)
    if method.recompute_num_layers > per_chunk:
        raise ConfigError(f"method.recompute_num_layers={method.recompute_num_layers} recomputes layers in groups "
                          f"larger than a model chunk's {per_chunk} (model.num_layers / (parallel.pp·vpp)); set it "
                          f"to at most {per_chunk}")


def sequence_divisor(tp: int, cp: int, sequence_parallel: bool) -> int:
    """What every sequence length must be a multiple of under this layout (tokens)."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def _check_parallel(p, model, seq: Optional[int]) -> None:
    if p.search:
        return  # every layout tried is checked by memo.fit.layouts
    for key in ("tp", "cp", "pp", "dp"):
        at_least(f"parallel.{key}", getattr(p, key))
    for size_key, size in (
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.num_query_groups", model.num_query_groups or model.num_attention_heads),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
    ):
        if size % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} does not divide {size_key}={size}")
    if model.num_layers % p.pp:
        raise ConfigError(
            f"parallel.pp={p.pp} does not divide model.num_layers={model.num_layers}"
        )
    at_least("parallel.vpp", p.vpp)
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} interleaves pipeline stages, and parallel.pp=1; set parallel.pp > 1 "
                          "or parallel.vpp=1")
    if model.num_layers % (p.pp * p.vpp):
        raise ConfigError(f"parallel.pp·vpp = {p.pp}·{p.vpp} does not divide model.num_layers={model.num_layers}; "
                          "choose a vpp whose product with pp divides it")
    choice("parallel.cp_comm_type", p.cp_comm_type, CP_COMM_TYPES)
    for key, heads in (("model.num_attention_heads", model.num_attention_heads),
                       ("model.num_query_groups", model.num_query_groups or model.num_attention_heads)):
        if p.cp > 1 and p.cp_comm_type == "a2a" and heads % (p.tp * p.cp):
            raise ConfigError(f"parallel.cp_comm_type=a2a splits the heads over tp·cp = {p.tp * p.cp} ranks and "
                              f"{key}={heads} does not divide; use parallel.cp_comm_type=all_gather or "
                              "another cp")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    # Megatron splits the sequence into 2·cp chunks (load balance of the causal mask), and
    # sequence parallelism splits each rank's part again over tp.
    divisor = sequence_divisor(p.tp, p.cp, p.sequence_parallel)
    if seq is not None and seq % divisor:
        parts = " × ".join(
            part
            for part, used in (("2·cp", p.cp > 1), ("tp", p.sequence_parallel))
            if used
        )
        raise ConfigError(
            f"seq={seq} is not divisible by {parts} = {divisor}; choose a multiple of {divisor}"
        )
