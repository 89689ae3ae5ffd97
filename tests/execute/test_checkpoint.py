"""Checkpoints: a run stopped after a save and resumed in a new process goes on bit for bit as
if it had never stopped, at another tensor-parallel size within rounding; a save killed midway
leaves the earlier checkpoint loadable; bad checkpoints and save directories are one line."""

import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess

import pytest
import torch
from megatron.core.dist_checkpointing import load_plain_tensors

from conftest import PYTHON, REPO, one_process, resolve_config, run_in_process
from memo.execute.checkpoint import checkpoints

# a schedule that warms up over the first step and decays over the other three, so that a resumed
# run must know where it is in it
FOUR = ["model=tiny", "model.vocab_size=1000", "seq=128", "train.warmup_steps=1", "train.lr_schedule=cosine",
        "train.lr_decay_steps=4", "train.lr_warmup_steps=1", "train.micro_batches=2", "train.save_interval=2"]


def _steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_py(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(REPO / "run.py"), *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights and Adam's moments), whole (read in a process group
    of this process alone, as megatron-core reads)."""
    with one_process():
        return {k: v for k, v in load_plain_tensors(str(checkpoint)).items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize("method", [["method=none"], ["method=memo", "alpha=0.5"]], ids=["none", "memo"])
def test_two_steps_a_save_and_two_more_in_a_new_process_equal_four(tmp_path, method):
    whole = run_in_process(tmp_path / "whole", *FOUR, *method, "train.steps=4")
    assert whole["status"] == "ok", whole["error"]
    if not torch.cuda.is_available():  # (a GPU's save is megatron-core's own)
        # written by this process: no writer processes, no manager process left to report to
        assert not multiprocessing.active_children()
    first = run_in_process(tmp_path / "first", *FOUR, *method, "train.steps=2")
    assert first["status"] == "ok" and first["resumed_from_step"] is None, first["error"]
    saved = tmp_path / "first" / "checkpoints" / "step_0000002"
    assert first["checkpoint_last"] == str(saved)
    done = _run_py(*FOUR, *method, "train.steps=4", f"train.load={saved}", f"hydra.run.dir={tmp_path / 'second'}",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads((tmp_path / "second" / "result.json").read_text())
    assert second["status"] == "ok" and second["resumed_from_step"] == 2
    expected, got = _steps(tmp_path / "whole"), _steps(tmp_path / "first") + _steps(tmp_path / "second")
    assert [s["step"] for s in got] == list(range(1, 5))
    for a, b in zip(got, expected, strict=True):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])
    reference = _weights(tmp_path / "whole" / "checkpoints" / "step_0000004")
    resumed = _weights(tmp_path / "second" / "checkpoints" / "step_0000004")
    # the weights and both of Adam's moments of every one
    assert reference.keys() == resumed.keys() and "embedding.word_embeddings.weight" in reference
    assert {"optimizer.state.exp_avg.embedding.word_embeddings.weight",
            "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"} <= reference.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


# (fp64, so that what is compared is the resharding, not the order of float32 sums)
AT_TP2 = [*FOUR, "train.dtype=fp64", "train.steps=4"]


@pytest.mark.slow
@pytest.mark.torchrun(2, " ".join(["training_worker.resume", "2", "parallel.tp=2", *AT_TP2]))
def test_two_steps_at_tp1_and_two_more_at_tp2_equal_four_at_tp1(tmp_path, torchrun_results):
    """The checkpoint is of the model's whole tensors: two processes splitting every layer over
    tensor parallelism load what one saved (in the session's two-process launch), and go on as
    the one would have."""
    (result,) = torchrun_results
    result.passed()
    whole = run_in_process(tmp_path / "whole", *AT_TP2)
    assert whole["status"] == "ok", whole["error"]
    second = result.out_dir / "second"
    row = json.loads((second / "result.json").read_text())
    assert row["status"] == "ok" and row["resumed_from_step"] == 2 and row["world_size"] == 2
    expected, got = _steps(tmp_path / "whole")[2:], _steps(second)
    assert [s["step"] for s in got] == list(range(3, 5))
    for a, b in zip(got, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["lr"] == b["lr"]
    reference, resumed = _weights(tmp_path / "whole" / "checkpoints" / "step_0000004"), \
        _weights(second / "checkpoints" / "step_0000004")
    assert reference.keys() == resumed.keys() and "embedding.word_embeddings.weight" in reference
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=1e-6, msg=key)


# run.py in a process that dies (SIGKILL) halfway through writing the checkpoint of step 4
_KILLED_DURING_SAVE = """
import os, runpy, signal, sys
from pathlib import Path
from megatron.core import dist_checkpointing

save = dist_checkpointing.save

def save_and_die_at_step_4(state, directory, **kwargs):
    save(state, directory, **kwargs)
    if state["step"] == 4:
        shard = sorted(Path(directory).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        os.kill(os.getpid(), signal.SIGKILL)

dist_checkpointing.save = save_and_die_at_step_4
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_process_killed_during_a_save_leaves_the_earlier_checkpoint_to_go_on_from(tmp_path):
    common = [*FOUR, "train.steps=4"]
    log = tmp_path / "killed.log"
    with open(log, "w") as output:
        # a session of its own: megatron-core's writer leaves a helper process behind, which a
        # scheduler's kill of the job takes with it, as the group's kill does here
        killed = subprocess.Popen([PYTHON, "-c", _KILLED_DURING_SAVE, *common, f"hydra.run.dir={tmp_path / 'killed'}"],
                                  cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert killed.wait(timeout=300) == -signal.SIGKILL, log.read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(killed.pid, signal.SIGKILL)
    save_dir = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in save_dir.iterdir()) == [".step_0000004.partial", "step_0000002"]
    assert [c.step for c in checkpoints(save_dir)] == [2]
    # a new run directory, saving where the killed run saved: it goes on from step 2
    again = run_in_process(tmp_path / "again", *common, f"train.save_dir={save_dir}")
    assert again["status"] == "ok" and again["resumed_from_step"] == 2, again["error"]
    assert [c.step for c in checkpoints(save_dir)] == [2, 4]
    assert not (save_dir / ".step_0000004.partial").exists()
    whole = run_in_process(tmp_path / "whole", *common, "train.save_interval=null")
    assert whole["status"] == "ok", whole["error"]
    assert [s["loss"] for s in _steps(tmp_path / "again")] == [s["loss"] for s in _steps(tmp_path / "whole")[2:]]


def test_a_run_started_afresh_into_a_save_directory_with_checkpoints_is_refused(tmp_path):
    (tmp_path / "saved" / "step_0000003").mkdir(parents=True)
    row = run_in_process(tmp_path / "run", *FOUR[:-1], "train.steps=2", "train.save_interval=1",
                         f"train.save_dir={tmp_path / 'saved'}", "train.load=null")
    assert row["status"] == "error"
    assert row["error"] == (f"train.save_dir={tmp_path / 'saved'} holds step_0000003, which this run does not load; "
                            "set train.load=auto to go on from it, or choose another train.save_dir")


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "step_0000001").mkdir(parents=True), r"step_0000001 is not a readable checkpoint \("),
    (lambda d: d.mkdir(), r"is neither a checkpoint \(step_<n>/\) nor a directory that holds one"),
])
def test_a_missing_or_damaged_checkpoint_is_one_line(tmp_path, make, message):
    make(tmp_path / "saved")
    row = run_in_process(tmp_path / "run", *FOUR[:-1], "train.steps=2", f"train.load={tmp_path / 'saved'}")
    assert row["status"] == "error" and "\n" not in row["error"]
    assert re.search(message, row["error"]), row["error"]


