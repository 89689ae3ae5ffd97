"""The CPU's peak of live tensor bytes (memo.plan.tensor_bytes), against counts by hand."""

import torch

from memo.plan.tensor_bytes import ResidentBytes, resident_bytes, step_peak
from memo.profile.recorder import AllocationRecorder
from memo.profile.trace import Event


def test_the_resident_bytes_are_the_weights_their_gradients_adams_states_and_the_buffers():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)  # 2048 fp32 weights: 8192 bytes
    adam = torch.optim.Adam(model.parameters())
    buffer = torch.empty(100, dtype=torch.float64)  # 800 bytes
    assert resident_bytes(model, [buffer]) == 8192 + 800  # no gradient, no Adam state yet
    model(torch.randn(16, 64)).square().sum().backward()
    adam.step()
    # the weight, its gradient, exp_avg, exp_avg_sq (8192 bytes each), Adam's step (a 4-byte scalar)
    assert resident_bytes(model, [buffer, buffer[:10]]) == 4 * 8192 + 4 + 800  # a view counts once


def test_a_recorded_steps_peak_is_what_it_makes_alive_at_once_over_what_is_resident():
    phase = ["fwd"]
    recorder = AllocationRecorder(lambda: phase[0])
    kept = torch.empty(10)  # made before the step and alive through it: not the step's
    with recorder:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.ones(500)  # 2000 bytes: 6000 live
        del a  # 2000 live
        phase[0] = "bwd"
        c = b.repeat(4)  # 8000 bytes: 10000 live, the peak
        b.mul_(2)  # in place: nothing new
        view = c[:10]  # a view: nothing new
        del b, c, view
        phase[0] = "optimizer"
        d = torch.empty(2000)  # 8000 bytes
        del d
    recorder.stop()
    assert step_peak(recorder.events, resident=500) == (10500, "bwd")
    del kept


def test_what_a_first_step_makes_and_keeps_counts_as_held_throughout():
    # a first step: its gradient (700 bytes) made in the backward, Adam's states (3000) by the optimizer
    events = [Event("malloc", 0, 1000, "fwd"), Event("malloc", 1, 500, "bwd"), Event("malloc", 2, 700, "bwd"),
              Event("free", 0, 1000, "bwd"), Event("free", 1, 500, "bwd"), Event("malloc", 3, 3000, "optimizer"),
              Event("malloc", 4, 400, "optimizer"), Event("free", 4, 400, "optimizer")]
    # every later step holds the gradient and Adam's states from its start, under its passes' 1500
    assert step_peak(events, resident=100) == (100 + 3700 + 1500, "bwd")


def test_a_resident_storage_the_step_frees_counts_until_then():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)  # 8192 bytes of weights
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(16, 64)).square().sum().backward()
    adam.step()
    phase = ["start"]
    recorder = AllocationRecorder(lambda: phase[0])
    resident = ResidentBytes(model, [], recorder.events, lambda: phase[0])
    assert resident.bytes == 4 * 8192 + 4  # the weight, its gradient, Adam's moments and step
    with recorder:
        a = torch.empty(1000)  # 4000 bytes over the resident ones: the peak
        del a
        phase[0] = "after"
        model.weight.grad = None  # the gradient goes: 8192 bytes less
        b = torch.empty(2500)  # 10000 bytes: 1808 bytes more than the gradient was
        del b
    recorder.stop()
    resident.stop()
    assert step_peak(recorder.events, resident.bytes) == (4 * 8192 + 4 + 4000, "start")
    recorder = AllocationRecorder(lambda: phase[0])
    resident = ResidentBytes(model, [], recorder.events, lambda: phase[0])
    with recorder:
        c = torch.empty(3000)  # 12000 bytes over what is resident now (no gradient)
        del c
    recorder.stop()
    resident.stop()
    assert step_peak(recorder.events, resident.bytes) == (3 * 8192 + 4 + 12000, "after")
