"""The run configuration as typed dataclasses.

Hydra merges ``conf/`` and the command line into :class:`RunConfig`, so a misspelt key or a
value of the wrong type is refused before any code runs; :func:`memo.config.validate` then
checks what types cannot (divisibility, allowed names, ranges).
"""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape (conf/model/): pre-norm, RoPE, no dropout.

    The defaults are the paper's GPT-3 shape (LayerNorm, GeLU, biases, multi-head attention, one
    tied embedding); Llama-3 and Qwen2.5 set the fields below them (Megatron-core's names where it
    has one) from their published configs.
    """

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    # grouped-query attention: heads of keys and values (None: one per query head)
    num_query_groups: Optional[int] = None
    activation: str = "gelu"  # "gelu" (one FC1 output) or "swiglu" (SiLU-gated, FC1 2·ffn wide)
    normalization: str = "LayerNorm"  # "LayerNorm" or "RMSNorm"
    norm_epsilon: float = 1e-5
    add_bias_linear: bool = True  # biases of every linear layer
    add_qkv_bias: bool = False  # biases of the QKV projection alone (Qwen2)
    untie_embeddings_and_output_weights: bool = False  # an output layer of its own
    vocab_size: int = 50257
    # The embedding is padded to a multiple of this (and of tp), as Megatron-LM does; the
    # same padding for every tp keeps the model, and its parameter count, layout-independent.
    make_vocab_size_divisible_by: int = 128
    rotary_base: int = 10000
    # Llama-3.1's RoPE scaling (low- and high-frequency factors 1 and 4 over an original
    # 8192-token context, as Megatron-core's RotaryEmbedding applies it)
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    # train: start from the weights of a Llama or Qwen2 checkpoint in transformers' format (the
    # directory save_pretrained writes), which must be of this shape (memo.model.hf_checkpoint)
    init_from: Optional[str] = None


@dataclass
class MethodConfig:
    """How activations are kept for the backward pass (conf/method/), as written; resolved into a
    :class:`memo.config.Method` (memo.config.method), whose activation policy (memo.policy) does it."""

    name: str = MISSING
    # Megatron-core's own recomputation (TransformerConfig fields of the same names).
    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    recompute_method: Optional[str] = None  # "uniform" or "block" (full only)
    recompute_num_layers: Optional[int] = None  # layers per checkpointed chunk (full only)
    recompute_modules: Optional[list[str]] = None  # selective only, e.g. ["core_attn"]
    # Megatron-core's fine-grained activation offloading (TransformerConfig's offload_modules):
    # what autograd saves inside these modules of every layer is copied to the host after their
    # forward and brought back for their backward; None offloads nothing. Of Megatron's names,
    # those that act on the dense Transformer Engine layers: "qkv_linear" (input norm and QKV
    # projection, fused there), "core_attn", "attn_proj" (needs core_attn).
    offload_modules: Optional[list[str]] = None
    # Our own layer (memo.model.layer): "megatron" leaves activations to Megatron (and the
    # recompute_* fields above); "swap" is MEMO's token-wise swapping and recomputation;
    # "recompute" keeps each layer's input and recomputes the whole layer, attention included;
    # "keep" is our layer keeping everything (what the fit planner traces for "swap").
    layer_activations: str = "megatron"
    # swap only: a fixed fraction of tokens swapped (full_swap: 1.0); None takes the run's `alpha`.
    alpha: Optional[float] = None
    # The loss a run of this method uses unless train.loss says otherwise: "tiled" (memo's
    # sequence-tiled output layer and cross entropy) or "megatron" (Megatron-core's own).
    loss: str = "megatron"
    # Whose attention splits the sequence over context-parallel ranks: "memo" (ours, Megatron's
    # load-balanced layout, parallel.cp_comm_type) or "deepspeed" (DeepSpeed-Ulysses'
    # DistributedAttention, each rank one contiguous part of the sequence; cp_comm_type=a2a).
    cp_attention: str = "memo"
    # memo, full_swap and full_recompute: walk each layer in tiles of this many tokens of the
    # sequence (4k, 16384; under sequence parallelism a tile is gathered over tp; under context
    # parallelism it divides each of a rank's two chunks), holding one tile's work and a few
    # whole-sequence stores (memo.swap.tiled_layer), memo's and full_swap's tiles swapped;
    # "whole" runs each layer on all its tokens; "auto" (memo, full_swap and full_recompute's
    # default) whole layers where the fit says they fit this machine, else its fastest tile.
    tile_tokens: str = "whole"
    # memo: "auto" (memo's default) keeps every activation on the device where the fit says that
    # fits this GPU while α is left to solve (nothing is faster: no copy, no recomputation), else
    # swaps; "never" always swaps. A CPU run swaps as asked: its device's memory is the host's,
    # which swapping frees none of, so it runs to rehearse MEMO, not to be fast.
    keep_all: str = "never"


@dataclass
class ParallelConfig:
    """Parallel sizes (conf/parallel/); their product must equal the number of processes."""

    tp: int = 1  # tensor parallel
    cp: int = 1  # context parallel
    pp: int = 1  # pipeline parallel
    dp: int = 1  # data parallel
    sequence_parallel: bool = False  # shard norms and dropout regions along the sequence (tp > 1)
    # How context-parallel ranks exchange keys and values (Megatron's names): all_gather (every
    # rank gathers all keys and values before its attention), p2p (a ring of point-to-point
    # transfers overlapped with attention) or a2a (Ulysses: all-to-all from sequence to heads and
    # back; the heads must divide by tp·cp).
    cp_comm_type: str = "all_gather"
    # Try every valid layout of the devices instead of the sizes above: mode=fit
    # (conf/parallel/search.yaml) reports the one that fits the longest sequence; mode=train
    # (conf/parallel/auto.yaml) runs the fastest that fits (memo.fit.choice).
    search: bool = False


@dataclass
class HardwareConfig:
    """The machine a run is measured against (conf/hardware/).

    A field left ``None`` takes the value of the entry of the same name in
    :data:`memo.hardware.HARDWARE` (or, for ``auto``, of the detected device).
    """

    name: str = MISSING
    peak_flops: Optional[float] = None  # dense 16-bit FLOP/s per device (CPU: measured, fp32)
    device_memory_gib: Optional[float] = None  # per device
    host_memory_gib: Optional[float] = None  # per node
    devices_per_node: Optional[int] = None
    host_link_gbps: Optional[float] = None  # device <-> host copy bandwidth, GB/s (1e9 B/s)
    intra_node_gbps: Optional[float] = None  # device <-> device within a node (NVLink), GB/s
    inter_node_gbps: Optional[float] = None  # network per node (all its NICs together), GB/s


@dataclass
class ClusterConfig:
    """The devices a job runs on (mode=fit sizes layouts for it)."""

    gpus: Optional[int] = None  # None: tp·cp·pp·dp of ``parallel``


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 10
    # first steps left out of the timing metrics (allocator, autotuning); fewer in a run of fewer
    # steps, whose last step is always timed
    warmup_steps: int = 2
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank
    micro_batches: int = 1  # micro-batches accumulated per step
    lr: float = 1e-3
    lr_warmup_steps: int = 0  # linear learning-rate warm-up from 0
    # after the warm-up (memo.execute.schedule, Megatron-core's formulas, 0-based step k at its
    # step k + 1): constant, linear, cosine, wsd (warmup-stable-decay) or inverse_sqrt; the
    # decaying ones reach min_lr at lr_decay_steps
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    lr_decay_steps: Optional[int] = None  # None: train.steps
    lr_wsd_decay_steps: Optional[int] = None  # wsd: the final decay's steps; None: a tenth of the decay
    lr_wsd_decay_style: str = "linear"  # wsd: linear, cosine, exponential or minus_sqrt
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16 or fp64 (CPU checks)
    # "synthetic"; the path of a text file read as byte tokens; or "megatron:<prefix>" (a .bin/.idx
    # pair, python -m memo.data.prepare) or a weighted blend "megatron:0.7 <prefix> 0.3 <prefix>",
    # documents packed to seq tokens by megatron-core's GPT dataset (memo.data.corpus)
    data: str = "synthetic"
    tokenizer: Optional[str] = None  # megatron data: the corpus's tokenizer.json (nothing downloaded)
    eod_token: Optional[str] = None  # its end-of-document token; None: <|endoftext|>, </s>, ... it has
    # megatron data: each packed document attends within itself, its rotary positions restart, and
    # no token is predicted across its end (memo.model.documents)
    document_mask: bool = False
    # megatron data: Megatron's train,valid,test weights of the documents of each prefix
    data_split: str = "969,30,1"
    # megatron data: where megatron-core caches its sample indices; None: cache/ beside the prefix
    data_cache: Optional[str] = None
    attention_backend: str = "auto"  # auto, te, cudnn, flash, efficient or math
    # Megatron's distributed optimizer: Adam's states and the fp32 main weights sharded over the
    # dp·cp ranks (GPU). None: on wherever dp·cp > 1, as every Megatron-LM long-context recipe.
    distributed_optimizer: Optional[bool] = None
    # "host": Adam's moments and the fp32 main weights live in host memory and Adam steps on the
    # CPU (Megatron-core's HybridDeviceOptimizer; turns the distributed optimizer on; GPU runs with
    # bf16 or fp16 weights only); "none": they stay on the device (memo.execute.optimizer_offload);
    # "auto": on the device where the fit says they fit, else on the host (memo.fit.choice).
    optimizer_offload: str = "auto"
    # With optimizer_offload=host: the share of this rank's parameters, in (0, 1], whose states go
    # to the host (the first ones in the optimizer's order); the rest stay on the device.
    optimizer_offload_fraction: float = 1.0
    # Refuse up front, as a run that chooses its settings (auto) is, a run whose own settings the
    # fit predicts not to fit this machine (memo.fit.choice); false: explicit settings are tried as given
    fit_check: bool = False
    # This warm-up step (1-based) run under torch.profiler (None: none): its trace, timeline.json.gz,
    # and its device time by category, timeline.csv, go into the run's directory (memo.execute.timeline);
    # a warm-up step, so that the profiler's cost stays out of the timed ones
    timeline_step: Optional[int] = None
    # Validation (memo.execute.evaluate): every eval_interval steps and after the last step (None:
    # never), the loss on eval_iters global batches of held-out samples, whole and in eval_buckets
    # equal spans of positions
    eval_interval: Optional[int] = None
    eval_iters: int = 1
    eval_buckets: int = 4
    # Checkpoints (memo.execute.checkpoint): saved every save_interval steps and after the last
    # step (None: never), into save_dir (None: checkpoints/ in the run directory).
    save_interval: Optional[int] = None
    save_dir: Optional[str] = None
    # auto: go on from the last checkpoint in save_dir if it has one (a requeued job does), else
    # start afresh; a checkpoint (step_<n>/) or a directory of them (its last); null: start afresh
    load: Optional[str] = "auto"
    # Output layer and cross entropy: auto (the method's `loss`), tiled (logits made per tile of
    # tokens, never for the whole sequence; memo.model.loss) or megatron (Megatron-core's own).
    loss: str = "auto"
    # tiled: tokens of this rank per tile; None: chosen with the layers' tiles (memo.fit.choice):
    # the largest power of two whose fp32 logits take at most 256 MiB and one FC1 output of a
    # layer's tile (of the whole sequence in whole layers).
    loss_tile_tokens: Optional[int] = None


@dataclass
class ProfileConfig:
    """How ``mode=profile`` and ``mode=plan`` trace one iteration (memo.profile)."""

    # fake (fake tensors: any size, per-rank sizes of any layout, nothing allocated; what auto
    # picks), cpu (real tensors, one process) or cuda (the GPU caching allocator's requests).
    backend: str = "auto"


@dataclass
class PlannerConfig:
    """The memory planner of ``mode=plan`` (memo.plan)."""

    time_limit_s: float = 60.0  # for the whole bi-level plan
    # The paper's big-M MIP, tried where greedy placement is not proven optimal: gurobi (only
    # where its license accepts the model's size), highs, or none.
    mip: str = "gurobi"


@dataclass
class FitConfig:
    """``mode=fit``: how the longest sequence is searched, and every assumption of the predicted
    iteration time (memo.fit). Calibrate the efficiencies from measured rows of your cluster."""

    seq_step: str = "64k"  # seq=max searches multiples of this (tokens, 64k = 65536)
    seq_limit: str = "8192k"  # and none longer
    # With train.document_mask: the documents' length the prediction assumes (tokens, e.g. "64k",
    # the longest document of the data), attention's work being Σ n² over them; null: one document
    # of the whole sequence. Memory is predicted as for one document (a document's attention makes
    # and keeps no more than the whole sequence's).
    document_tokens: Optional[str] = None
    runners_up: int = 3  # parallel=search: layouts reported after the best one
    # parallel=search: "runnable" (only layouts that training runs: no pipeline parallelism; the
    # others are listed in layouts.csv with the reason) or "all".
    layouts: str = "runnable"
    # Memory the activations cannot use on a GPU outside PyTorch's allocator and NCCL: the CUDA
    # context and the libraries' modules (1.2 to 2.4 GiB measured on one GPU; a CPU has none).
    device_reserved_gib: float = 2.0
    # Channels of each NCCL communicator a multi-device layout uses, for its buffers (NCCL picks
    # up to 32 on the NVLink of 8 H100; NCCL_MAX_NCHANNELS caps it): see memo.fit.memory.nccl_buffers.
    nccl_channels: int = 32
    # Whether Megatron's Adam on the predicted GPUs is PyTorch's multi-tensor AdamW, whose step makes
    # an fp32 element per parameter at once: None, as Megatron falls back on this machine (without
    # Transformer Engine or Apex); false, their fused Adam, as a Megatron-LM cluster runs it.
    pytorch_adam: Optional[bool] = None
    # What a GPU run's caching allocator holds beyond the traced iteration's tensors, MiB: cuBLAS's
    # workspaces among them (65.0 to 72.2 MiB on every Megatron row of results/gpu/ from 32K tokens on).
    device_workspace_mib: float = 64.0
    # Share of the device's memory a fitting configuration leaves free: the largest error of the
    # fit's memory against the GPU rows measured with this code (results/gpu/), and at least 3%.
    memory_margin: float = 0.03
    # Share of a node's host memory that can be pinned for swapped activations (the rest is the
    # OS, the data loader, checkpoints).
    host_usable_fraction: float = 0.9
    # Fractions of the device's peak FLOP/s reached by the weight GEMMs and by the attention
    # kernel (forward, backward); the attention backward does 2.5× its forward's FLOPs
    # (FlashAttention recomputes the scores), counted here, not in the model FLOPs.
    # With hardware=auto on a GPU: the three efficiencies below and the host link measured on the
    # device (memo.fit.rates, cached), in place of these figures and the table's; false keeps them.
    measured_rates: bool = True
    gemm_efficiency: float = 0.7
    attention_forward_efficiency: float = 0.6
    attention_backward_efficiency: float = 0.5
    # Fraction of collective time hidden behind compute: tensor-parallel gathers and reductions
    # (Megatron runs them in line by default) and the data-parallel gradient reduction.
    tp_comm_overlap: float = 0.0
    dp_comm_overlap: float = 0.0
    # Fraction of a link's nominal bandwidth a collective reaches.
    link_efficiency: float = 0.8
    # train.optimizer_offload=host: GB/s one device's Adam on the host streams (its share of the
    # node's cores and memory bandwidth)
    host_adam_gbps: float = 10.0
    # parallel=search: besides the layouts, the layers' tiles tried for a method that walks tiles
    # (memo, full_swap, full_recompute; "whole" or tokens as method.tile_tokens takes them) and the
    # placements of Adam's states tried (train.optimizer_offload: none, host); a fixed layout
    # predicts the run's own method.tile_tokens and train.optimizer_offload.
    tile_tokens: list[str] = field(default_factory=lambda: ["whole", "8k", "16k", "32k"])
    optimizer_offload: list[str] = field(default_factory=lambda: ["none"])


@dataclass
class AnchorConfig:
    """A published result a run is set beside (conf/anchor/, experiment ``anchors``): whose it is,
    its longest sequence as published (tokens, decimal millions as the peer writes them), and
    where; recorded in the run's row, read by the report."""

    peer: Optional[str] = None
    peer_tokens: Optional[int] = None
    source: Optional[str] = None


@dataclass
class RunConfig:
    """One job: ``python run.py`` resolves to exactly one of these."""

    # train; profile (write one iteration's allocation trace); plan (and plan it); fit (predict
    # memory, α and time per iteration, without running; seq=max and parallel=search search).
    mode: str = "train"
    # The paper experiment a sweep belongs to (set by conf/experiment/*), recorded in each row.
    experiment: Optional[str] = None
    seq: str = "1k"  # tokens: 4096, 4k or 1408k (k = 1024); mode=fit also takes max
    # method=memo: the fraction of tokens whose skeletal activations are swapped to the host
    # (the rest are recomputed), a number in [0, 1], or "auto" to solve MEMO's α problem.
    alpha: str = "auto"
    # Serve the layers' tensors at the offsets of a bi-level memory plan of the run's last
    # warm-up step, in one arena, instead of the caching allocator (memo.plan.runtime;
    # mode=fit predicts both).
    plan: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)


def register_configs() -> None:
    """Register :class:`RunConfig` as ``run_schema``, the base of ``conf/config.yaml``. (The
    launcher's and the sweeper's schemas are registered by their plugins, which Hydra loads.)"""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