SHORT = ["model=tiny", "model.vocab_size=1000", "seq=64", "train.warmup_steps=0", "train.save_interval=2"]


def _cut_in_half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zeroed(path):  # as long as it was, its bytes gone: torch's reader fails (a CheckpointException on every rank)
    path.write_bytes(bytes(path.stat().st_size))


@pytest.mark.parametrize("damage, message", [
    (_cut_in_half, r"__0_0.distcp is \d+ bytes, and the checkpoint's index needs \d+: the checkpoint is incomplete"),
    (_zeroed, r"step_0000002 cannot be loaded into this model \(UnpicklingError: Weights only load failed\); it is "
              "damaged or of another model"),
], ids=["cut", "zeroed"])
def test_a_checkpoint_with_a_damaged_file_is_one_line_and_an_error_row(tmp_path, damage, message):
    first = run_in_process(tmp_path / "first", *SHORT, "train.steps=2")
    saved = tmp_path / "first" / "checkpoints" / "step_0000002"
    damage(saved / "__0_0.distcp")
    row = run_in_process(tmp_path / "again", *SHORT, "train.steps=3", f"train.load={saved}")
    assert first["status"] == "ok" and row["status"] == "error" and "\n" not in row["error"]
    assert re.search(message, row["error"]), row["error"]
    assert json.loads((tmp_path / "again" / "result.json").read_text())["status"] == "error"


