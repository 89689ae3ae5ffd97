"""Tiny Llama and Qwen2 models made with Hugging Face ``transformers`` (random weights), and our
model's logits, loss and gradients next to theirs: used in-process and under torchrun.

The configs are the published ones (Llama-3.1-8B's and Qwen2.5-7B's config.json) with only the
sizes changed to those of ``conf/model/tiny_llama.yaml`` and ``tiny_qwen.yaml``.
"""

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo.model import hf_checkpoint
from memo.policy import build_model

from conftest import resolve_config

SEQ = 64  # tokens; the RoPE scaling changes the angles of every position, so any length shows it

LLAMA_3_1_8B = dict(  # meta-llama/Llama-3.1-8B, config.json
    hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
QWEN_2_5_7B = dict(  # Qwen/Qwen2.5-7B, config.json
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0,
    max_position_embeddings=131072, use_sliding_window=False,
)
QWEN_3_4B = dict(  # Qwen/Qwen3-4B-Base, config.json (tied; 32 heads of 128 over a hidden size of 2560)
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, attention_bias=False,
    max_position_embeddings=32768, use_sliding_window=False,
)
SIZES = {  # conf/model/tiny_llama.yaml, tiny_qwen.yaml
    "tiny_llama": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=8192),
    "tiny_qwen": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096),
}


def make_checkpoint(model: str, directory: Path, seed: int = 0):
    """A ``transformers`` model of ``model``'s shape with random weights, saved to ``directory``
    with ``save_pretrained`` (safetensors); returns the model (float32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    if model == "tiny_llama":
        config = transformers.LlamaConfig(**LLAMA_3_1_8B, **SIZES[model])
        hf = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**QWEN_2_5_7B, **SIZES[model])
        hf = transformers.Qwen2ForCausalLM(config)
    return _saved(hf, directory)


# Shapes no conf/model/ file has, as a user's checkpoint would come: read by model=hf alone
NEW_SHAPES = {
    # tied, one key/value head per query head, no RoPE scaling, a vocabulary Megatron would pad
    "llama_tied_plain": ("llama", dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       rope_theta=10000.0, num_hidden_layers=2, hidden_size=192,
                                       intermediate_size=512, num_attention_heads=6, num_key_value_heads=6,
                                       vocab_size=1000)),
    # Llama-3.1's scaling at factor 32, 10 heads of 32 over 2 groups
    "llama_scaled_grouped": ("llama", dict(LLAMA_3_1_8B, num_hidden_layers=2, hidden_size=320,
                                           intermediate_size=640, num_attention_heads=10, num_key_value_heads=2,
                                           vocab_size=2048, rope_scaling={**LLAMA_3_1_8B["rope_scaling"],
                                                                          "factor": 32.0})),
    # tied, 8 query heads over 4 groups
    "qwen2_tied_groups": ("qwen2", dict(QWEN_2_5_7B, tie_word_embeddings=True, num_hidden_layers=2,
                                        hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                        num_key_value_heads=4, vocab_size=1536)),
    # Qwen3-4B's kind at CPU size: query and key norms, heads of 48 that make 384 where hidden is 256
    "qwen3_wide_heads": ("qwen3", dict(QWEN_3_4B, num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=48,
                                       vocab_size=1024)),
}


def make_new_checkpoint(name: str, directory: Path, seed: int = 0):
    """A ``transformers`` model of :data:`NEW_SHAPES`' ``name`` with random weights, saved to
    ``directory``; returns it (float32, eval mode)."""
    import transformers

    kind, config = NEW_SHAPES[name]
    torch.manual_seed(seed)
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    hf = classes[1](classes[0](**config))
    return _saved(hf, directory)


def _saved(hf, directory: Path):
    with torch.no_grad():  # transformers initializes biases and norms to constants: make them differ
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(directory, safe_serialization=True)
    return hf.float().eval()


def tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, SEQ + 1), generator=generator)


def hf_figures(hf, ids: torch.Tensor) -> dict:
    """logits ``[s, V]``, mean loss and gradients (transformers' names) of ``hf`` on ``ids``."""
    hf.zero_grad()
    out = hf(input_ids=ids[:, :-1])
    logits = out.logits[0]
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in hf.named_parameters()}}


