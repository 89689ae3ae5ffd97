"""The run configuration as typed dataclasses.

Hydra merges ``conf/`` and the command line into :class:`RunConfig`, so a misspelt key or a
value of the wrong type is refused before any code runs; :func:`memo.config.validate` then
checks what types cannot (divisibility, allowed names, ranges).

Every field says what it is in ``metadata["help"]``, one line, which ``python run.py --help``
lists (:mod:`memo.config.options`); comments beside a field say why.
"""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from memo.config import hf_model  # noqa: F401  (the resolver of model=hf's fields, registered on import)


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape (conf/model/): pre-norm, RoPE, no dropout.

    The defaults are the paper's GPT-3 shape (LayerNorm, GeLU, biases, multi-head attention, one
    tied embedding); Llama-3 and Qwen2.5 set the fields below them (Megatron-core's names where it
    has one) from their published configs.
    """

    name: str = field(default=MISSING, metadata={
        "help": "The model's name (its file in conf/model/), recorded in each row."})
    num_layers: int = field(default=MISSING, metadata={"help": "Transformer layers."})
    hidden_size: int = field(default=MISSING, metadata={
        "help": "Width of the residual stream and the embedding."})
    ffn_hidden_size: int = field(default=MISSING, metadata={
        "help": "Width of each MLP's hidden layer (swiglu's FC1 is twice as wide)."})
    num_attention_heads: int = field(default=MISSING, metadata={
        "help": "Query heads of each attention layer."})
    num_query_groups: Optional[int] = field(default=None, metadata={
        "help": "Grouped-query attention: heads of keys and values; null: one per query head."})
    kv_channels: Optional[int] = field(default=None, metadata={
        "help": "Width of each attention head (head_dim; Qwen3's is not hidden_size / heads); null: "
                "hidden_size / num_attention_heads."})
    qk_layernorm: bool = field(default=False, metadata={
        "help": "A norm of each query and key head before RoPE (Qwen3's q_norm and k_norm)."})
    activation: str = field(default="gelu", metadata={
        "help": "MLP activation: gelu (one FC1 output) or swiglu (SiLU-gated, FC1 2·ffn_hidden_size "
                "wide)."})
    normalization: str = field(default="LayerNorm", metadata={"help": "LayerNorm or RMSNorm."})
    norm_epsilon: float = field(default=1e-5, metadata={
        "help": "Epsilon added to the variance in every norm."})
    add_bias_linear: bool = field(default=True, metadata={"help": "Biases in every linear layer."})
    add_qkv_bias: bool = field(default=False, metadata={
        "help": "Biases in the QKV projection alone (Qwen2)."})
    untie_embeddings_and_output_weights: bool = field(default=False, metadata={
        "help": "An output layer of its own instead of the input embedding's weights."})
    vocab_size: int = field(default=50257, metadata={"help": "Vocabulary size (tokens)."})
    # The same padding for every tp keeps the model, and its parameter count, layout-independent.
    make_vocab_size_divisible_by: int = field(default=128, metadata={
        "help": "The embedding is padded to a multiple of this (and of tp), as Megatron-LM does."})
    rotary_base: int = field(default=10000, metadata={"help": "RoPE's base (rope_theta)."})
    rope_scaling: bool = field(default=False, metadata={
        "help": "Llama-3.1's RoPE scaling: low- and high-frequency factors 1 and 4 over an original "
                "8192-token context, as Megatron-core's RotaryEmbedding applies it."})
    rope_scaling_factor: float = field(default=8.0, metadata={
        "help": "rope_scaling: Llama-3.1's scaling factor."})
    init_from: Optional[str] = field(default=None, metadata={
        "help": "mode=train: start from this Llama, Qwen2 or Qwen3 checkpoint in transformers' format (the "
                "directory save_pretrained writes), of this shape (model=hf reads the shape from it); null: "
                "random weights."})


@dataclass
class MethodConfig:
    """How activations are kept for the backward pass (conf/method/), as written; resolved into a
    :class:`memo.config.Method` (memo.config.method), whose activation policy (memo.policy) does it."""

    name: str = field(default=MISSING, metadata={
        "help": "The method's name (its file in conf/method/), recorded in each row."})
    # Megatron-core's own recomputation (TransformerConfig fields of the same names).
    recompute_granularity: Optional[str] = field(default=None, metadata={
        "help": "Megatron-core's recomputation: null (none), full or selective."})
    recompute_method: Optional[str] = field(default=None, metadata={
        "help": "Megatron full recomputation: uniform or block."})
    recompute_num_layers: Optional[int] = field(default=None, metadata={
        "help": "Megatron full recomputation: layers per checkpointed chunk."})
    recompute_modules: Optional[list[str]] = field(default=None, metadata={
        "help": "Megatron selective recomputation: the modules recomputed, e.g. [core_attn]."})
    # Of Megatron's names, those that act on the dense Transformer Engine layers.
    offload_modules: Optional[list[str]] = field(default=None, metadata={
        "help": "Megatron-core's fine-grained activation offloading: modules of every layer whose saved "
                "tensors go to the host after their forward and come back for their backward: qkv_linear "
                "(input norm and QKV projection), core_attn, attn_proj (needs core_attn); null: none."})
    layer_activations: str = field(default="megatron", metadata={
        "help": "Who keeps each layer's activations: megatron (Megatron, with recompute_*), swap (MEMO's "
                "token-wise swapping and recomputation), recompute (keep each layer's input, recompute "
                "the whole layer, attention included) or keep (our layer keeps everything; the fit traces "
                "it for swap)."})
    alpha: Optional[float] = field(default=None, metadata={
        "help": "swap only: a fixed fraction of tokens swapped, in [0, 1] (full_swap: 1.0); null: the "
                "top-level alpha."})
    loss: str = field(default="megatron", metadata={
        "help": "The loss unless train.loss says otherwise: tiled (memo's sequence-tiled output layer and "
                "cross entropy) or megatron (Megatron-core's own)."})
    cp_attention: str = field(default="memo", metadata={
        "help": "Whose attention splits the sequence over context-parallel ranks: memo (ours, Megatron's "
                "load-balanced layout, parallel.cp_comm_type) or deepspeed (DeepSpeed-Ulysses, each rank "
                "one contiguous part; cp_comm_type=a2a)."})
    tile_tokens: str = field(default="whole", metadata={
        "help": "memo, full_swap, full_recompute: walk each layer in tiles of this many tokens (4k, "
                "16384; gathered over tp under sequence parallelism, dividing each of a rank's two chunks "
                "under cp), memo's and full_swap's tiles swapped; whole: all tokens at once; auto: whole "
                "where the fit says it fits this machine, else its fastest tile."})
    # auto: nothing is faster than keeping everything (no copy, no recomputation). A CPU run swaps as
    # asked: its device's memory is the host's, which swapping frees none of, so it runs to rehearse
    # MEMO, not to be fast.
    keep_all: str = field(default="never", metadata={
        "help": "memo: auto keeps every activation on the device where the fit says that fits this GPU "
                "while alpha is left to solve, else swaps; never always swaps."})


@dataclass
class ParallelConfig:
    """Parallel sizes (conf/parallel/); their product must equal the number of processes."""

    tp: int = field(default=1, metadata={"help": "Tensor-parallel size."})
    cp: int = field(default=1, metadata={"help": "Context-parallel size: ranks the sequence is split over."})
    pp: int = field(default=1, metadata={"help": "Pipeline-parallel size: stages the layers are split over "
                                             "(Megatron's 1F1B schedule)."})
    vpp: int = field(default=1, metadata={
        "help": "Virtual pipeline stages per pipeline rank (Megatron's interleaved 1F1B, pp > 1): each rank holds "
                "vpp chunks of num_layers / (pp·vpp) layers; 1: plain 1F1B."})
    dp: int = field(default=1, metadata={"help": "Data-parallel size."})
    sequence_parallel: bool = field(default=False, metadata={
        "help": "Shard norms and dropout regions along the sequence (tp > 1)."})
    cp_comm_type: str = field(default="all_gather", metadata={
        "help": "How context-parallel ranks exchange keys and values: all_gather (all of them before "
                "attention), p2p (a ring overlapped with attention) or a2a (Ulysses: all-to-all from "
                "sequence to heads and back; heads must divide by tp·cp)."})
    search: bool = field(default=False, metadata={
        "help": "Try every valid layout of the devices instead of the sizes above: mode=fit reports the "
                "one that fits the longest sequence, mode=train runs the fastest that fits "
                "(memo.fit.choice)."})


@dataclass
class HardwareConfig:
    """The machine a run is measured against (conf/hardware/).

    A field left ``None`` takes the value of the entry of the same name in
    :data:`memo.hardware.HARDWARE` (or, for ``auto``, of the detected device).
    """

    name: str = field(default=MISSING, metadata={
        "help": "The machine's name (its file in conf/hardware/); auto: detect the device."})
    peak_flops: Optional[float] = field(default=None, metadata={
        "help": "Dense 16-bit FLOP/s per device (CPU: measured, fp32); null: memo.hardware's."})
    device_memory_gib: Optional[float] = field(default=None, metadata={
        "help": "Memory per device, GiB; null: memo.hardware's."})
    host_memory_gib: Optional[float] = field(default=None, metadata={
        "help": "Host memory per node, GiB; null: memo.hardware's."})
    devices_per_node: Optional[int] = field(default=None, metadata={
        "help": "Devices per node; null: memo.hardware's."})
    host_link_gbps: Optional[float] = field(default=None, metadata={
        "help": "Device <-> host copy bandwidth, GB/s (1e9 B/s); null: memo.hardware's."})
    intra_node_gbps: Optional[float] = field(default=None, metadata={
        "help": "Device <-> device bandwidth within a node (NVLink), GB/s; null: memo.hardware's."})
    inter_node_gbps: Optional[float] = field(default=None, metadata={
        "help": "Network bandwidth per node (all its NICs together), GB/s; null: memo.hardware's."})


@dataclass
class ClusterConfig:
    """The devices a job runs on (mode=fit sizes layouts for it)."""

    gpus: Optional[int] = field(default=None, metadata={
        "help": "Devices of the job; null: tp·cp·pp·dp of parallel."})


@dataclass
class LaunchConfig:
    """How ``python run.py`` starts the job's processes on this machine (memo.execute.launch)."""

    processes: int = field(default=1, metadata={
        "help": "Processes of the job this command starts on this machine (as torchrun's --nproc-per-node), "
                "laid out by parallel (tp·cp·pp·dp must equal it) or chosen among them by parallel=auto; "
                "1: this process alone, or the ranks torchrun or srun started."})


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = field(default=10, metadata={"help": "Optimizer steps the run takes."})
    # The first steps pay for the allocator's growth and the kernels' autotuning.
    warmup_steps: int = field(default=2, metadata={
        "help": "First steps left out of the timing metrics; fewer in a run of fewer steps, whose last "
                "step is always timed."})
    micro_batch_size: int = field(default=1, metadata={
        "help": "Sequences per micro-batch per data-parallel rank."})
    micro_batches: int = field(default=1, metadata={"help": "Micro-batches accumulated per step."})
    lr: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    lr_warmup_steps: int = field(default=0, metadata={
        "help": "Steps of linear learning-rate warm-up from 0."})
    # memo.execute.schedule: Megatron-core's formulas, 0-based step k at its step k + 1.
    lr_schedule: str = field(default="constant", metadata={
        "help": "Learning rate after the warm-up: constant, linear, cosine, wsd (warmup-stable-decay) or "
                "inverse_sqrt; the decaying ones reach min_lr at lr_decay_steps."})
    min_lr: float = field(default=0.0, metadata={"help": "Learning rate the decaying schedules end at."})
    lr_decay_steps: Optional[int] = field(default=None, metadata={
        "help": "Step at which a decaying schedule reaches min_lr; null: train.steps."})
    lr_wsd_decay_steps: Optional[int] = field(default=None, metadata={
        "help": "wsd: the final decay's steps; null: a tenth of the decay after the warm-up."})
    lr_wsd_decay_style: str = field(default="linear", metadata={
        "help": "wsd: the final decay's shape: linear, cosine, exponential or minus_sqrt."})
    weight_decay: float = field(default=0.1, metadata={
        "help": "AdamW's weight decay of the matrices (biases and norms get none)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam's beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "Adam's beta2."})
    clip_grad: float = field(default=1.0, metadata={
        "help": "Clip the gradients' global norm to this; 0: no clipping."})
    seed: int = field(default=1234, metadata={
        "help": "Seed of the initial weights and of the data (sample i is a function of the seed and i)."})
    dtype: str = field(default="auto", metadata={
        "help": "Training precision: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16 or fp64 (CPU "
                "checks)."})
    data: str = field(default="synthetic", metadata={
        "help": "Training data: synthetic; the path of a text file read as byte tokens; or "
                "megatron:<prefix> (a .bin/.idx pair, python -m memo.data.prepare) or a weighted blend "
                "\"megatron:0.7 <prefix> 0.3 <prefix>\", documents packed to seq tokens by megatron-core's "
                "GPT dataset (memo.data.corpus)."})
    tokenizer: Optional[str] = field(default=None, metadata={
        "help": "megatron data: the corpus's tokenizer.json (nothing is downloaded)."})
    eod_token: Optional[str] = field(default=None, metadata={
        "help": "megatron data: its end-of-document token; null: the <|endoftext|>, </s>, ... it has."})
    document_mask: bool = field(default=False, metadata={
        "help": "megatron data: each packed document attends within itself, its rotary positions restart, "
                "and no token is predicted across its end (memo.model.documents)."})
    data_split: str = field(default="969,30,1", metadata={
        "help": "megatron data: Megatron's train,valid,test weights of the documents of each prefix."})
    data_cache: Optional[str] = field(default=None, metadata={
        "help": "megatron data: where megatron-core caches its sample indices; null: cache/ beside the "
                "prefix."})
    attention_backend: str = field(default="auto", metadata={
        "help": "Attention kernel: auto, te (Transformer Engine's), or PyTorch's cudnn, flash, efficient "
                "or math."})
    # None follows every Megatron-LM long-context recipe.
    distributed_optimizer: Optional[bool] = field(default=None, metadata={
        "help": "Megatron's distributed optimizer: Adam's states and the fp32 main weights sharded over "
                "the dp·cp ranks (GPU); null: on wherever dp·cp > 1."})
    optimizer_offload: str = field(default="auto", metadata={
        "help": "Where Adam's moments and the fp32 main weights live: host (Adam steps on the CPU, "
                "Megatron-core's HybridDeviceOptimizer; turns the distributed optimizer on; GPU runs with "
                "bf16 or fp16 weights only), none (on the device) or auto (on the device where the fit "
                "says they fit, else on the host)."})
    optimizer_offload_fraction: float = field(default=1.0, metadata={
        "help": "optimizer_offload=host: the share of this rank's parameters, in (0, 1], whose states go "
                "to the host (the first in the optimizer's order); the rest stay on the device."})
    fit_check: bool = field(default=False, metadata={
        "help": "Refuse up front, as a run that chooses its settings (auto) is, a run whose own settings "
                "the fit predicts not to fit this machine; false: explicit settings are tried as given."})
    # A warm-up step, so that the profiler's cost stays out of the timed ones.
    timeline_step: Optional[int] = field(default=None, metadata={
        "help": "Run this warm-up step (1-based) under torch.profiler: its trace (timeline.json.gz) and "
                "its device time by category (timeline.csv) go into the run's directory; null: none."})
    eval_interval: Optional[int] = field(default=None, metadata={
        "help": "Validate every this many steps and after the last step (memo.execute.evaluate); null: "
                "never."})
    eval_iters: int = field(default=1, metadata={
        "help": "Validation: global batches of held-out samples each time."})
    eval_buckets: int = field(default=4, metadata={
        "help": "Validation: the loss also in this many equal spans of positions."})
    save_interval: Optional[int] = field(default=None, metadata={
        "help": "Save a checkpoint every this many steps and after the last step "
                "(memo.execute.checkpoint); null: never."})
    save_dir: Optional[str] = field(default=None, metadata={
        "help": "Where checkpoints go; null: checkpoints/ in the run directory."})
    load: Optional[str] = field(default="auto", metadata={
        "help": "Where training starts: auto (the last checkpoint in save_dir if it has one, as a "
                "requeued job does, else afresh); a checkpoint (step_<n>/) or a directory of them (its "
                "last); null: afresh."})
    resume: bool = field(default=False, metadata={
        "help": "Continue the stopped run (interrupted, killed) of the same settings in this run's directory, "
                "from its last checkpoint, its step logs cut back to it and appended to (train.steps may be "
                "raised); a directory without a run is claimed afresh; a finished or different run is refused."})
    loss: str = field(default="auto", metadata={
        "help": "Output layer and cross entropy: auto (the method's loss), tiled (logits made per tile of "
                "tokens, never for the whole sequence; memo.model.loss) or megatron (Megatron-core's "
                "own)."})
    loss_tile_tokens: Optional[int] = field(default=None, metadata={
        "help": "tiled loss: tokens of this rank per tile; null: chosen with the layers' tiles, the "
                "largest power of two whose fp32 logits take at most 256 MiB and one FC1 output of a "
                "layer's tile (memo.fit.choice)."})


@dataclass
class ProfileConfig:
    """How ``mode=profile`` and ``mode=plan`` trace one iteration (memo.profile)."""

    backend: str = field(default="auto", metadata={
        "help": "What traces: fake (fake tensors: any size, per-rank sizes of any layout, nothing "
                "allocated; what auto picks), cpu (real tensors, one process) or cuda (the GPU caching "
                "allocator's requests)."})


@dataclass
class PlannerConfig:
    """The memory planner of ``mode=plan`` (memo.plan)."""

    time_limit_s: float = field(default=60.0, metadata={"help": "Time for the whole bi-level plan, seconds."})
    mip: str = field(default="gurobi", metadata={
        "help": "The paper's big-M MIP, tried where greedy placement is not proven optimal: gurobi (only "
                "where its license accepts the model's size), highs, or none."})


@dataclass
class FitConfig:
    """``mode=fit``: how the longest sequence is searched, and every assumption of the predicted
    iteration time (memo.fit). Calibrate the efficiencies from measured rows of your cluster."""

    seq_step: str = field(default="64k", metadata={
        "help": "seq=max searches multiples of this (tokens, 64k = 65536)."})
    seq_limit: str = field(default="8192k", metadata={
        "help": "seq=max searches none longer than this (tokens)."})
    # Memory is predicted as for one document: a document's attention makes and keeps no more than
    # the whole sequence's.
    document_tokens: Optional[str] = field(default=None, metadata={
        "help": "With train.document_mask: the documents' length the prediction assumes (tokens, e.g. "
                "64k, the longest document of the data), attention's work being Σ n² over them; null: one "
                "document of the whole sequence."})
    runners_up: int = field(default=3, metadata={
        "help": "parallel=search: layouts reported after the best one."})
    layouts: str = field(default="runnable", metadata={
        "help": "parallel=search: runnable (only layouts that training runs, pipelines included; the "
                "others are listed in layouts.csv with the reason) or all."})
    # 1.2 to 2.4 GiB measured on one GPU.
    device_reserved_gib: float = field(default=2.0, metadata={
        "help": "GPU memory the activations cannot use, outside PyTorch's allocator and NCCL: the CUDA "
                "context and the libraries' modules, GiB (a CPU has none)."})
    # NCCL picks up to 32 on the NVLink of 8 H100: see memo.fit.memory.nccl_buffers.
    nccl_channels: int = field(default=32, metadata={
        "help": "Channels of each NCCL communicator a multi-device layout uses, for its buffers "
                "(NCCL_MAX_NCHANNELS caps it)."})
    pytorch_adam: Optional[bool] = field(default=None, metadata={
        "help": "Whether the predicted GPUs' Adam is PyTorch's multi-tensor AdamW, whose step makes an "
                "fp32 element per parameter at once: null, as on this machine (Megatron falls back on it "
                "without Transformer Engine or Apex); false: their fused Adam, as on a Megatron-LM "
                "cluster."})
    # cuBLAS's workspaces among them: 65.0 to 72.2 MiB on every Megatron row of results/gpu/ from
    # 32K tokens on.
    device_workspace_mib: float = field(default=64.0, metadata={
        "help": "What a GPU run's caching allocator holds beyond the traced iteration's tensors, MiB."})
    # The largest error of the fit's memory against the GPU rows measured with this code
    # (results/gpu/), and at least 3%.
    memory_margin: float = field(default=0.03, metadata={
        "help": "Share of the device's memory a fitting configuration leaves free."})
    # The rest is the OS, the data loader, checkpoints.
    host_usable_fraction: float = field(default=0.9, metadata={
        "help": "Share of a node's host memory that can be pinned for swapped activations."})
    measured_rates: bool = field(default=True, metadata={
        "help": "With hardware=auto on a GPU: measure the three efficiencies below and the host link on "
                "the device (memo.fit.rates, cached) in place of the figures and the table's; false keeps "
                "them."})
    gemm_efficiency: float = field(default=0.7, metadata={
        "help": "Fraction of the device's peak FLOP/s the weight GEMMs reach."})
    attention_forward_efficiency: float = field(default=0.6, metadata={
        "help": "Fraction of the device's peak FLOP/s the attention kernel's forward reaches."})
    attention_backward_efficiency: float = field(default=0.5, metadata={
        "help": "Fraction of the device's peak FLOP/s the attention kernel's backward reaches, its 2.5× "
                "the forward's FLOPs (FlashAttention recomputes the scores) counted, not the model's."})
    tp_comm_overlap: float = field(default=0.0, metadata={
        "help": "Fraction of tensor-parallel gathers and reductions hidden behind compute (Megatron runs "
                "them in line by default)."})
    dp_comm_overlap: float = field(default=0.0, metadata={
        "help": "Fraction of the data-parallel gradient reduction hidden behind compute."})
    link_efficiency: float = field(default=0.8, metadata={
        "help": "Fraction of a link's nominal bandwidth a collective reaches."})
    host_adam_gbps: float = field(default=10.0, metadata={
        "help": "train.optimizer_offload=host: GB/s one device's Adam on the host streams (its share of "
                "the node's cores and memory bandwidth)."})
    tile_tokens: list[str] = field(default_factory=lambda: ["whole", "8k", "16k", "32k"], metadata={
        "help": "parallel=search: the layers' tiles tried for a method that walks tiles (whole or tokens, "
                "as method.tile_tokens takes them); a fixed layout predicts the run's own "
                "method.tile_tokens."})
    optimizer_offload: list[str] = field(default_factory=lambda: ["none"], metadata={
        "help": "parallel=search: the placements of Adam's states tried (none, host); a fixed layout "
                "predicts the run's own train.optimizer_offload."})


@dataclass
class AnchorConfig:
    """A published result a run is set beside (conf/anchor/, experiment ``anchors``), recorded in
    the run's row and read by the report."""

    peer: Optional[str] = field(default=None, metadata={
        "help": "Whose result it is (e.g. ALST); null: none."})
    peer_tokens: Optional[int] = field(default=None, metadata={
        "help": "Its longest sequence as published (tokens, in decimal as the peer writes them: 500K is "
                "500000)."})
    source: Optional[str] = field(default=None, metadata={
        "help": "Where it is published (e.g. arXiv:2506.13996)."})


@dataclass
class RunConfig:
    """One job: ``python run.py`` resolves to exactly one of these."""

    mode: str = field(default="train", metadata={
        "help": "What the job does: train; profile (write one iteration's allocation trace); plan (and "
                "plan it); fit (predict memory, α and time per iteration, without running; seq=max and "
                "parallel=search search)."})
    experiment: Optional[str] = field(default=None, metadata={
        "help": "The paper experiment a sweep belongs to (set by conf/experiment/*), recorded in each "
                "row."})
    seq: str = field(default="1k", metadata={
        "help": "Sequence length, tokens: 4096, 4k or 1408k (k = 1024); mode=fit also takes max."})
    alpha: str = field(default="auto", metadata={
        "help": "method=memo: the fraction of tokens whose skeletal activations are swapped to the host "
                "(the rest are recomputed), in [0, 1], or auto to solve MEMO's α problem."})
    plan: bool = field(default=False, metadata={
        "help": "Serve the layers' tensors at the offsets of a bi-level memory plan of the run's last "
                "warm-up step, in one arena, instead of the caching allocator (memo.plan.runtime; "
                "mode=fit predicts both)."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={
        "help": "The model's shape (model=NAME picks a file of conf/model/)."})
    method: MethodConfig = field(default_factory=MethodConfig, metadata={
        "help": "How activations are kept for the backward pass (method=NAME, conf/method/)."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={
        "help": "Parallel sizes (parallel=NAME, conf/parallel/); their product is the process count."})
    hardware: HardwareConfig = field(default_factory=HardwareConfig, metadata={
        "help": "The machine a run is measured against (hardware=NAME, conf/hardware/); a null field "
                "takes memo.hardware's figure (hardware=auto: the detected device's)."})
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata={
        "help": "The devices a job runs on."})
    launch: LaunchConfig = field(default_factory=LaunchConfig, metadata={
        "help": "The processes one command starts."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "The training loop."})
    profile: ProfileConfig = field(default_factory=ProfileConfig, metadata={
        "help": "How mode=profile and mode=plan trace one iteration."})
    planner: PlannerConfig = field(default_factory=PlannerConfig, metadata={
        "help": "The memory planner of mode=plan."})
    fit: FitConfig = field(default_factory=FitConfig, metadata={
        "help": "mode=fit: the longest sequence's search and the predicted iteration's assumptions."})
    anchor: AnchorConfig = field(default_factory=AnchorConfig, metadata={
        "help": "A published result a run is set beside (anchor=NAME, conf/anchor/)."})


def register_configs() -> None:
    """Register :class:`RunConfig` as ``run_schema``, the base of ``conf/config.yaml``. (The
    launcher's and the sweeper's schemas are registered by their plugins, which Hydra loads; the
    resolver of ``model=hf``'s fields, by importing :mod:`memo.config.hf_model`.)"""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
