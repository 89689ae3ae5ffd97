"""The run configuration resolved once: checked, with every ``auto`` and every text figure turned
into the value the code below uses, as typed dataclasses.

A mode calls :func:`resolve` once and passes its :class:`Run` (or only the :class:`Workload`)
on; nothing below reads the composed DictConfig again. Figures that only the machine knows (a
detected GPU's memory, a CPU's measured peak FLOP/s) are left to :mod:`memo.hardware`, which
takes :attr:`Run.hardware` as checked here.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from memo.config.method import AUTO, Method, training_loss
from memo.config.schema import (
    ClusterConfig,
    FitConfig,
    HardwareConfig,
    ModelConfig,
    ParallelConfig,
    PlannerConfig,
    TrainConfig,
)
from memo.config.validate import ConfigError, SeqSearch, validate

# Bytes per element of each ``train.dtype`` a workload can have.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


@dataclass(frozen=True)
class Workload:
    """One iteration's work, as built, traced, trained or predicted: the model, how it keeps its
    activations, its parallel layout, and the tokens of one micro-batch. Every field is a parsed
    value: nothing here is text to read again."""

    model: ModelConfig
    method: Method  # its activation policy's settings (memo.policy reads them)
    parallel: ParallelConfig
    seq: int  # tokens per sequence, all ranks together
    micro_batch_size: int = 1  # sequences per micro-batch
    dtype: str = "fp32"  # "fp32", "bf16", "fp16" or "fp64" (never "auto")
    loss: str = "megatron"  # the output layer and loss the run uses: "tiled" or "megatron"
    loss_tile_tokens: Optional[int] = None  # the tiled loss's tokens per tile; None: its default
    # the layers walked in tiles of this many tokens (method.tile_tokens, gathered over sequence
    # parallelism); None: whole layers
    layer_tile_tokens: Optional[int] = None
    document_mask: bool = False  # attention within each packed document (train.document_mask)
    # the tokens of each document a prediction assumes (fit.document_tokens); None: the sequence
    document_tokens: Optional[int] = None

    @property
    def attended_tokens(self) -> int:
        """The keys a query's causal attention spans, on average twice over: ``Σ n² / s`` for
        documents of ``n`` tokens filling the sequence (``n``), else the sequence (``s``)."""
        return self.seq if self.document_tokens is None else min(self.document_tokens, self.seq)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the workload's dtype."""
        return DTYPE_BYTES[self.dtype]

    def at(self, parallel: ParallelConfig, seq: int) -> "Workload":
        """The same work under another layout and length (``seq`` tokens)."""
        return dataclasses.replace(self, parallel=parallel, seq=seq)

    def in_layer_tiles(self, tile_tokens: Optional[int]) -> "Workload":
        """The same work with its layers walked in tiles of ``tile_tokens`` (None: whole layers)."""
        return dataclasses.replace(self, layer_tile_tokens=tile_tokens)

    def keeping_all(self) -> "Workload":
        """The same work with whole layers keeping every activation (:meth:`Method.keeping_all`)."""
        return dataclasses.replace(self, method=self.method.keeping_all(), layer_tile_tokens=None)


@dataclass(frozen=True)
class Choices:
    """The settings a run leaves to its own plan (``auto``), which :mod:`memo.fit.choice` makes
    before the model is built; explicit settings are kept as written."""

    layer_tiles: bool = False  # method.tile_tokens=auto, for a method that walks tiles
    # train.optimizer_offload=auto where Adam can go to the host (a GPU, 16-bit weights, the
    # distributed optimizer allowed); elsewhere auto is "none"
    optimizer_offload: bool = False
    loss_tile: bool = False  # train.loss_tile_tokens unset, under the tiled loss
    check: bool = False  # train.fit_check: the run's own settings are checked against the fit
    layout: bool = False  # parallel=auto in a training run: its layout among its processes'
    # method.keep_all=auto in a training run on a GPU, α left to solve: keeping every activation
    # where it fits, before memo's swapping
    keep_all: bool = False

    @property
    def any(self) -> bool:
        """Whether the fit is asked: the loss's tile is chosen with the layers' tiles only."""
        return self.layer_tiles or self.optimizer_offload or self.check or self.layout or self.keep_all


@dataclass(frozen=True)
class Run:
    """A composed :class:`memo.config.RunConfig`, resolved (see :func:`resolve`)."""

    mode: str  # train, profile, plan or fit
    workload: Workload  # with seq=max: at ``seq_search.limit`` tokens
    device_type: str  # "cuda" or "cpu": where the run trains, or the device it is traced or predicted for
    plan: bool
    hardware: HardwareConfig
    cluster: ClusterConfig
    train: TrainConfig
    profile_backend: str  # "fake", "cpu" or "cuda" (``auto`` is fake)
    planner: PlannerConfig
    fit: FitConfig
    seq_search: Optional[SeqSearch] = None  # mode=fit seq=max only
    # mode=fit parallel=search: the layers' tiles tried (fit.tile_tokens, parsed; None: whole layers)
    fit_layer_tiles: tuple[Optional[int], ...] = ()
    choices: Choices = Choices()


