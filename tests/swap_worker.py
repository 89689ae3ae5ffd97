"""Under torchrun: gradients of MEMO's methods against keeping everything, with tensor and
sequence parallelism. Exits non-zero (with the first difference) if any step differs."""

import sys

import torch

from memo.execute import distributed

from conftest import compose_config
from swap_training import train_gradients

PARALLEL = ["parallel.tp=2", "parallel.sequence_parallel=true", "model.num_layers=6"]
VARIANTS = [("memo", 0.0), ("memo", 0.125), ("memo", 0.5), ("memo", 1.0), ("full_swap", None),
            ("full_recompute", None)]
LOSSES = ["train.loss=tiled", "train.loss=megatron"]


def main() -> int:
    info = distributed.process_info()
    distributed.initialize(compose_config(*PARALLEL).parallel, "cpu", info)
    for loss in LOSSES:
        _, reference, _ = train_gradients("none", *PARALLEL, loss)
        for method, alpha in VARIANTS:
            _, grads, _ = train_gradients(method, *PARALLEL, loss, alpha=alpha)
            for step, (got, expected) in enumerate(zip(grads, reference, strict=True)):
                for name in expected:
                    try:
                        torch.testing.assert_close(got[name], expected[name])
                    except AssertionError as error:
                        print(f"rank {info.rank}: {method} alpha={alpha} {loss} step {step + 1} {name}: "
                              f"{error}")
                        return 1
    print(f"rank {info.rank}: {len(VARIANTS)} methods match over 3 steps with both losses")
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
