"""Device memory of one training step, from the allocation trace of a real CPU run.

For each length, depth and method it builds the model as a job does, runs one step unrecorded
(timed, as the next), then records the next step's forward and backward pass with the allocation
recorder (real CPU tensors, every storage a request) and prints, at the instant of most bytes in use:

* skeletal bytes held on the device: requests kept for a layer's backward, plus MEMO's rounding
  (or tile) buffers (allocated before the recorded step, so not requests), against two layers'
  worth;
* peak live bytes: all requests then alive, plus the rounding buffers, and for tiles the
  whole-sequence stores (keys, values, their gradients, the input store), made in the first step;
* the step's time (forward and backward, unrecorded) over ``none``'s.

The methods are ``none``, ``megatron_full_recompute``, ``full_recompute``, ``memo`` (whole layers,
``--alpha``) and ``memo`` walking its layers in tiles of ``--tile`` tokens (``memo tiles``, swapped
with α per tile and the checkpoint interval solved on this machine, printed after the row). Weights, gradients (Megatron keeps them in one buffer made before training) and
optimizer states are the same for every method and are not counted. A benchmark, not a test: it
takes minutes at the paper's depth.

    python benchmarks/activation_memory.py --layers 4 --seq 8k,16k,32k --tile 1k
    python benchmarks/activation_memory.py --layers 4 --seq 32k --methods "memo tiles"  # and the two references
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo.config import parse_seq, register_configs, resolve  # noqa: E402
from memo.execute import distributed  # noqa: E402
from memo.data.batches import SyntheticTokens, micro_batches  # noqa: E402
from memo.execute.distributed import ProcessInfo  # noqa: E402
from memo.fit.memory import split_peak  # noqa: E402
from memo.model import build_gpt  # noqa: E402
from memo.policy import policy_of  # noqa: E402
from memo.profile.recorder import record  # noqa: E402
from memo.profile.trace import Trace  # noqa: E402

METHODS = {  # the rows: name -> overrides
    "none": ["method=none"],
    "megatron_full_recompute": ["method=megatron_full_recompute"],
    "full_recompute": ["method=full_recompute"],
    "memo": ["method=memo"],
    "memo tiles": ["method=memo"],
}


def recorded_step(overrides: list[str]) -> dict:
    """Bytes at the peak of one recorded step of the job ``overrides`` describe (see above)."""
    run = resolve(compose(config_name="config", overrides=["hardware=cpu", "train.dtype=fp32", *overrides]),
                  gpu_visible=False)
    workload = run.workload
    policy = policy_of(workload)
    torch.manual_seed(run.train.seed)
    model = build_gpt(workload, "cpu", layers=policy.layers).module
    placement = policy.prepare(model, workload, torch.device("cpu"), 2**50)
    report = placement.report()
    decided = report.row
    seq = workload.seq
    batches = micro_batches(SyntheticTokens(workload.model.vocab_size, 0), seq, 1, 1, 0, 1,
                            torch.device("cpu"))

    def step(marker=None):
        (batch,) = next(batches)
        batch = placement.token_order(batch)
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        if marker is not None:
            marker.backward()
        loss.backward()

    step()  # the first: allocations and kernels chosen
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    recorder = record(model, step)
    # Gradients live in a buffer made before training on a GPU (Megatron's DDP), as the fit
    # counts them: they are left out here, like weights.
    gradients = {recorder.request_of(p.grad) for p in model.parameters() if p.grad is not None}
    peak, phase, kinds = split_peak(Trace([e for e in recorder.events if e.id not in gradients]))
    # the runtime's buffers (whole layers': the rounding buffers; tiles': the tile buffers) and a
    # walk's stores are made before the recorded step
    buffers = decided.get("swap.rounding_buffer_bytes") or decided.get("tiles.tile_buffer_bytes") or 0
    placement.release()
    return {
        "skeletal": kinds["skeletal"] + buffers,
        "two_layers": 2 * sum(report.skeletal_bytes) if "swap.rounding_buffer_bytes" in decided else None,
        "peak": peak + buffers + (decided.get("tiles.store_bytes") or 0),
        "phase": phase,
        "seconds": seconds,
        "tiles": report if "tiles.tiles" in decided else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,32", help="comma-separated depths (default 4,8,32)")
    parser.add_argument("--seq", default="8k", help="comma-separated lengths in tokens (default 8k)")
    parser.add_argument("--tile", default="1k", help="tokens per tile of the 'memo tiles' row (default 1k)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--alpha", type=float, default=0.5, help="memo's swapped fraction (default 0.5)")
    parser.add_argument("--loss", default="tiled", choices=("tiled", "megatron"), help="for every method")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated rows (default all; megatron_full_recompute and none are always run)")
    args = parser.parse_args()
    lengths = [parse_seq(n) for n in args.seq.split(",")]
    tile = parse_seq(args.tile, "--tile")
    chosen = {"none", "megatron_full_recompute", *args.methods.split(",")}
    if chosen - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(chosen - set(METHODS)))}; choose from {', '.join(METHODS)}")

    register_configs()
    mib = 2**20
    print(f"{args.model}, fp32, train.loss={args.loss}, memo alpha={args.alpha}, memo tiles of {tile} tokens; MiB")
    print(f"{'seq':>7} {'layers':>6} {'method':<24} {'skeletal held':>14} {'2 layers':>9} {'peak live':>10} "
          f"{'vs megatron':>11} {'time vs none':>12}  peak in", flush=True)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        distributed.initialize(compose(config_name="config").parallel, "cpu", ProcessInfo(0, 1, 0))
        try:
            for seq in lengths:
                for layers in (int(n) for n in args.layers.split(",")):
                    results = {}
                    for name, method in METHODS.items():
                        if name not in chosen:
                            continue
                        extra = {"memo": [f"alpha={args.alpha}"], "memo tiles": [f"method.tile_tokens={tile}"]}
                        overrides = [f"model={args.model}", f"model.num_layers={layers}", *method,
                                     f"train.loss={args.loss}", f"seq={seq}", *extra.get(name, [])]
                        results[name] = recorded_step(overrides)
                    reference, none = results["megatron_full_recompute"]["peak"], results["none"]["seconds"]
                    for name, r in results.items():
                        two = f"{r['two_layers'] / mib:9.1f}" if r["two_layers"] else f"{'-':>9}"
                        print(f"{seq:>7} {layers:>6} {name:<24} {r['skeletal'] / mib:14.1f} {two} "
                              f"{r['peak'] / mib:10.1f} {r['peak'] / reference:11.3f} "
                              f"{r['seconds'] / none:12.2f}  {r['phase']}", flush=True)
                        if r["tiles"] is not None:
                            t = r["tiles"]
                            alphas = ", ".join(f"{tile['alpha']:.2f}" for tile in t.layer_records)
                            print(f"{'':>15} alpha per tile {alphas}; a checkpoint layer every "
                                  f"{t.row['tiles.checkpoint_every']}", flush=True)
        finally:
            distributed.shutdown()


if __name__ == "__main__":
    main()