def test_more_steps_at_a_constant_rate_go_on_but_a_decay_to_another_end_is_refused(tmp_path):
    first = run_in_process(tmp_path / "first", *SHORT, "train.steps=2", "train.lr_schedule=cosine")
    constant = run_in_process(tmp_path / "constant", *SHORT, "train.steps=2")
    assert first["status"] == constant["status"] == "ok"
    # raising train.steps moves a cosine's end (lr_decay_steps defaults to it): every rate would change
    moved = run_in_process(tmp_path / "moved", *SHORT, "train.steps=4", "train.lr_schedule=cosine",
                           f"train.load={tmp_path / 'first' / 'checkpoints'}")
    assert moved["status"] == "error" and moved["error"].endswith(
        "was trained with train.lr_decay_steps=2 (this run: 4); set it so, the rate of every step follows from "
        "the schedule")
    kept = run_in_process(tmp_path / "kept", *SHORT, "train.steps=4", "train.lr_schedule=cosine",
                          "train.lr_decay_steps=2", f"train.load={tmp_path / 'first' / 'checkpoints'}")
    longer = run_in_process(tmp_path / "longer", *SHORT, "train.steps=4",
                            f"train.load={tmp_path / 'constant' / 'checkpoints'}")
    assert (kept["status"], kept["resumed_from_step"]) == (longer["status"], longer["resumed_from_step"]) == ("ok", 2)


def test_a_run_that_has_all_its_steps_says_so(tmp_path):
    saved = tmp_path / "saved"
    first = run_in_process(tmp_path / "first", *SHORT, "train.steps=2", f"train.save_dir={saved}")
    again = run_in_process(tmp_path / "again", *SHORT, "train.steps=2", f"train.save_dir={saved}")
    assert first["status"] == "ok" and again["status"] == "error"
    assert again["error"] == (f"{saved / 'step_0000002'} has all train.steps=2 steps: this run trained to its end and "
                              "stopped before writing its row; its weights are there to load or export")


def test_auto_does_not_go_on_from_another_runs_checkpoints(tmp_path):
    saved = tmp_path / "saved"
    first = run_in_process(tmp_path / "first", *SHORT, "train.steps=2", f"train.save_dir={saved}")
    assert first["status"] == "ok"
    other = run_in_process(tmp_path / "other", *SHORT[:2], "seq=128", *SHORT[3:], "train.steps=4",
                           f"train.save_dir={saved}")
    assert other["status"] == "error" and other["error"] == (
        f"{saved / 'step_0000002'} is of a run with seq=64 (this run: 128); choose another train.save_dir, or name "
        "the checkpoint in train.load to go on from it")
    assert other["params"] is None  # refused before the model was built (minutes for a large one)
    # named, the same checkpoint starts a run at the longer length (a context extension)
    named = run_in_process(tmp_path / "named", *SHORT[:2], "seq=128", *SHORT[3:], "train.steps=4",
                           f"train.load={saved / 'step_0000002'}", "train.save_interval=null")
    assert named["status"] == "ok" and named["resumed_from_step"] == 2
    wider = run_in_process(tmp_path / "wider", *SHORT, "model.ffn_hidden_size=512", "train.steps=4",
                           f"train.load={saved}", "train.save_interval=null")
    assert wider["status"] == "error" and wider["error"].startswith(
        f"{saved / 'step_0000002'} is of another model (model.ffn_hidden_size=1024); load a checkpoint")


