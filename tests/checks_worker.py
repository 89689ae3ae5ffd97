"""Under torchrun: several multi-process checks in one launch, so that the suite starts the
processes (and imports PyTorch and Megatron in each) once per process count instead of once per
check. ``conftest.py``'s ``torchrun_results`` fixture launches it; a test names its checks with
``@pytest.mark.torchrun(processes, "module.function ARG...", ...)``.

``python -m torch.distributed.run --nproc-per-node N tests/checks_worker.py OUT SPEC...``: for
each ``SPEC`` (``module.function`` of a module under ``tests/``, then its arguments, separated by
spaces) every rank calls ``function(info, OUT/<i>, *arguments)``, where ``info`` is this process's
:class:`memo.execute.distributed.ProcessInfo` with a port of the check's own: each check joins a
fresh process group (``memo.execute.distributed.initialize``, or a training job's own) and
leaves it when done, as a check launched alone would. A rank prints ``rank R: ok #i SPEC (T s):
MESSAGE`` for each check that returned; at the first that raises it prints the traceback and
ends the launch (the other ranks' collectives would no longer match), so the checks after it do
not run and their tests fail saying so.
"""

import importlib
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from memo.collector import frozen_after
from memo.execute.distributed import ProcessInfo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(text: str) -> None:
    """One line (or block) in one write: the ranks share a pipe, and a print of the text and then
    its newline let another rank's line in between, where the test's reader missed both."""
    os.write(sys.stdout.fileno(), f"{text}\n".encode())


def main() -> int:
    out_root, specs = Path(sys.argv[1]), sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, addr = int(os.environ.get("LOCAL_RANK", 0)), os.environ.get("MASTER_ADDR", "127.0.0.1")
    # torchrun's agent keeps its store at MASTER_ADDR:MASTER_PORT for the whole launch: rank 0
    # tells the others there which port each check's process group uses. A process group that is
    # destroyed cannot be made again on the agent's store (its old keys remain), so each check's
    # group has a store of its own, hosted by rank 0 as without torchrun.
    agent = TCPStore(addr, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=600))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    for i, spec in enumerate(specs):
        name, *args = spec.split()
        module, function = name.rsplit(".", 1)
        key = f"memo-checks/{i}/port"
        if rank == 0:
            agent.set(key, str(_free_port()))
        port = int(agent.get(key))
        info = ProcessInfo(rank=rank, world_size=world, local_rank=local_rank, master_addr=addr,
                           master_port=port)
        start = time.perf_counter()
        try:
            if module in sys.modules:
                check = getattr(sys.modules[module], function)
            else:
                with frozen_after():  # the first check of a module imports megatron-core: see memo.collector
                    check = getattr(importlib.import_module(module), function)
            message = check(info, out_root / str(i), *args)
        except BaseException:  # noqa: BLE001 - reported, then the launch ends
            _say(f"rank {rank}: FAILED #{i} {spec}\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
        _say(f"rank {rank}: ok #{i} {spec} ({time.perf_counter() - start:.1f} s): {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
