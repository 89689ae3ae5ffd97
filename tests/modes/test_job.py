"""Every job leaves a row: out-of-memory and failures are results, and the next job still runs."""

import gc
import json
import os
import sys
import weakref

import pytest
import torch

import memo.modes.train
from memo.config import ConfigError

from conftest import run_in_process

SHORT = ["train.steps=2", "train.warmup_steps=1", "seq=128", "model.vocab_size=1000"]


def _raise(error):
    def run_steps(*_args, **_kwargs):
        raise error

    return run_steps


def test_out_of_memory_is_a_result_and_the_next_job_runs(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(memo.modes.train, "run_steps", _raise(torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 64.00 GiB\nmore detail")))
        row = run_in_process(tmp_path / "oom", *SHORT)
    assert row["status"] == "oom"
    assert row["error"] == "CUDA out of memory. Tried to allocate 64.00 GiB"
    written = json.loads((tmp_path / "oom" / "result.json").read_text())
    assert written["status"] == "oom" and written["peak_rss_bytes"] > 0 and written["mfu"] is None
    assert run_in_process(tmp_path / "next", *SHORT)["status"] == "ok"


@pytest.mark.parametrize("message", [
    "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory",
    # a CUDA runtime error (torch.AcceleratorError, a RuntimeError), as a kernel raises it when the
    # plan's allocator had no memory for one of its tensors
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
])
def test_allocator_failures_are_out_of_memory(tmp_path, monkeypatch, message):
    monkeypatch.setattr(memo.modes.train, "run_steps", _raise(RuntimeError(message)))
    assert run_in_process(tmp_path, *SHORT)["status"] == "oom"


def test_a_crash_is_an_error_row_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setattr(memo.modes.train, "run_steps", _raise(ValueError("bad shape")))
    row = run_in_process(tmp_path, *SHORT)
    assert (row["status"], row["error"]) == ("error", "ValueError: bad shape")
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "ValueError: bad shape"


def test_configuration_errors_leave_an_error_row(tmp_path):
    row = run_in_process(tmp_path, "parallel.tp=3")
    assert row["status"] == "error" and row["error"].startswith("parallel.tp=3 does not divide")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hardware=a800"], "hardware=a800 trains on a GPU and none is visible here"),
        (["parallel.pp=2"], "= 2 but 1 process(es) were launched"),
        (["train.dtype=fp16"], "train.dtype=fp16 needs a GPU"),
        (["train.attention_backend=te"], "train.attention_backend=te needs Transformer Engine"),
        (["method=memo", "train.attention_backend=te"], "method=memo runs on Megatron's local layers"),
    ],
)
def test_what_this_machine_cannot_run_is_refused_up_front(tmp_path, overrides, message):
    row = run_in_process(tmp_path, *SHORT, *overrides)
    assert row["status"] == "error" and message in row["error"], row["error"]
    assert row["iter_time_s"] is None


def test_the_deepspeed_baseline_without_deepspeed_is_refused_in_one_line(tmp_path, monkeypatch):
    for module in ("deepspeed", "deepspeed.sequence", "deepspeed.sequence.layer"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it raises ImportError
    row = run_in_process(tmp_path, *SHORT, "method=deepspeed_ulysses")
    assert row["status"] == "error" and "\n" not in row["error"]
    assert row["error"].startswith("method=deepspeed_ulysses needs DeepSpeed, which is not installed: "
                                   "pip install -e '.[deepspeed]'")


def test_results_of_an_earlier_run_are_never_overwritten(tmp_path):
    assert run_in_process(tmp_path, *SHORT)["status"] == "ok"
    before = (tmp_path / "result.json").read_bytes()
    with pytest.raises(ConfigError, match="holds another run"):
        run_in_process(tmp_path, *SHORT)
    assert (tmp_path / "result.json").read_bytes() == before


def _alive() -> tuple[int, int]:
    """This process's threads (gloo's among them, three per process group) and GPT models."""
    from megatron.core.models.gpt import GPTModel

    gc.collect()
    return len(os.listdir("/proc/self/task")), sum(isinstance(o, GPTModel) for o in gc.get_objects())


def test_a_job_leaves_nothing_alive_for_the_next_job_of_its_sweep(tmp_path):
    """A sweep runs its jobs one after another in one process: a job's model, optimizer and
    process groups go with it, though its recorded step's finalizers and its rotary angles
    outlive the recording (each job kept 17 process groups, 51 threads, before)."""
    assert run_in_process(tmp_path / "first", *SHORT, "method=memo")["status"] == "ok"
    threads, models = _alive()
    assert run_in_process(tmp_path / "second", *SHORT, "method=memo")["status"] == "ok"
    threads_after, models_after = _alive()
    assert threads_after <= threads and models_after <= models


def test_a_job_leaves_megatrons_rotary_module_to_go(single_process):
    """A GPU job's model takes its angles from Megatron's RoPE, whose cache is the class's: the
    next model's build empties it (it held the modules of its last 32 calls)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from memo.model.host import forget_rotary_angles, run_megatron_on_host

    run_megatron_on_host()  # (its angles on the host, as a CPU job's)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rope(16)
    module, rope = weakref.ref(rope), None
    gc.collect()
    assert module() is not None  # kept by the class's cache
    forget_rotary_angles()
    gc.collect()
    assert module() is None


def test_our_rotary_module_keeps_the_angles_of_the_calls_megatrons_keeps(single_process):
    """Per model what Megatron's RoPE keeps per class, call for call: a tiled walk's discovery
    passes the length alone and the model passes its flags too, two tensors on a GPU and so two
    in a trace."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from memo.model.host import HostRotaryEmbedding, forget_rotary_angles, run_megatron_on_host

    run_megatron_on_host()
    calls = [((16,), {}), ((16,), {}), ((16,), {"packed_seq": False, "cp_group": None}), ((32,), {}),
             ((16,), {"packed_seq": False, "cp_group": None})]

    def first_made(rope) -> list[int]:  # for each call, the first call that gave the same tensor
        made = [rope(*args, **kwargs) for args, kwargs in calls]
        return [next(i for i, earlier in enumerate(made) if earlier is angles) for angles in made]

    try:
        assert first_made(HostRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)) \
            == first_made(RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)) \
            == [0, 0, 2, 3, 2]
    finally:
        forget_rotary_angles()


