"""Fetch into ``.whl/`` the wheels a lent GPU machine lacks (Python 3.12, x86-64 Linux), at the
versions this project is tested with, and check that they fit what one command may carry.

    make gpu-wheels          # = python -m memo.gpucheck.wheels --dest .whl

The machine has PyTorch, NumPy, pandas, matplotlib, tabulate, cloudpickle and packaging; it lacks
megatron-core, Hydra, OmegaConf (and its parser runtime, published as a source archive only, so
built here as a pure-Python wheel), submitit, the Hydra submitit launcher, HiGHS and safetensors
(``model.init_from``). Gurobi stays
behind (it needs a licence); the planner then uses HiGHS.
"""

import argparse
import subprocess
import sys
from pathlib import Path

BINARY = ["megatron-core==0.16.1", "hydra-core==1.3.2", "omegaconf==2.3.0", "submitit==1.5.4",
          "hydra-submitit-launcher==1.2.0", "highspy==1.16.0", "safetensors==0.8.0"]
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]  # pure Python: its wheel runs on any platform
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]
LIMIT_BYTES = 64 * 2**20  # what one command on the lent machine carries, the repository included


def fetch(dest: Path) -> int:
    """Download (or build) every wheel into ``dest``; their total size in bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
                    *BINARY], check=True)
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(dest), *SOURCE_ONLY], check=True)
    return sum(p.stat().st_size for p in dest.glob("*.whl"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args(argv)
    try:
        total = fetch(args.dest)
    except subprocess.CalledProcessError as error:
        print(f"error: {' '.join(error.cmd[:4])} … failed (exit {error.returncode}); is PyPI reachable?",
              file=sys.stderr)
        return 2
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {args.dest} "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB with the repository)")
    if total > LIMIT_BYTES:
        print("error: the wheels alone exceed what one command may carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
