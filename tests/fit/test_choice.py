"""A run that plans itself (memo.fit.choice): the fastest choice that fits, made before the model
is built, and a one-line refusal where none fits."""

import dataclasses
import json
import re
import time

import pytest
from conftest import compose_config, resolve_config, run_in_process

from memo import hardware
from memo.config import ConfigError, resolve
from memo.fit import choice
from memo.fit.predict import predict
from memo.hardware import GiB

# tiny_llama at 4K tokens in 0.2 GiB: whole layers need more (their rounding buffers and
# transients), some tile less
SEQ, BUDGET_GIB = "4k", 0.2
CHOOSING = ("model=tiny_llama", f"seq={SEQ}", "method=memo", "method.tile_tokens=auto",
            f"hardware.device_memory_gib={BUDGET_GIB}")


def _machine(run):
    return hardware.available_now(hardware.resolve(run.hardware), run.hardware)


def test_auto_settings_are_choices_where_the_run_can_choose_and_plain_values_elsewhere():
    run = resolve_config("method=memo", "method.tile_tokens=auto")
    assert run.choices.layer_tiles and run.workload.layer_tile_tokens is None
    # on the CPU Adam's states are in host memory already: nothing to choose
    assert not run.choices.optimizer_offload and run.train.optimizer_offload == "none"
    assert run.choices.loss_tile  # memo's loss is tiled
    whole = resolve_config("method=memo", "method.tile_tokens=whole", "train.loss_tile_tokens=128")
    assert not whole.choices.any and not whole.choices.loss_tile
    # a method whose layers do not walk tiles runs whole layers under auto
    assert not resolve_config("method=megatron_full_recompute", "method.tile_tokens=auto").choices.any
    fit = resolve_config("mode=fit", "hardware=h100", "train.dtype=bf16", "method=memo")
    assert fit.choices.optimizer_offload and fit.train.optimizer_offload == "auto"
    assert not resolve_config("mode=fit", "hardware=h100", "train.dtype=fp32").choices.optimizer_offload


def test_whole_layers_where_they_fit_predicting_nothing_else():
    run = resolve_config("model=tiny_llama", f"seq={SEQ}", "method=memo", "method.tile_tokens=auto",
                         "hardware.device_memory_gib=1")
    made = choice.choose(run, _machine(run))
    assert made.candidate.tile_tokens is None and made.tried == 1 and made.prediction.fits
    assert made.apply(run).workload == run.workload  # nothing changes: whole layers, the loss's own tile


def _on_a_gpu(*overrides: str):
    """A memo run as a GPU machine resolves it (an H100, with a device memory of its own), and
    that machine as the run sees it."""
    run = resolve(compose_config("model=tiny_llama", f"seq={SEQ}", "method=memo", "hardware=h100", *overrides),
                  gpu_visible=True)
    return run, _machine(run)


def test_on_a_gpu_memo_keeps_every_activation_where_that_fits_and_swaps_where_not():
    run, machine = _on_a_gpu()
    assert run.choices.keep_all  # α left to solve, on a GPU
    made = choice.choose(run, machine)
    assert made.candidate.keeps_all and made.tried == 1 and made.prediction.fits  # nothing else predicted
    kept = made.apply(run).workload
    assert kept.method.layer_activations == "keep" and kept.method.alpha is None and kept.layer_tile_tokens is None
    assert made.row()["method.layer_activations"] == "keep" and "keeping every activation" in made.summary()
    # where keeping does not fit, memo's own swapping, as before: its 2.34 GiB (2 of them CUDA's
    # context) and the margin are more than 2.3 GiB, where memo's tiles fit
    small, machine = _on_a_gpu("hardware.device_memory_gib=2.3")
    made = choice.choose(small, machine)
    assert not made.candidate.keeps_all and made.apply(small).workload.method.layer_activations == "swap"
    # α given, method.keep_all=never, or the CPU: memo swaps as asked
    assert not _on_a_gpu("alpha=0.5")[0].choices.keep_all
    assert not _on_a_gpu("method.keep_all=never")[0].choices.keep_all
    assert not resolve_config("method=memo").choices.keep_all
    # a row of the choice (memo's layers keeping, keep_all=auto) reads back, as a calibration reads it
    assert resolve_config("method=memo", "method.layer_activations=keep").workload.method.layer_activations == "keep"
    with pytest.raises(ConfigError, match="method.keep_all=auto chooses between keeping every activation and "
                                          "memo's swapping, and method=full_recompute does not swap"):
        resolve_config("method=full_recompute", "method.keep_all=auto")


