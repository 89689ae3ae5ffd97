"""The paper's experiments as sweeps: what each one runs, and the job arrays a cluster receives."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import PYTHON, REPO

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def dry_run(tmp_path: Path, *overrides: str, launcher: str = "slurm", env=None) -> str:
    """What ``run.py -m`` prints for ``overrides`` through ``launcher`` without submitting."""
    done = subprocess.run(
        [PYTHON, str(REPO / "run.py"), "-m", f"hydra/launcher={launcher}", "hydra.launcher.dry_run=true",
         f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "sweep").exists(), "a dry run leaves nothing behind"
    return done.stdout


def arrays(output: str) -> list[dict]:
    """The printed arrays: their heading, #SBATCH options and jobs (overrides, problem)."""
    found = []
    for block in output.split("\narray of ")[1:]:
        lines = block.splitlines()
        options = dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", block, re.M))
        jobs = [re.match(r"  #(\d+): (.*?)(?:  <- (.*))?$", line).groups() for line in lines
                if line.startswith("  #")]
        found.append({"heading": lines[0], "options": options, "jobs": jobs})
    return found


def test_every_experiment_has_a_cpu_smoke_version_and_a_documented_command():
    readme = (REPO / "experiments" / "README.md").read_text()
    # fit, anchors and frontier predict without running, on any machine: they need no CPU version.
    predicted = ("fit", "anchors", "frontier")
    paper = [name for name in EXPERIMENTS if not name.endswith("_cpu_smoke") and name not in predicted]
    assert sorted(paper) == ["ablation", "alpha_sweep", "convergence", "end_to_end", "scalability"]
    assert all(f"+experiment={name}" in readme for name in predicted)
    for name in paper:
        assert f"{name}_cpu_smoke" in EXPERIMENTS
        assert f"+experiment={name}" in readme and f"+experiment={name}_cpu_smoke" in readme


@pytest.mark.slow
def test_end_to_end_sends_each_workload_as_one_array_sized_by_its_layout(tmp_path):
    # the experiment's 16 lengths, 4k to 1408k; the dry run composes two of them (the command line
    # wins), since Hydra composes every job of a sweep alone (0.25 s each: the 352 jobs took 100 s)
    params = OmegaConf.load(REPO / "conf" / "experiment" / "end_to_end.yaml").hydra.sweeper.params
    lengths = params.seq.split(",")
    assert len(lengths) == 16 and lengths[0] == "4k" and lengths[-1] == "1408k"
    found = arrays(dry_run(tmp_path, "+experiment=end_to_end", "seq=4k,1408k"))
    by_nodes = {int(a["options"]["nodes"]): a for a in found}
    assert sorted(by_nodes) == [1, 2, 4, 8]
    big = by_nodes[8]
    assert big["heading"].startswith("12 job(s): 8 node(s) x 8 task(s) = 64 process(es), 64 GPU(s)")
    assert big["options"]["ntasks-per-node"] == "8" and big["options"]["gpus-per-node"] == "8"
    assert big["options"]["array"] == "0-11%12"  # at most array_parallelism (64) of its tasks at once
    # memo with its own loss; each Megatron baseline with Megatron's loss and with memo's;
    # DeepSpeed-Ulysses with its all-to-all where the heads divide over tp·cp (7B and 65B)
    variants = set()
    for _, overrides, _ in big["jobs"]:
        loss = re.search(r"train.loss=(\w+)", overrides)
        variants.add((re.search(r"method=(\w+)", overrides).group(1), loss.group(1) if loss else "auto"))
    baselines = ("megatron_full_recompute", "megatron_selective")
    assert variants == {("memo", "auto"), ("deepspeed_ulysses", "auto"),
                        *((m, loss) for m in baselines for loss in ("megatron", "tiled"))}
    assert all("parallel.cp_comm_type=a2a" in o for _, o, _ in big["jobs"] if "deepspeed" in o)
    assert all("+workload=65b_64gpus" in overrides for _, overrides, _ in big["jobs"])
    assert {re.search(r"seq=(\w+)", o).group(1) for _, o, _ in big["jobs"]} == {"4k", "1408k"}
    # six variants at 7B and 65B, five at 13B and 30B (no Ulysses), each at both lengths
    assert [len(by_nodes[n]["jobs"]) for n in (1, 2, 4, 8)] == [12, 10, 10, 12]
    for array in found:  # MEMO's at every layout, context parallelism included
        assert all(problem is None for _, _, problem in array["jobs"]), "every job passes the checks"


