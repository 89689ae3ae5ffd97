"""Megatron-core's ``GPTModel`` built from a run configuration.

The layer spec follows what is installed: Transformer Engine's layers and attention on a GPU
when ``transformer_engine`` imports, otherwise Megatron's local layers with
:class:`~memo.model.attention.SdpaAttention`, our norms (:mod:`memo.model.norm`) and MLP
activation (:mod:`memo.model.activation`), and RoPE from one cos/sin table per model
(:class:`~memo.model.rotary.RotarySelfAttention`). All models are pre-norm decoders with RoPE and
no dropout (long-context runs train without it, and it keeps recomputation bit-exact); the
GPT-3 shapes have GeLU MLPs, LayerNorms, biases and tied embeddings, Llama-3 and Qwen2.5 grouped
keys and values, SwiGLU, RMSNorm and an output layer of their own (:class:`ModelConfig`).
"""

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from memo.config import ConfigError, ModelConfig, Workload
from memo.config.method import LOSSES
from memo.model import attention_blocks
from memo.model.activation import Activation
from memo.model.attention import SdpaAttention, select_backend
from memo.model.deepspeed_attention import DeepSpeedUlyssesAttention
from memo.model.documents import rotate_within_documents
from memo.model.host import (HostFactories, HostRotaryEmbedding, forget_rotary_angles, run_megatron_on_device,
                             run_megatron_on_host)
from memo.model.layer import MemoTransformerLayer
from memo.model.linear import TiledColumnParallelLinear, TiledRowParallelLinear
from memo.model.loss import TiledLossGPTModel
from memo.model.rotary import RotarySelfAttention, RotaryTable
from memo.model.norm import norm_class

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass(frozen=True)
class LayerBuild:
    """How the decoder's layers are built: what an activation policy (:mod:`memo.policy`) asks of
    the model. The defaults are Megatron's own layers keeping every activation."""

    # memo's transformer layer (memo.model.layer) keeping "swap", "recompute" or "keep"; None:
    # Megatron's own layer
    activations: Optional[str] = None
    # core attention: DeepSpeed-Ulysses' (each context-parallel rank one contiguous part of the
    # sequence), instead of memo's SDPA attention over Megatron's load-balanced chunks
    ulysses: bool = False
    # Megatron's recomputation: TransformerConfig's recompute_* fields, as (name, value) pairs
    recompute: tuple[tuple[str, object], ...] = ()
    # Megatron's fine-grained activation offloading of these modules (Transformer Engine's layers)
    offload_modules: Optional[tuple[str, ...]] = None
    # what the layers save is taken apart token by token (MEMO's swapping of whole layers): SDPA's
    # math kernel, whose backward keeps the s×s probabilities, is refused
    token_wise_saves: bool = False

    @property
    def local(self) -> bool:
        """Needs Megatron's local layer spec (memo's layer, or DeepSpeed's attention, goes in it)."""
        return self.activations is not None or self.ulysses

    @property
    def sequence_layout(self) -> str:
        """How a context-parallel rank's tokens lie in the sequence (one of
        :data:`memo.model.context_parallel.SEQUENCE_LAYOUTS`)."""
        return "contiguous" if self.ulysses else "load_balanced"


@dataclass
class BuiltModel:
    """A model and the facts about how it was built that a result row records."""

    # this rank's model chunks, in the order of the layers they hold: one, its pipeline stage's,
    # unless the stage is interleaved (parallel.vpp: one per virtual stage)
    chunks: list[GPTModel]
    layer_spec: str  # "te" or "local"
    attention_backend: str  # "te" or an SDPA kernel name: attention over a whole sequence
    # the kernel of context-parallel attention's blocks (memo.model.attention_blocks), "none"
    # where no blocks run (one rank's sequence, Transformer Engine, DeepSpeed's exchange)
    attention_block_kernel: str
    params: int  # of the whole model, all shards
    # Called after the last micro-batch's backward pass of every step, before the optimizer:
    # Megatron's activation offloading starts its next iteration there, as its schedules do.
    step_end: Callable[[], None] = lambda: None

    @property
    def module(self) -> GPTModel:
        """The rank's one model chunk (its whole stage: every run but an interleaved pipeline)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank holds {len(self.chunks)} model chunks (parallel.vpp); take them from chunks")
        return self.chunks[0]


def torch_dtype(workload: Workload) -> torch.dtype:
    """The workload's ``dtype`` as a torch dtype."""
    return DTYPES[workload.dtype]


