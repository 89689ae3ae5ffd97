"""Hand-written result rows and step logs, laid out as a Hydra sweep leaves them.

Numbers are chosen so that tables can be checked by hand: MFU 0.1 per K of sequence length and
so on. Used by the analysis tests (the notebook tests run real smoke sweeps instead).
"""

import json
from pathlib import Path

RUN = {
    "experiment": None, "mode": "train", "hardware.name": "cpu", "hardware.peak_flops": 1.2e11,
    "hardware.peak_flops_source": "measured",
    "model.name": "tiny", "model.num_layers": 4, "model.hidden_size": 256,
    "method.name": "none", "alpha": "auto", "swap.alpha": None, "seq": 1024,
    "parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1, "parallel.dp": 1, "world_size": 1,
    "train.steps": 4, "train.warmup_steps": 1, "status": "ok", "error": None,
    "mfu": 0.5, "tgs": 800.0, "iter_time_s": 1.25, "loss_first": 10.9, "loss_last": 10.3,
    "peak_rss_bytes": 2**30, "start_time": "2026-11-21T20:00:00+00:00",
    "end_time": "2026-11-21T20:01:00+00:00",
}
FAILED = {"mfu": None, "tgs": None, "iter_time_s": None, "loss_first": None, "loss_last": None}


def write_run(sweep: Path, name: str, steps: int = 0, **fields) -> Path:
    """A run directory ``sweep/name`` with its ``result.json`` (:data:`RUN` updated with
    ``fields``; a failed status nulls the metrics) and ``steps`` lines of ``metrics.jsonl``."""
    row = dict(RUN, **fields)
    if row["status"] != "ok":
        row = {**row, **FAILED, **fields}
    run_dir = Path(sweep) / name
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(row, indent=1))
    if steps:
        lines = [json.dumps(step_record(step, row)) for step in range(1, steps + 1)]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def step_record(step: int, row: dict) -> dict:
    """Step ``step`` (1-based) of a run: loss falls by 0.1 a step from ``loss_first``; the first
    ``train.warmup_steps`` steps are untimed and take twice the iteration time."""
    warm = step <= row["train.warmup_steps"]
    return {
        "step": step, "loss": row["loss_first"] - 0.1 * (step - 1), "lr": 0.001,
        "grad_norm": 1.0, "iter_time_s": row["iter_time_s"] * (2 if warm else 1), "timed": not warm,
        "tgs": row["tgs"], "mfu": row["mfu"], "peak_rss_bytes": row["peak_rss_bytes"],
    }


def write_sweep(root: Path) -> Path:
    """A small sweep of every experiment in its CPU smoke version; returns its directory."""
    sweep = Path(root) / "multirun"
    for seq in (1024, 2048, 4096):
        k = seq // 1024
        write_run(sweep, f"e2e_none_{k}k", experiment="end_to_end_cpu_smoke", seq=seq,
                  mfu=0.1 * k, tgs=1000.0 / k, iter_time_s=1.0 * k)
        write_run(sweep, f"e2e_memo_{k}k", experiment="end_to_end_cpu_smoke", seq=seq,
                  **{"method.name": "memo", "swap.alpha": 0.5}, mfu=0.1 * k + 0.05,
                  tgs=1100.0 / k, iter_time_s=0.9 * k)
    write_run(sweep, "e2e_none_8k", experiment="end_to_end_cpu_smoke", seq=8192, status="oom")
    for method, plan in (("full_recompute", False), ("full_recompute", True),
                         ("full_swap", True), ("memo", True)):
        for seq, fraction in ((1024, 1.0), (2048, 1.5)):
            write_run(sweep, f"abl_{method}_{plan}_{seq}", steps=4, experiment="ablation_cpu_smoke",
                      seq=seq, plan=plan, **{"method.name": method},
                      mfu=0.3 * fraction + 0.1 * plan, iter_time_s=fraction)
    for alpha in ("0", "0.5", "1"):
        for seq in (1024, 2048):
            time = seq / 1024 * (1.0 + abs(float(alpha) - 0.5))
            write_run(sweep, f"alpha_{alpha}_{seq}", experiment="alpha_sweep_cpu_smoke", seq=seq,
                      alpha=alpha, **{"method.name": "memo", "swap.alpha": float(alpha)},
                      iter_time_s=time, mfu=0.5 / time * seq / 1024)
    for name, method, alpha in (("memo_0", "memo", "0"), ("memo_1", "memo", "1"),
                                ("megatron", "megatron_full_recompute", "auto")):
        # validated over four spans of positions: later tokens predicted better, α 1 best
        validation = [6.0 - b - float(alpha == "1") for b in range(4)] if method == "memo" else None
        write_run(sweep, f"conv_{name}", steps=6, experiment="convergence_cpu_smoke",
                  alpha=alpha, **{"method.name": method}, valid_loss_by_position=validation,
                  valid_loss=None if validation is None else sum(validation) / 4)
    return sweep
