"""Under torchrun (2 processes): the tiled loss against Megatron's, on the whole GPT, with tensor
parallelism with and without sequence parallelism. :func:`check` is a check of
``tests/checks_worker.py`` (``... tests/checks_worker.py OUT "loss_worker.check VOCAB"`` runs it
alone); it raises at the first difference."""


import torch

from memo.execute import distributed
from memo.data.batches import SyntheticTokens, micro_batches
from memo.policy import build_model

from conftest import compose_config, resolve_config

LAYOUTS = [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]]
TILES = [None, 24, 256]  # the default (64 tokens here), uneven tiles, one tile per rank


def gradients(overrides: list[str], loss: str, tile, seq: int = 256) -> tuple[torch.Tensor, dict]:
    """Per-token losses and every parameter's gradient after one backward pass (fp32)."""
    tiles = [] if tile is None else [f"train.loss_tile_tokens={tile}"]
    run = resolve_config(*overrides, f"seq={seq}", f"train.loss={loss}", *tiles)
    torch.manual_seed(run.train.seed)
    model = build_model(run.workload, "cpu").module
    (batch,) = next(micro_batches(SyntheticTokens(run.workload.model.vocab_size, 0), seq, 2, 1, 0, 1,
                                  torch.device("cpu")))
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    per_token.mean().backward()
    return per_token.detach(), {n: p.grad for n, p in model.named_parameters()}


def check(info: distributed.ProcessInfo, out=None, vocab: str = "50257") -> str:
    """Every tile's losses and gradients equal Megatron's, with a vocabulary of ``vocab`` tokens
    (padded as Megatron pads it); raises at the first difference. A check of
    ``tests/checks_worker.py``."""
    checked = 0
    # one set of process groups: sequence parallelism changes the model, not the groups
    distributed.initialize(compose_config(*LAYOUTS[0]).parallel, "cpu", info)
    try:
        for overrides in LAYOUTS:
            overrides = [*overrides, f"model.vocab_size={vocab}"]
            expected_loss, expected = gradients(overrides, "megatron", None)
            for tile in TILES:
                loss, got = gradients(overrides, "tiled", tile)
                where = f"rank {info.rank}: {' '.join(overrides)} tile={tile}"
                torch.testing.assert_close(loss, expected_loss, msg=lambda m: f"{where}: loss: {m}")
                for name in expected:
                    torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{where}: {n}: {m}")
                checked += 1
    finally:
        distributed.shutdown()
    return f"{checked} tiled losses match Megatron's"