def dtype_setting(dtype: torch.dtype) -> str:
    """The ``train.dtype`` that names ``dtype``: "fp32", "bf16", "fp16" or "fp64"."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def dtype_label(dtype: torch.dtype) -> str:
    """How rows and traces record ``dtype``: "float32", "bfloat16", "float16"."""
    return str(dtype).removeprefix("torch.")


def head_size(model: ModelConfig) -> int:
    """Width of one attention head (megatron-core's ``kv_channels``): ``model.kv_channels``, else
    hidden ÷ heads."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def attention_width(model: ModelConfig) -> int:
    """Width of a layer's queries and of its attention output: heads · head size (the hidden size
    but where the heads are narrower or wider, as Qwen3's)."""
    return model.num_attention_heads * head_size(model)


def padded_vocab_size(model: ModelConfig, tp: int) -> int:
    """Vocabulary rows of the embedding: a multiple of ``make_vocab_size_divisible_by`` and tp."""
    multiple = math.lcm(model.make_vocab_size_divisible_by, tp)
    return -(-model.vocab_size // multiple) * multiple


def parameter_count(model: ModelConfig, tp: int = 1, pp: int = 1) -> int:
    """Parameters counted from the model's shape: with ``tp = pp = 1`` the whole model (P of the
    MFU formula), otherwise those one device of the first pipeline stage holds.

    Per layer, with ``d`` the head size (:func:`head_size`), ``q = heads·d`` and ``kv = 2·groups·d``:
    QKV ``h·(q + kv)``, projection ``q·h``, FC1 ``h·f`` (``2·h·f`` for SwiGLU), FC2 ``f·h``, each
    with a bias where ``add_bias_linear`` (QKV's also where ``add_qkv_bias``), two norms (``2h``
    each for LayerNorm, ``h`` for RMSNorm) and, with ``qk_layernorm``, a query and a key norm of
    ``d`` each (``2d`` for LayerNorm). tp splits the weights and the QKV and FC1 biases, and
    replicates the projection and FC2 biases and the norms. Then the embedding ``V·h`` (V padded,
    split over tp), an output layer as large where untied, and the final norm (the last stage's).
    """
    h = model.hidden_size
    q, qkv, fc1 = _widths(model)
    split = layer_matmul_weights(model)
    if model.add_bias_linear or model.add_qkv_bias:
        split += qkv
    replicated = 2 * (2 * h if model.normalization == "LayerNorm" else h) + sum(_qk_norms(model))
    if model.add_bias_linear:
        split += fc1
        replicated += 2 * h
    per_layer = split // tp + replicated
    vocab = padded_vocab_size(model, tp) * h // tp
    last_stage = (2 * h if model.normalization == "LayerNorm" else h) + (
        vocab if model.untie_embeddings_and_output_weights else 0)
    return model.num_layers // pp * per_layer + vocab + (last_stage if pp == 1 else 0)


def parameter_numels(model: ModelConfig, tp: int = 1, pp: int = 1) -> list[int]:
    """The elements of each parameter tensor one device of the first pipeline stage holds, in the
    order the built model registers them (the embedding; each layer's norm, projection, QKV, norm,
    FC1, FC2; the final norm and an untied output layer); they add up to :func:`parameter_count`."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, qkv, fc1 = _widths(model)
    norm = [h, h] if model.normalization == "LayerNorm" else [h]
    bias = model.add_bias_linear
    # as Megatron's attention registers them: the projection before QKV, the q and k norms after
    layer = [*norm, q // tp * h, *([h] if bias else []), qkv * h // tp, *([qkv // tp] if bias or model.add_qkv_bias else []),
             *_qk_norms(model), *norm, fc1 // tp * h, *([fc1 // tp] if bias else []), f // tp * h,
             *([h] if bias else [])]
    vocab = padded_vocab_size(model, tp) * h // tp
    last = [*norm, *([vocab] if model.untie_embeddings_and_output_weights else [])] if pp == 1 else []
    return [vocab, *layer * (model.num_layers // pp), *last]


def _qk_norms(model: ModelConfig) -> list[int]:
    """The elements of a layer's query and key norms (``qk_layernorm``), in registration order."""
    if not model.qk_layernorm:
        return []
    d = head_size(model)
    return [d, d] * 2 if model.normalization == "LayerNorm" else [d, d]


def _widths(model: ModelConfig) -> tuple[int, int, int]:
    """(query width ``heads·d``, QKV output width ``(heads + 2·groups)·d``, FC1 output width)."""
    head = head_size(model)
    q = model.num_attention_heads * head
    qkv = q + 2 * (model.num_query_groups or model.num_attention_heads) * head
    return q, qkv, 2 * model.ffn_hidden_size if model.activation == "swiglu" else model.ffn_hidden_size


def layer_matmul_weights(model: ModelConfig) -> int:
    """Weight elements of one layer's four products, all tensor-parallel shards: QKV ``h·(q + kv)``,
    projection ``q·h``, FC1 ``h·f`` (``2·h·f`` for SwiGLU) and FC2 ``f·h``."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, qkv, fc1 = _widths(model)
    return h * qkv + q * h + h * fc1 + f * h


def mlp_matmul_weights(model: ModelConfig) -> int:
    """Weight elements of one layer's MLP products (FC1 and FC2), all tensor-parallel shards: the
    part of :func:`layer_matmul_weights` that Megatron's ``recompute_modules=[mlp]`` runs again."""
    _, _, fc1 = _widths(model)
    return model.hidden_size * fc1 + model.ffn_hidden_size * model.hidden_size


def model_flops_parameters(model: ModelConfig) -> int:
    """P of the MFU formula (:mod:`memo.metrics.flops`): the whole model's parameters, less an
    untied model's input embedding, which is a lookup (its output layer multiplies, as a tied
    embedding does)."""
    lookup = padded_vocab_size(model, 1) * model.hidden_size if model.untie_embeddings_and_output_weights else 0
    return parameter_count(model) - lookup


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of ``module`` seen from this rank: tensor-parallel shards count tp times.

    Tied weights are one ``Parameter`` and so are counted once.
    """
    return count_parameters_of(module.parameters())


def count_parameters_of(params) -> int:
    """:func:`count_parameters` of the parameters ``params``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in params)


def _whole_model_parameters(chunks: list[GPTModel]) -> int:
    """:func:`count_parameters` of the whole model from this rank's chunks: summed over the
    pipeline stages (a collective of the pipeline group), a tied embedding's copy on the last
    stage left out."""
    count = 0
    for chunk in chunks:
        copy = chunk.output_layer.weight if chunk.post_process and not chunk.pre_process and \
            chunk.share_embeddings_and_output_weights else None
        count += count_parameters(chunk) - (0 if copy is None else count_parameters_of([copy]))
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return count
    total = torch.tensor([count], dtype=torch.float64, device=next(chunks[0].parameters()).device)
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return int(total.item())


def transformer_config(workload: Workload, device_type: str, local_spec: bool = True,
                       layers: LayerBuild = LayerBuild()) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` for one run of ``layers``, built on the local layer spec
    (ours) or on Transformer Engine's (``local_spec=False``)."""
    model, parallel, dtype = workload.model, workload.parallel, torch_dtype(workload)
    megatron = dict(layers.recompute)
    if layers.offload_modules is not None and not local_spec:  # uses_transformer_engine refuses the local layers
        megatron.update(fine_grained_activation_offloading=True, offload_modules=list(layers.offload_modules))
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        # gloo has no batched point-to-point operations
        batch_p2p_comm=device_type == "cuda",
        # a stage's output is sent, then only its graph is needed (Megatron-LM's setting)
        deallocate_pipeline_outputs=True,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        cp_comm_type=parallel.cp_comm_type if parallel.cp > 1 else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # The full weight is drawn on the host and split, so every tp gives the same model.
        use_cpu_initialization=device_type == "cpu",
        init_method_std=0.02,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        gated_linear_unit=model.activation == "swiglu",
        activation_func=torch.nn.functional.silu if model.activation == "swiglu" else torch.nn.functional.gelu,
        # the local spec's activation module (memo.model.activation) is called by Megatron's MLP
        # on FC1's whole output only under this flag, whatever the module is
        use_te_activation_func=local_spec,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        **megatron,
    )


def _local_block_spec(config: TransformerConfig, attention_backend: str, layers: LayerBuild,
                      rotary: RotaryTable, vp_stage: Optional[int]) -> ModuleSpec:
    layer = get_gpt_layer_local_spec()
    if layers.activations is not None:
        layer.module = MemoTransformerLayer
        layer.params = {**layer.params, "activations": layers.activations}
        # no persistent all-gather buffer, no whole-sequence partial product or gathered
        # gradient: under sequence parallelism these are transients of one tile
        layer.submodules.self_attention.submodules.linear_qkv = TiledColumnParallelLinear
        layer.submodules.self_attention.submodules.linear_proj = TiledRowParallelLinear
        layer.submodules.mlp.submodules.linear_fc1 = TiledColumnParallelLinear
        layer.submodules.mlp.submodules.linear_fc2 = TiledRowParallelLinear
    norm = norm_class(config.normalization)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if config.qk_layernorm:
        layer.submodules.self_attention.submodules.q_layernorm = norm
        layer.submodules.self_attention.submodules.k_layernorm = norm
    layer.submodules.mlp.submodules.activation_func = Activation
    attention = layer.submodules.self_attention
    attention.module = RotarySelfAttention
    attention.params = {**attention.params, "rotary_table": rotary}  # one for all layers
    core = DeepSpeedUlyssesAttention if layers.ulysses else SdpaAttention
    layer.submodules.self_attention.submodules.core_attention = functools.partial(
        core, backend=attention_backend)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=norm),
    )


def uses_transformer_engine(device_type: str, attention_backend: str, layers: LayerBuild, method: str) -> bool:
    """Whether ``layers`` are built from Transformer Engine's layers (else the local spec), for the
    run of ``method`` (its name, for the messages).

    MEMO's own layers and DeepSpeed's attention are built on the local spec, whose attention and
    norms the swap runtime knows how to take apart.

    Megatron's activation offloading (``layers.offload_modules``) runs on Transformer Engine's
    layers only: its manager copies on CUDA streams of its own and enters Transformer Engine's
    CPU-offload context around every offloaded module.

    Raises:
        ConfigError: if the run needs Transformer Engine (``attention_backend=te``, or Megatron's
            offloading) and it cannot be used here.
    """
    if layers.offload_modules is not None:
        missing = [what for what, absent in (("a GPU", device_type != "cuda"),
                                             ("Transformer Engine (pip install '.[gpu]')", not HAVE_TE))
                   if absent]
        if missing:
            raise ConfigError(
                f"method={method} is Megatron-core's fine-grained activation offloading, which needs "
                f"{' and '.join(missing)} (it copies on CUDA streams inside Transformer Engine's CPU-offload "
                "context), not here; use a method that does not offload"
            )
        if attention_backend not in ("auto", "te"):
            raise ConfigError(
                f"method={method} runs on Transformer Engine's layers and attention, so "
                f"train.attention_backend={attention_backend} is not supported with it; use "
                "train.attention_backend=auto"
            )
    if layers.local and attention_backend == "te":
        raise ConfigError(
            f"method={method} runs on Megatron's local layers, so train.attention_backend=te "
            "(Transformer Engine's attention) is not supported with it; use train.attention_backend=auto"
        )
    use_te = (
        device_type == "cuda" and HAVE_TE and attention_backend in ("auto", "te") and not layers.local
    )
    if attention_backend == "te" and not use_te:
        raise ConfigError(
            "train.attention_backend=te needs Transformer Engine on a GPU (pip install '.[gpu]'); "
            "use train.attention_backend=auto"
        )
    return use_te


def _prepare_megatron(device_type: str) -> None:
    """Megatron's device functions for a job on ``device_type``: the host adapters on the CPU
    (whether or not the machine has CUDA); on a GPU Megatron's own, with the CUDA generators its
    weight initialisation draws from seeded from the torch seed, as every GPU entry point needs.
    Megatron's RoPE cache lets go of the models built before."""
    forget_rotary_angles()
    if device_type == "cpu":
        run_megatron_on_host()
        return
    run_megatron_on_device()
    model_parallel_cuda_manual_seed(torch.initial_seed())


def build_gpt(workload: Workload, device_type: str, attention_backend: str = "auto", *,
              layers: LayerBuild) -> BuiltModel:
    """Build the GPT of ``workload`` for this rank on ``device_type`` ("cuda" or "cpu"), its layers
    as ``layers`` says (the run's activation policy's, :mod:`memo.policy`), for sequences of up to
    ``workload.seq`` tokens: the rank's pipeline stage, as one model chunk per virtual stage
    (``parallel.vpp``), the embedding in the first stage's first chunk and the final norm and loss
    in the last stage's last. A tied embedding's other end on the last stage is Megatron's: a copy
    of the first stage's word embedding, whose gradients the optimizer sums over the two.

    The workload's ``loss`` is "megatron" (Megatron's output layer and vocab-parallel cross entropy)
    or "tiled" (:class:`~memo.model.loss.TiledLossGPTModel`, ``workload.loss_tile_tokens`` tokens
    per tile, ``None`` for its default).

    Megatron's parallel state must be initialized (see :mod:`memo.execute.distributed`) and
    the torch seed set: the weights are drawn from it (on a GPU, from Megatron's CUDA generators,
    seeded here with it), each stage's from the same seed, so that another ``parallel.pp`` draws
    other weights (as in Megatron-LM; ``model.init_from`` or a checkpoint gives every layout the same).

    Raises:
        ConfigError: if the attention backend asked for is not available here, or is SDPA's math
            kernel for layers whose saves are taken apart token by token.
    """
    parallel, loss, method = workload.parallel, workload.loss, workload.method.name
    if parallel.pp > 1:  # stage r draws from seed + 100·r, as Megatron-LM seeds its stages: none draws another's layers
        torch.manual_seed(torch.initial_seed() + 100 * parallel_state.get_pipeline_model_parallel_rank())
    _prepare_megatron(device_type)
    if loss not in LOSSES:
        raise ConfigError(f"train.loss={loss} is not a loss; choose one of: {', '.join(LOSSES)}")
    dtype = torch_dtype(workload)
    use_te = uses_transformer_engine(device_type, attention_backend, layers, method)
    config = transformer_config(workload, device_type, local_spec=not use_te, layers=layers)
    block_kernel = "none"
    if use_te:
        backend = "te"
    else:
        grouped = config.num_query_groups not in (None, config.num_attention_heads)
        backend = select_backend(device_type, dtype, config.kv_channels, attention_backend, grouped)
        if parallel.cp > 1 and not layers.ulysses:
            capability = torch.cuda.get_device_capability() if device_type == "cuda" else None
            block_kernel = attention_blocks.choose(backend, device_type, capability, dtype,
                                                   config.kv_channels)
        if layers.token_wise_saves and backend == "math" and block_kernel == "none":
            # SDPA's math kernel saves the s×s probabilities for its backward, which no token-wise
            # slot can hold (context-parallel blocks save only O(s) tensors, whatever the kernel)
            raise ConfigError(
                f"method={method} needs a fused attention kernel, and {device_type} in {dtype} with "
                f"head size {config.kv_channels} has only the math kernel (its backward keeps the s×s "
                "probabilities); use bf16 or fp16 on a GPU, or a method that does not swap"
                if attention_backend == "auto" else
                f"method={method} swaps attention's saved tensors token by token, and the math "
                "kernel's backward keeps the s×s probabilities; use train.attention_backend=auto"
            )
    stages = [None] if parallel.vpp == 1 else list(range(parallel.vpp))
    # (Megatron moves the last stage's copy of a tied embedding to the GPU to make it the first's)
    with HostFactories() if device_type == "cpu" and parallel.pp > 1 else contextlib.nullcontext():
        chunks = [_build_chunk(workload, device_type, config, layers, backend, vp_stage) for vp_stage in stages]
    step_end = lambda: None  # noqa: E731
    if config.fine_grained_activation_offloading:
        # a manager of this model's own: the one before (an earlier job of a sweep) holds that
        # model's chunks, and would take this model's first step for a later one
        FineGrainedActivationOffloadingInterface.reset_instance()
        step_end = FineGrainedActivationOffloadingInterface.reset
    return BuiltModel(
        chunks=chunks,
        layer_spec="te" if use_te else "local",
        attention_backend=backend,
        attention_block_kernel=block_kernel,
        params=_whole_model_parameters(chunks),
        step_end=step_end,
    )


def _build_chunk(workload: Workload, device_type: str, config: TransformerConfig, layers: LayerBuild,
                 backend: str, vp_stage: Optional[int]) -> GPTModel:
    """One model chunk of this rank: its pipeline stage's layers (of virtual stage ``vp_stage``)."""
    model, parallel, loss, dtype = workload.model, workload.parallel, workload.loss, torch_dtype(workload)
    rotary = None
    if backend == "te":
        spec = ModuleSpec(module=TransformerBlock, submodules=get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, vp_stage=vp_stage))
    else:
        rotary = RotaryTable()
        spec = _local_block_spec(config, backend, layers, rotary, vp_stage)
    extra = {"loss_tile_tokens": workload.loss_tile_tokens} if loss == "tiled" else {}
    gpt = (TiledLossGPTModel if loss == "tiled" else GPTModel)(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(model, parallel.tp),
        max_sequence_length=workload.seq,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        vp_stage=vp_stage,
        **extra,
    )
    layout = layers.sequence_layout
    if device_type == "cpu" or layout != "load_balanced":
        # Megatron's own takes the positions of its load-balanced chunks and its table to the GPU
        gpt.rotary_pos_emb = HostRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=model.rotary_base,
            rope_scaling=model.rope_scaling,
            rope_scaling_factor=model.rope_scaling_factor,
            use_cpu_initialization=device_type == "cpu",
        )
        gpt.rotary_pos_emb.sequence_layout = layout
    if device_type != "cpu":
        gpt.cuda(torch.cuda.current_device())
    if rotary is not None:
        # The table is made with the angles (the embedding's phase), before any layer uses it.
        gpt.rotary_pos_emb.register_forward_hook(lambda _module, _args, freqs: rotary.fill(freqs, dtype))
        rotate_within_documents(gpt)
    return gpt