def resolve(cfg, gpu_visible: bool) -> Run:
    """Check ``cfg`` (a composed :class:`memo.config.RunConfig`, every range and name as
    :func:`memo.config.validate` does) and resolve it into a :class:`Run`.

    Args:
        gpu_visible: whether this process sees a GPU (``torch.cuda.is_available()``): it picks
            the device of ``hardware=auto`` and with it the dtype of ``train.dtype=auto``.

    Raises:
        ConfigError: on the first problem found, in one line naming the key.
    """
    settings = validate(cfg)
    backend = "fake" if cfg.profile.backend == "auto" else cfg.profile.backend
    device_type = _device_type(cfg, backend, gpu_visible)
    if cfg.mode == "train":
        if device_type == "cuda" and not gpu_visible:
            raise ConfigError(f"hardware={cfg.hardware.name} trains on a GPU and none is visible here; "
                              "use hardware=auto or hardware=cpu")
        if device_type == "cpu" and cfg.train.dtype == "fp16":
            raise ConfigError("train.dtype=fp16 needs a GPU (loss scaling); use fp32 or bf16 on the CPU")
        if device_type == "cuda" and cfg.train.dtype == "fp64":
            raise ConfigError("train.dtype=fp64 is for numerical checks on the CPU; use bf16 or fp32 on a GPU")
    seq = settings.seq if settings.seq is not None else settings.seq_search.limit
    dtype = cfg.train.dtype if cfg.train.dtype != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    if cfg.mode == "train":
        check_optimizer_offload(cfg.train.optimizer_offload, device_type, dtype)
    train = OmegaConf.to_object(cfg.train)
    offload_choice = train.optimizer_offload == AUTO
    if offload_choice and not can_offload_optimizer(device_type, dtype, train.distributed_optimizer):
        train, offload_choice = dataclasses.replace(train, optimizer_offload="none"), False
    loss = training_loss(cfg.method, cfg.train.loss)
    choices = Choices(layer_tiles=settings.chooses_layer_tiles, optimizer_offload=offload_choice,
                      loss_tile=loss == "tiled" and train.loss_tile_tokens is None, check=train.fit_check,
                      layout=cfg.parallel.search and cfg.mode == "train",
                      keep_all=(cfg.method.keep_all == AUTO and settings.method.alpha is None and cfg.mode == "train"
                                and device_type == "cuda"))
    workload = Workload(
        model=OmegaConf.to_object(cfg.model),
        method=settings.method,
        parallel=OmegaConf.to_object(cfg.parallel),
        seq=seq,
        micro_batch_size=cfg.train.micro_batch_size,
        dtype=dtype,
        loss=loss,
        loss_tile_tokens=cfg.train.loss_tile_tokens,
        layer_tile_tokens=settings.layer_tile_tokens,
        document_mask=cfg.train.document_mask,
        document_tokens=settings.document_tokens,
    )
    return Run(
        mode=cfg.mode,
        workload=workload,
        device_type=device_type,
        plan=cfg.plan,
        hardware=OmegaConf.to_object(cfg.hardware),
        cluster=OmegaConf.to_object(cfg.cluster),
        train=train,
        profile_backend=backend,
        planner=OmegaConf.to_object(cfg.planner),
        fit=OmegaConf.to_object(cfg.fit),
        seq_search=settings.seq_search,
        fit_layer_tiles=settings.fit_layer_tiles,
        choices=choices,
    )


def _device_type(cfg, backend: str, gpu_visible: bool) -> str:
    if cfg.mode in ("profile", "plan"):
        return "cpu" if backend == "cpu" else "cuda"
    if cfg.hardware.name == "auto":
        return "cuda" if gpu_visible else "cpu"
    return "cpu" if cfg.hardware.name == "cpu" else "cuda"


def check_optimizer_offload(offload: str, device_type: str, dtype: str) -> None:
    """Refuse ``train.optimizer_offload=host`` where it cannot train: a run on the CPU (whose Adam
    states are on the host already, and which has no device memory to free) and fp32 weights
    (Megatron-core 0.16's HybridDeviceOptimizer cannot take the distributed optimizer's shards of
    fp32 parameters, which are views still attached to autograd). ``dtype`` is a resolved
    ``train.dtype`` ("fp32", "bf16", "fp16" or "fp64").

    Raises:
        ConfigError: in one line, saying what to set instead.
    """
    if offload != "host":
        return
    if device_type != "cuda":
        raise ConfigError("train.optimizer_offload=host moves Adam's states off a GPU and this run trains on "
                          "the CPU, where they are in host memory already; set train.optimizer_offload=none")
    if dtype not in ("bf16", "fp16"):
        raise ConfigError(f"train.optimizer_offload=host needs 16-bit weights (Megatron's offloaded "
                          f"optimizer cannot take the shards of {dtype} parameters); set train.dtype=bf16 "
                          "or train.optimizer_offload=none")


def can_offload_optimizer(device_type: str, dtype: str, distributed_optimizer: Optional[bool]) -> bool:
    """Whether Adam's states can live on the host (``train.optimizer_offload=host``): on a GPU, with
    16-bit weights, inside the distributed optimizer (which ``train.distributed_optimizer=false``
    forbids); see :func:`check_optimizer_offload`."""
    return device_type == "cuda" and dtype in ("bf16", "fp16") and distributed_optimizer is not False


def shards_optimizer(setting: Optional[bool], parallel: ParallelConfig) -> bool:
    """Whether the optimizer's states are sharded under ``parallel``: ``train.distributed_optimizer``
    where set, else wherever there is more than one data- or context-parallel rank to shard over."""
    return setting if setting is not None else parallel.dp * parallel.cp > 1
