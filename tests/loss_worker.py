"""Under torchrun (2 processes): the tiled loss against Megatron's, on the whole GPT, with tensor
parallelism with and without sequence parallelism. Exits non-zero at the first difference."""

import sys

import torch

from memo.execute import distributed
from memo.execute.data import SyntheticTokens, micro_batches
from memo.model import build_gpt

from conftest import compose_config, resolve_config

LAYOUTS = [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]]
TILES = [None, 24, 256]  # the default (64 tokens here), uneven tiles, one tile per rank


def gradients(overrides: list[str], loss: str, tile, seq: int = 256) -> tuple[torch.Tensor, dict]:
    """Per-token losses and every parameter's gradient after one backward pass (fp32)."""
    tiles = [] if tile is None else [f"train.loss_tile_tokens={tile}"]
    run = resolve_config(*overrides, f"seq={seq}", f"train.loss={loss}", *tiles)
    torch.manual_seed(run.train.seed)
    model = build_gpt(run.workload, "cpu").module
    (batch,) = next(micro_batches(SyntheticTokens(run.workload.model.vocab_size, 0), seq, 2, 1, 0, 1,
                                  torch.device("cpu")))
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    per_token.mean().backward()
    return per_token.detach(), {n: p.grad for n, p in model.named_parameters()}


def main() -> int:
    info = distributed.process_info()
    checked = 0
    # one set of process groups: sequence parallelism changes the model, not the groups
    distributed.initialize(compose_config(*LAYOUTS[0]).parallel, "cpu", info)
    for overrides in LAYOUTS:
        expected_loss, expected = gradients(overrides, "megatron", None)
        for tile in TILES:
            loss, got = gradients(overrides, "tiled", tile)
            try:
                torch.testing.assert_close(loss, expected_loss)
                for name in expected:
                    torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")
            except AssertionError as error:
                print(f"rank {info.rank}: {' '.join(overrides)} tile={tile}: {error}")
                return 1
            checked += 1
    distributed.shutdown()
    print(f"rank {info.rank}: {checked} tiled losses match Megatron's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