def our_figures(model: str, directory: Path, ids: torch.Tensor, *overrides: str) -> dict:
    """The same figures of our model of ``model`` started from ``directory`` (Megatron's parallel
    state initialized to match ``overrides``); logits and gradients whole on every rank."""
    run = resolve_config(f"model={model}", f"model.init_from={directory}", f"seq={SEQ}", *overrides)
    gpt = build_model(run.workload, "cpu").module
    hf_checkpoint.load([gpt], run.workload.model, directory)
    positions = torch.arange(SEQ).unsqueeze(0)
    logits = gpt(ids[:, :-1], positions, None)  # [b, s, V/tp]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        whole = torch.cat(parts, dim=-1)
    else:
        whole = logits
    per_token = gpt(ids[:, :-1], positions, None, labels=ids[:, 1:])  # [b, s]
    loss = per_token.float().mean()
    loss.backward()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for p in gpt.parameters():  # the norms' partial sums over this rank's tokens (sequence parallel)
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    return {"logits": whole[0].detach(), "loss": loss.detach(),
            "grads": hf_checkpoint.gather([gpt], run.workload.model, grads=True)}


def compare(ours: dict, theirs: dict) -> int:
    """Assert logits, loss and every gradient equal (float32 tolerances); returns tensors compared."""
    torch.testing.assert_close(ours["logits"], theirs["logits"])
    torch.testing.assert_close(ours["loss"], theirs["loss"])
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, grad in theirs["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, msg=lambda m, n=name: f"{n}: {m}")
    return 2 + len(theirs["grads"])


@contextmanager
def shared_checkpoint(info, out, model: str, overrides: tuple[str, ...]):
    """Under torchrun: Megatron's parallel state for ``overrides``, a checkpoint of ``model`` that
    rank 0 makes under ``out``, and ``transformers``' model of it on every rank:
    ``(directory, hf)``."""
    import transformers

    from memo.execute import distributed

    from conftest import compose_config

    directory = Path(out) / "checkpoint"
    distributed.initialize(compose_config(*overrides).parallel, "cpu", info)
    try:
        if info.rank == 0:
            make_checkpoint(model, directory)
        dist.barrier()
        yield directory, transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    finally:
        distributed.shutdown()


def check_tensor_parallel(info, out, model: str) -> str:
    """Under torchrun, two ranks: our ``model`` at tp=2 with sequence parallelism, started from a
    checkpoint that rank 0 makes, equals ``transformers``' on every rank."""
    overrides = ("parallel.tp=2", "parallel.sequence_parallel=true")
    with shared_checkpoint(info, out, model, overrides) as (directory, hf):
        ids = tokens(hf.config.vocab_size)
        compared = compare(our_figures(model, directory, ids, *overrides), hf_figures(hf, ids))
    return f"{model}: logits, loss and {compared - 2} gradients equal transformers' at tp=2 with SP"


def check_context_parallel(info, out, model: str, comm: str) -> str:
    """Under torchrun, two ranks: our ``model`` at cp=2 exchanging keys and values by ``comm``
    (grouped: fewer key/value heads than query heads), each rank its two load-balanced chunks of
    the sequence: loss and gradients equal ``transformers``' on the whole sequence."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    overrides = ("parallel.cp=2", f"parallel.cp_comm_type={comm}")
    with shared_checkpoint(info, out, model, overrides) as (directory, hf):
        ids = tokens(hf.config.vocab_size)
        theirs = hf_figures(hf, ids)
        run = resolve_config(f"model={model}", f"model.init_from={directory}", f"seq={SEQ}", *overrides)
        gpt = build_model(run.workload, "cpu").module
        hf_checkpoint.load([gpt], run.workload.model, directory)
        batch = get_batch_on_this_cp_rank({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                                           "position_ids": torch.arange(SEQ).unsqueeze(0)})
        per_token = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = per_token.float().sum() / SEQ  # this rank's share of the sequence's mean
        loss.backward()
        group = parallel_state.get_context_parallel_group()
        dist.all_reduce(loss.detach(), group=group)
        for p in gpt.parameters():  # each rank's tokens' part of every gradient
            dist.all_reduce(p.grad, group=group)
        torch.testing.assert_close(loss.detach(), theirs["loss"])
        grads = hf_checkpoint.gather([gpt], run.workload.model, grads=True)
        for name, grad in theirs["grads"].items():
            torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
    return f"{model}: loss and {len(grads)} gradients equal transformers' at cp=2 ({comm})"