def test_a_run_trains_in_the_tiles_it_chose_within_its_device_budget(tmp_path):
    run = resolve_config(*CHOOSING)
    problem = choice.problem_of(run, _machine(run))
    row = run_in_process(tmp_path, *CHOOSING, "train.steps=2")
    assert row["status"] == "ok", row["error"]
    tile, loss_tile = row["method.tile_tokens"], row["train.loss_tile_tokens"]
    assert isinstance(tile, int) and 4096 % tile == 0 and isinstance(loss_tile, int) and loss_tile <= tile
    assert row["tiles.tile_tokens"] == tile  # what the layers' runtime ran
    budget = int(BUDGET_GIB * GiB)
    assert row["predicted_device_capacity_bytes"] == budget
    assert row["margin_bytes"] == -(-3 * budget // 100)  # 3%, rounded up
    assert row["predicted_device_bytes"] <= budget - row["margin_bytes"]
    # what the step held at once on the "device" (the CPU's tensors, host slabs apart) is within what
    # the fit predicted (a CPU has no caching allocator: the prediction is of live bytes), and close
    # to it: the fit counts 10 MB of persistent buffers more than the run holds (5.6% at 4K)
    assert 0.9 * row["predicted_device_bytes"] <= row["peak_tensor_bytes"] <= row["predicted_device_bytes"] <= budget
    # whole layers and every larger tile would not have fitted: nothing faster fits
    for candidate in choice.candidates(run, problem):
        if candidate.tile_tokens is None or candidate.tile_tokens > tile:
            assert not choice.evaluate(problem, candidate, run.workload.seq, None).best


def test_a_length_no_choice_fits_is_refused_in_one_line_with_the_longest_that_does():
    run = resolve_config("model=tiny_llama", "seq=64k", "method=memo", "method.tile_tokens=auto",
                         f"hardware.device_memory_gib={BUDGET_GIB}")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        choice.choose(run, _machine(run))
    assert time.perf_counter() - start < 30
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("tiny_llama at 64k does not fit this cpu (0.20 GiB a device")
    assert re.search(r": the [^:;]+ need \d+\.\d\d GiB of the \d+\.\d\d GiB predicted against 0\.19 GiB usable "
                     r"in tiles of 512 tokens, Adam on the device", message), message
    longest = int(re.search(r"the longest that fits is seq=(\d+)k$", message).group(1)) * 1024
    # that length fits, in some tile, and the next length of the search's grid (a 64th of 64k) fits none
    fits = choice.choose(resolve_config("model=tiny_llama", f"seq={longest}", "method=memo",
                                        "method.tile_tokens=auto", f"hardware.device_memory_gib={BUDGET_GIB}"),
                         _machine(run))
    assert fits.prediction.fits and fits.prediction.seq == longest
    with pytest.raises(ConfigError, match="does not fit"):
        choice.choose(resolve_config("model=tiny_llama", f"seq={longest + 1024}", "method=memo",
                                     "method.tile_tokens=auto", f"hardware.device_memory_gib={BUDGET_GIB}"),
                      _machine(run))


def test_explicit_settings_are_tried_as_given_unless_checked_against_the_fit():
    given = ("model=tiny_llama", "seq=64k", "method=memo", "method.tile_tokens=512",
             f"hardware.device_memory_gib={BUDGET_GIB}")
    assert not resolve_config(*given).choices.any  # nothing asks the fit: the run tries them
    checked = resolve_config(*given, "train.fit_check=true")
    with pytest.raises(ConfigError, match=r"^tiny_llama at 64k does not fit .* in tiles of 512 tokens, Adam on "
                                          r"the device, the least that any choice needs; the longest that fits is"):
        choice.choose(checked, _machine(checked))
    # where they fit, the check keeps them (and sizes the loss's tile, left unset, as a choice would)
    fits = resolve_config(*given[:1], "seq=4k", *given[2:], "train.fit_check=true")
    made = choice.choose(fits, _machine(fits))
    assert made.tried == 1 and made.apply(fits).workload == dataclasses.replace(
        fits.workload, loss_tile_tokens=made.candidate.loss_tile_tokens)


# whole layers of tiny_llama at 4K in 0.25 GiB a device: two data-parallel replicas need 0.30 GiB
# each, the sequence split over two context-parallel ranks 0.22
AUTO_LAYOUT = ("parallel=auto", "model=tiny_llama", "seq=4k", "method=memo", "method.tile_tokens=whole",
               "hardware.device_memory_gib=0.25", "train.steps=2", "train.warmup_steps=1")


@pytest.mark.torchrun(2, " ".join(["training_worker.train", *AUTO_LAYOUT]))
def test_a_run_chooses_its_layout_among_its_processes(torchrun_results):
    (launched,) = torchrun_results
    launched.passed()
    row = json.loads((launched.out_dir / "result.json").read_text())
    assert (row["status"], row["world_size"]) == ("ok", 2)
    chosen = (row["parallel.tp"], row["parallel.cp"], row["parallel.pp"], row["parallel.dp"])
    assert chosen == (1, 2, 1, 1), chosen  # data parallelism, the faster, does not fit
    # what the fit predicted of every layout of two processes, the run's own choice among them
    run = resolve_config(*AUTO_LAYOUT, "cluster.gpus=2")
    problem = choice.problem_of(run, _machine(run))
    fits = {choice.layout_label(c.parallel): predict(choice._of_candidate(problem, c), c.parallel, 4096).fits
            for c in choice.candidates(run, problem) if not c.unrunnable}
    assert fits == {"tp1 cp1 pp1 dp2": False, "tp1 cp2 pp1 dp1 all_gather": True, "tp1 cp2 pp1 dp1 p2p": True,
                    "tp1 cp2 pp1 dp1 a2a": True, "tp1 cp1 pp2 dp1": True}, fits
    assert row["choice.candidates"] == 5 and row["predicted_device_bytes"] <= 0.25 * GiB - row["margin_bytes"]
    with pytest.raises(ConfigError, match="parallel=auto chooses a layout of the 1 process"):
        from memo.modes.train import _of_processes
        from memo.execute.distributed import ProcessInfo

        _of_processes(run, ProcessInfo(rank=0, world_size=1, local_rank=0))


def test_memo_with_its_defaults_fits_wherever_megatrons_full_recomputation_does():
    """Whole-layer MEMO keeps two rounding buffers of a layer's skeletal tensors beside a layer's
    transients, more than Megatron's recomputation at few layers and long lengths (it ran out of
    memory on an H100 at 128K with Llama-3.1-8B's shape at 4 layers, where Megatron trained): its
    tiles are what fit there, and a run of memo chooses them itself."""
    whole_short = []
    for seq in ("2k", "8k"):
        for gib in (0.12, 0.15, 0.2, 0.3):
            sizes = ("model=tiny_llama", f"seq={seq}", f"hardware.device_memory_gib={gib}")
            megatron = resolve_config(*sizes, "method=megatron_full_recompute", "train.loss=tiled")
            if not _fits(megatron):
                continue
            memo = resolve_config(*sizes, "method=memo", "method.tile_tokens=auto")
            assert choice.choose(memo, _machine(memo)).prediction.fits, (seq, gib)
            if not _fits(resolve_config(*sizes, "method=memo", "method.tile_tokens=whole")):
                whole_short.append((seq, gib))
    assert whole_short  # some of them whole-layer MEMO does not fit


def _fits(run) -> bool:
    return predict(choice.problem_of(run, _machine(run)), run.workload.parallel, run.workload.seq).fits


def test_pytorchs_adam_makes_an_fp32_element_per_parameter_of_its_shard_at_the_step():
    from memo.fit.memory import optimizer_step_bytes
    from memo.model.gpt import parameter_count

    run = resolve_config("model=tiny_llama", "seq=1k")
    params = parameter_count(run.workload.model, 1, 1)  # every parameter on the one device
    assert optimizer_step_bytes(run.workload, None, 0.0, pytorch_adam=True) == 4 * params
    assert optimizer_step_bytes(run.workload, None, 0.0, pytorch_adam=False) == 0  # a fused Adam's
    sharded = run.workload.at(dataclasses.replace(run.workload.parallel, dp=2), 1024)
    assert optimizer_step_bytes(sharded, None, 0.0, pytorch_adam=True) == -(-4 * params // 2)
    assert optimizer_step_bytes(sharded, False, 0.0, pytorch_adam=True) == 4 * params  # not sharded
    # the half of the parameters whose states are on the host step there
    assert optimizer_step_bytes(run.workload, None, 0.5, pytorch_adam=True) == -(-4 * params // 2)
