"""A method as the code takes it: ``conf/method``'s settings and the run's α, each parsed once.

:class:`memo.config.MethodConfig` is what Hydra composes, strings as a user writes them;
:func:`method_of` checks it and parses it, once, into a :class:`Method`, which the resolved
:class:`memo.config.Workload` holds. What a method *does* (its layers, their preparation, its
prediction) is its activation policy's (:mod:`memo.policy`), the one reader of these fields
besides the checks here.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from memo.config.values import ConfigError, choice, parse_alpha, parse_seq

WHOLE_LAYERS = "whole"  # method.tile_tokens=whole: each layer runs on all its tokens at once
AUTO = "auto"  # method.tile_tokens and train.optimizer_offload: the run chooses (memo.fit.choice)
LAYER_ACTIVATIONS = ("megatron", "swap", "recompute", "keep")
KEEP_ALL = ("auto", "never")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
LOSSES = ("tiled", "megatron")
CP_ATTENTIONS = ("memo", "deepspeed")
# Megatron-core's offload_modules that act on the dense Transformer Engine layers the method runs on.
OFFLOAD_MODULES = ("qkv_linear", "core_attn", "attn_proj")
# Megatron's other names, and why they do nothing on these models.
_OFFLOAD_MODULES_WITHOUT_EFFECT = {
    "attn_norm": "Megatron skips it on Transformer Engine's layers, whose input norm is fused into the "
                 "QKV projection (qkv_linear offloads both)",
    "mlp_norm": "Megatron skips it on Transformer Engine's dense layers, whose pre-MLP norm is fused "
                "into FC1",
    "expert_fc1": "it offloads mixture-of-experts layers, which these dense models do not have",
    "moe_act": "it offloads mixture-of-experts layers, which these dense models do not have",
}


@dataclass(frozen=True)
class Method:
    """How a run keeps its activations, every setting typed (see the module docstring); the
    fields mean what :class:`memo.config.MethodConfig`'s of the same names mean."""

    name: str
    layer_activations: str = "megatron"  # "megatron", "swap", "recompute" or "keep"
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple[str, ...]] = None
    offload_modules: Optional[tuple[str, ...]] = None
    cp_attention: str = "memo"
    # layers that swap: the fraction of tokens swapped, fixed (the method's own, else the run's
    # ``alpha``); None where MEMO solves it, and for every method that does not swap
    alpha: Optional[float] = None

    @property
    def ours(self) -> bool:
        """Runs memo's own transformer layer (the others are Megatron's, with its recomputation)."""
        return self.layer_activations != "megatron"

    @property
    def swaps(self) -> bool:
        """Sends what its layers save to the host and brings it back (memo, full_swap)."""
        return self.layer_activations == "swap"

    @property
    def offloads(self) -> bool:
        """Runs Megatron-core's fine-grained activation offloading (``offload_modules``)."""
        return self.offload_modules is not None

    def keeping_all(self) -> "Method":
        """This method's layers keeping every activation instead (what ``method.keep_all=auto``
        may choose): memo's own layer, nothing swapped or recomputed."""
        return dataclasses.replace(self, layer_activations="keep", alpha=None)

    @property
    def walks_tiles(self) -> bool:
        """Can walk its layers in sequence tiles: memo, full_swap and full_recompute."""
        return self.layer_activations in ("swap", "recompute")


def parse_layer_tiles(value: object, key: str = "method.tile_tokens") -> Optional[int]:
    """Tokens per tile of a layer walk, of ``value`` as ``key`` takes it: ``whole`` (None) or a
    length as :func:`parse_seq` reads it.

    Raises:
        ConfigError: naming ``key``, if ``value`` is neither.
    """
    text = str(value).strip()
    return None if text == WHOLE_LAYERS else parse_seq(text, key)


def method_of(config, alpha_setting: object) -> tuple[Method, Optional[int], bool]:
    """Check ``config`` (a composed :class:`memo.config.MethodConfig`) and the run's ``alpha``
    setting against each other and parse them into a :class:`Method`, the tokens of the layers'
    tiles (``method.tile_tokens``; None: whole layers, or not chosen yet) and whether the run
    chooses them (``auto``, for a method that walks tiles; for any other it means whole layers).

    Raises:
        ConfigError: on the first problem found, in one line naming the key.
    """
    choice("method.layer_activations", config.layer_activations, LAYER_ACTIVATIONS)
    choice("method.loss", config.loss, LOSSES)
    choice("method.recompute_granularity", config.recompute_granularity, RECOMPUTE_GRANULARITIES)
    choice("method.cp_attention", config.cp_attention, CP_ATTENTIONS)
    lists = {key: None if getattr(config, key) is None else tuple(getattr(config, key))
             for key in ("recompute_modules", "offload_modules")}
    method = Method(
        name=config.name,
        layer_activations=config.layer_activations,
        recompute_granularity=config.recompute_granularity,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        cp_attention=config.cp_attention,
        **lists,
    )
    _check_combination(method)
    choice("method.keep_all", config.keep_all, KEEP_ALL)
    if config.keep_all == AUTO and method.layer_activations not in ("swap", "keep"):  # (keep: as a row records the choice)
        raise ConfigError(f"method.keep_all=auto chooses between keeping every activation and memo's swapping, "
                          f"and method={method.name} does not swap; set method.keep_all=never")
    if str(config.tile_tokens).strip() == AUTO:
        return dataclasses.replace(method, alpha=_alpha(method, config.alpha, alpha_setting)), None, method.walks_tiles
    tiles = parse_layer_tiles(config.tile_tokens)
    if tiles is not None and not method.walks_tiles:
        raise ConfigError(f"method.tile_tokens={config.tile_tokens} walks the layers of method=memo, full_swap "
                          f"or full_recompute, not method={method.name}; choose one of them or use "
                          f"method.tile_tokens={WHOLE_LAYERS}")
    return dataclasses.replace(method, alpha=_alpha(method, config.alpha, alpha_setting)), tiles, False


