"""Under torchrun: gradients of MEMO's methods against keeping everything, with tensor and
sequence parallelism or context parallelism (the layout is the argument: ``tp2-sp``, ``cp2``,
``cp2-p2p``, ``cp2-a2a`` or ``tp2-sp-cp2``). Exits non-zero (with the first difference) if any
step differs."""

import sys

import torch

from memo.execute import distributed

from conftest import compose_config
from swap_training import train_gradients

# layout -> (its overrides, the losses it is checked with)
LAYOUTS = {
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], ["tiled", "megatron"]),
    "cp2": (["parallel.cp=2"], ["tiled"]),
    "cp2-p2p": (["parallel.cp=2", "parallel.cp_comm_type=p2p"], ["megatron"]),
    "cp2-a2a": (["parallel.cp=2", "parallel.cp_comm_type=a2a"], ["tiled"]),
    "tp2-sp-cp2": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"], ["megatron"]),
}
VARIANTS = [("memo", 0.0), ("memo", 0.125), ("memo", 0.5), ("memo", 1.0), ("full_swap", None),
            ("full_recompute", None)]
# under context parallelism: nothing swapped or recomputed, both, and the two whole methods
CP_VARIANTS = [("memo", 0.0), ("memo", 0.5), ("full_swap", None), ("full_recompute", None)]


def main() -> int:
    layout = sys.argv[1]
    overrides, losses = LAYOUTS[layout]
    variants = CP_VARIANTS if "cp" in layout else VARIANTS
    parallel = [*overrides, "model.num_layers=6"]
    info = distributed.process_info()
    distributed.initialize(compose_config(*parallel).parallel, "cpu", info)
    for loss in (f"train.loss={name}" for name in losses):
        _, reference, _ = train_gradients("none", *parallel, loss)
        for method, alpha in variants:
            _, grads, _ = train_gradients(method, *parallel, loss, alpha=alpha)
            for step, (got, expected) in enumerate(zip(grads, reference, strict=True)):
                for name in expected:
                    try:
                        torch.testing.assert_close(got[name], expected[name])
                    except AssertionError as error:
                        print(f"rank {info.rank}: {method} alpha={alpha} {loss} step {step + 1} {name}: "
                              f"{error}")
                        return 1
    print(f"rank {info.rank}: {len(variants)} methods match over 3 steps with {' and '.join(losses)} "
          f"({layout})")
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