def test_training_on_a_text_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    row = run_in_process(tmp_path / "run", *SHORT, f"train.data={corpus}")
    assert row["status"] == "ok" and row["train.data"] == str(corpus)


def test_a_failed_swap_job_releases_its_slab(tmp_path, monkeypatch):
    from memo.swap import SwapRuntime

    released = []
    original = SwapRuntime.release
    monkeypatch.setattr(SwapRuntime, "release", lambda self: released.append(self.slab) or original(self))
    monkeypatch.setattr(memo.modes.train, "run_steps", _raise(ValueError("bad shape")))
    row = run_in_process(tmp_path, *SHORT, "method=memo")
    assert row["status"] == "error"
    assert released and released[-1] is not None  # the job's slab, given back in spite of the error


def test_plan_true_installs_its_allocator_before_anything_reads_the_gpu(tmp_path, monkeypatch):
    # hardware=auto on a GPU machine: reading the GPU's name initialises CUDA, after which the
    # plan's allocator can no longer be installed
    from memo import hardware
    from memo.plan import cuda_arena

    order = []

    class _Stop(Exception):
        pass

    def install(phase, device):
        order.append("install")
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_arena, "install", install)
    monkeypatch.setattr(hardware, "detect", lambda: order.append("detect"))
    row = run_in_process(tmp_path, *SHORT, "plan=true")
    assert order == ["install"] and "_Stop" in row["error"]



@pytest.mark.parametrize("damage, message", [
    (lambda d: d["tokenizer"].write_bytes(d["tokenizer"].read_bytes()[:200]),
     r"train.tokenizer: .*tokenizer.json: not a tokenizer file of the tokenizers library \(EOF while parsing"),
    (lambda d: d["prefix"].with_suffix(".idx").write_bytes(d["prefix"].with_suffix(".idx").read_bytes()[:40]),
     r"train.data: .*corpus.idx is 40 bytes, and its header needs \d+: it is cut short"),
], ids=["tokenizer", "index"])
def test_damaged_data_is_one_line_and_an_error_row_before_the_model_is_built(tmp_path, monkeypatch, damage,
                                                                             message):
    import re

    from conftest import file_hashes
    from tiny_corpus import make_corpus

    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=20)
    damage({"prefix": prefix, "tokenizer": tokenizer})
    before = file_hashes(tmp_path / "data")
    monkeypatch.setattr(memo.modes.train, "build_gpt", _raise(RuntimeError("the model was built")))
    row = run_in_process(tmp_path / "run", *SHORT, f"train.data=megatron:{prefix}", f"train.tokenizer={tokenizer}",
                         f"train.data_cache={tmp_path / 'cache'}")
    assert row["status"] == "error" and re.search(message, row["error"]) and "\n" not in row["error"], row["error"]
    assert file_hashes(tmp_path / "data") == before