def test_a_checkpoint_whose_optimizer_groups_name_their_optimizer_classes_loads(tmp_path):
    # Megatron's HybridDeviceOptimizer (train.optimizer_offload=host, GPU only) keeps its inner
    # optimizers' classes among its param groups' settings, so its checkpoints' common state
    # pickles them; torch.load, weights only, refuses such a file unless they are allowed.
    from megatron.core.optimizer import Adam, CPUAdam

    first = run_in_process(tmp_path / "first", *SHORT, "train.steps=2")
    common_file = tmp_path / "first" / "checkpoints" / "step_0000002" / "common.pt"
    common = torch.load(common_file, weights_only=False)
    for group in common["optimizer"]["param_groups"]:
        group.update(cpu_optimizer_cls=CPUAdam, gpu_optimizer_cls=Adam)
    torch.save(common, common_file)
    resumed = run_in_process(tmp_path / "resumed", *SHORT, "train.steps=3",
                             f"train.load={tmp_path / 'first' / 'checkpoints'}")
    assert first["status"] == "ok"
    assert (resumed["status"], resumed["error"], resumed["resumed_from_step"]) == ("ok", None, 2)


def _adam_places(cuda, optimizer) -> list[tuple]:
    """Where each Adam that steps keeps each state of each parameter: (key, on the device, dtype),
    and whether each state's step is a tensor of its own."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from memo.execute.optimizer_offload import optimizer_parts

    places, steps = [], []
    for part in optimizer_parts(optimizer.optimizer):
        inner = part.optimizer
        for adam in inner.sub_optimizers if isinstance(inner, HybridDeviceOptimizer) else [inner]:
            for group in adam.param_groups:
                for param in group["params"]:
                    state = adam.state[param]
                    places.append(tuple((key, cuda.on_device(value), value.dtype) for key, value in sorted(state.items())
                                        if key != "master_param"))
                    steps.append(state["step"].untyped_storage().data_ptr())
    return [*places, ("steps of their own", len(set(steps)) == len(steps))]


@pytest.mark.parametrize("offload, fraction", [("none", 1.0), ("host", 1.0), ("host", 0.5)],
                         ids=["distributed", "host", "host-half"])
def test_megatrons_distributed_optimizer_resumes_bit_for_bit_without_transformer_engine(tmp_path, single_process,
                                                                                         monkeypatch, offload, fraction):
    # megatron-core 0.16 without Transformer Engine cannot describe its distributed optimizer's
    # state before the first step, cannot load the step it saved (KeyError), gives every parameter
    # one step tensor that each step advances once per parameter, and moves the device Adam's
    # state of an offloaded optimizer to the host; run here by Megatron's own code, CUDA stood in for
    from cuda_standin import cuda_stand_in

    from memo.execute import checkpoint
    from memo.execute.optimizer import MegatronStepOptimizer
    from memo.policy import build_model

    run = resolve_config("model=tiny", "model.vocab_size=64", "seq=16", "train.dtype=bf16")
    train = dataclasses.replace(run.train, optimizer_offload=offload, optimizer_offload_fraction=fraction)

    def model():  # built before CUDA is stood in for (cuda_standin)
        torch.manual_seed(0)
        return build_model(run.workload, "cpu").module

    def steps(optimizer, numbers) -> list[float]:
        losses = []
        for number in numbers:
            tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(number)).cuda()
            optimizer.zero_grad()
            loss = optimizer.chunks[0](tokens, torch.arange(16)[None].cuda(), None, labels=tokens).float().mean()
            optimizer.scale_loss(loss).backward()
            optimizer.step(1e-2)
            losses.append(loss.item())
        return losses

    facts = checkpoint.RunFacts(model_config={}, dtype="bf16", optimizer="megatron_distributed", schedule={}, data={})
    modules = [model() for _ in range(3)]
    with cuda_stand_in() as cuda:
        whole = steps(MegatronStepOptimizer([modules[0].cuda()], train, sharded=True), range(6))
        saving = MegatronStepOptimizer([modules[1].cuda()], train, sharded=True)
        first = steps(saving, range(3))
        with monkeypatch.context() as gpu:  # the GPU's save: its tensors staged to the host first
            gpu.setattr(torch.cuda, "is_available", lambda: True)
            saved = checkpoint.save(tmp_path, 3, 3, [modules[1]], saving, facts)
        loading = MegatronStepOptimizer([modules[2].cuda()], train, sharded=True)
        resumed = checkpoint.load(saved, checkpoint.saved_facts(saved.path), [modules[2]], loading)
        assert _adam_places(cuda, loading) == _adam_places(cuda, saving)
        rest = steps(loading, range(3, 6))
    assert resumed.step == 3
    assert first + rest == whole