def training_loss(config, train_loss: str) -> str:
    """The loss a run of the method ``config`` uses: ``train_loss`` (``train.loss``), or the
    method's own where that is auto."""
    return config.loss if train_loss == "auto" else train_loss


def _alpha(method: Method, fixed: Optional[float], setting: object) -> Optional[float]:
    """The α of a method that swaps: its own ``fixed`` one (full_swap's), else the run's
    ``setting``; None where it is solved, and for a method that does not swap."""
    given = parse_alpha(setting)
    if method.swaps and fixed is not None:
        own = parse_alpha(fixed, "method.alpha")
        if given is not None:
            raise ConfigError(
                f"alpha={setting} has no effect with method={method.name}, which swaps "
                f"alpha={fixed:g} of the tokens; drop alpha or use method=memo"
            )
        return own
    if not method.swaps and given is not None:
        raise ConfigError(f"alpha={setting} applies to method=memo only; drop it or use method=memo")
    return given


def _check_offload_modules(method: Method) -> None:
    modules = list(method.offload_modules)
    allowed = ", ".join(OFFLOAD_MODULES)
    if not modules:
        raise ConfigError(f"method.offload_modules=[] offloads nothing; list some of: {allowed} "
                          "(or use method=none)")
    for name in modules:
        if name in _OFFLOAD_MODULES_WITHOUT_EFFECT:
            raise ConfigError(f"method.offload_modules: {name} has no effect here: "
                              f"{_OFFLOAD_MODULES_WITHOUT_EFFECT[name]}; choose from: {allowed}")
        if name not in OFFLOAD_MODULES:
            raise ConfigError(f"method.offload_modules: {name} is not a module Megatron offloads; "
                              f"choose from: {allowed}")
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ConfigError("method.offload_modules: attn_proj's input is core_attn's output, which "
                          "core_attn's backward needs on the device; add core_attn")
    if method.ours:
        raise ConfigError(f"method.offload_modules is Megatron's offloading, on Megatron's layers, and "
                          f"cannot be combined with method.layer_activations={method.layer_activations}; "
                          "set one of them")
    if method.recompute_granularity == "full":
        raise ConfigError("method.offload_modules with method.recompute_granularity=full: a layer recomputed "
                          "whole saves nothing inside its modules to offload; recompute selectively "
                          "(method.recompute_modules) or drop one of them")
    # (selective without modules recomputes core attention: Megatron's default)
    if method.recompute_granularity == "selective" and "core_attn" in (method.recompute_modules or ("core_attn",)) \
            and "core_attn" in method.offload_modules:
        raise ConfigError("method.offload_modules offloads core_attn, whose recomputation "
                          "(method.recompute_modules) saves nothing there to offload; drop it from one of them")
    if method.cp_attention != "memo":
        raise ConfigError(f"method.offload_modules runs on Transformer Engine's attention, not "
                          f"method.cp_attention={method.cp_attention}; set method.cp_attention=memo")


def _check_combination(method: Method) -> None:
    """Refuse settings of ``method`` that exclude each other."""
    if method.offloads:
        _check_offload_modules(method)
    if method.ours and method.recompute_granularity is not None:
        raise ConfigError(
            f"method.recompute_granularity={method.recompute_granularity} is Megatron's "
            f"recomputation and cannot be combined with method.layer_activations="
            f"{method.layer_activations}; set one of them"
        )
    if method.recompute_granularity == "full":
        choice("method.recompute_method", method.recompute_method, RECOMPUTE_METHODS)
        if method.recompute_num_layers is None or method.recompute_num_layers < 1:
            raise ConfigError(
                f"method.recompute_num_layers={method.recompute_num_layers} must be at least 1 "
                "with method.recompute_granularity=full"
            )
    if method.cp_attention == "deepspeed" and method.ours:
        raise ConfigError(f"method.cp_attention=deepspeed runs on Megatron's layers, not "
                          f"method.layer_activations={method.layer_activations}; "
                          "set method.layer_activations=megatron")