@pytest.mark.slow
def test_convergence_is_a_union_of_grids_and_the_command_line_wins(tmp_path):
    found = arrays(dry_run(tmp_path, "+experiment=convergence", "seq=4k", "train.steps=3"))
    (array,) = found
    jobs = [overrides for _, overrides, _ in array["jobs"]]
    memo = sorted(re.search(r"alpha=(\S+)", o).group(1) for o in jobs if "method=memo" in o)
    assert memo == ["0", "0.125", "0.25", "0.5", "1"]
    megatron = [o for o in jobs if "method=megatron_full_recompute" in o]
    assert len(megatron) == 2 and not any("alpha=" in o for o in megatron), "Megatron runs without α"
    assert sum("train.loss=tiled" in o for o in megatron) == 1  # and once with memo's loss
    assert all("seq=4k" in o for o in jobs) and not any("seq=128k" in o for o in jobs)


@pytest.mark.slow
def test_cpu_smoke_experiments_are_valid_cpu_jobs(tmp_path):
    smoke = [name for name in EXPERIMENTS if name.endswith("_cpu_smoke")]
    for name in smoke:
        found = arrays(dry_run(tmp_path, f"+experiment={name}", launcher="slurm_local"))
        jobs = [job for array in found for job in array["jobs"]]
        assert jobs and all(problem is None for _, _, problem in jobs), name
        for array in found:
            assert "gpus-per-node" not in array["options"] and array["options"]["partition"] == "debug"
        tasks = sorted(int(a["options"]["ntasks-per-node"]) for a in found)
        assert tasks == ([1, 2] if name == "scalability_cpu_smoke" else [1]), name


def test_a_dry_run_marks_a_job_that_will_fail_its_checks(tmp_path):
    found = arrays(dry_run(tmp_path, "model=tiny", "parallel.tp=2", "seq=1001",
                           "parallel.sequence_parallel=true,false"))
    problems = {re.search(r"sequence_parallel=(\w+)", o).group(1).lower(): problem
                for array in found for _, o, problem in array["jobs"]}
    assert problems["true"].startswith("seq=1001 is not divisible by tp = 2")
    assert problems["false"] is None


def test_a_dry_run_needs_no_slurm_command(tmp_path):
    # a PATH with nothing of SLURM's (nor anything else): the arrays printed are those printed
    # where SLURM is installed
    bare = tmp_path / "bare"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    # one length: a job per workload, each its own array (the experiment's every length is
    # composed by test_cpu_smoke_experiments_are_valid_cpu_jobs and the end_to_end test)
    without = dry_run(tmp_path, "+experiment=scalability", "seq=512k", env=env)
    usual = dry_run(tmp_path, "+experiment=scalability", "seq=512k")  # a dry run leaves nothing behind
    assert arrays(without) == arrays(usual) and len(arrays(without)) > 1
    assert all("time" in a["options"] and "nodes" in a["options"] for a in arrays(without))


def test_anchors_predict_every_peer_setting_with_each_method(tmp_path):
    (found,) = arrays(dry_run(tmp_path, "+experiment=anchors"))
    jobs = [dict(re.findall(r"([\w.+]+)=(\S+)", overrides)) for _, overrides, _ in found["jobs"]]
    settings = {(j["anchor"], j["model"], j["hardware"], int(j["cluster.gpus"])) for j in jobs}
    assert settings == {("alst_8xh100", "llama3_8b", "h100", 8), ("alst_1xh100", "llama3_8b", "h100", 1),
                        ("alst_1xh200", "llama3_8b", "h200", 1), ("fpdt_4gpus", "llama3_8b", "a100", 4),
                        ("oomb_1xh200", "qwen2.5_7b", "h200", 1)}
    variants = {(j["anchor"], j["method"], j.get("train.loss", "auto")) for j in jobs}
    for anchor, *_ in settings:
        assert {(anchor, "memo", "auto"), (anchor, "megatron_full_recompute", "auto")} <= variants
        # Ulysses and Megatron's baseline with the tiled loss where there are GPUs to split over
        multi = anchor in ("alst_8xh100", "fpdt_4gpus")
        assert ((anchor, "deepspeed_ulysses", "tiled") in variants) == multi
        assert ((anchor, "megatron_full_recompute", "tiled") in variants) == multi
    assert len(jobs) == 14
    for name in {j["anchor"] for j in jobs}:  # each cites its figure
        anchor = OmegaConf.load(REPO / "conf" / "anchor" / f"{name}.yaml")
        assert anchor.peer and anchor.peer_tokens >= 500_000 and anchor.source
