"""What a test needs from the machine beyond the Python packages: skipped with the reason on a
newcomer's machine, a failure under CI (``CI=true``, set by ``.ci/run``), where a skip would hide
a part of the suite."""

import os
import shutil
from typing import Optional

import pytest


def require(missing: Optional[str]) -> None:
    """Go on if ``missing`` is None; else skip with it as the reason, or fail under CI."""
    if missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing)


def c_compiler_missing() -> Optional[str]:
    """Why the plan's native allocator (memo/plan/plan_allocator.c) cannot be built here, or None."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler (cc) to build the plan's allocator library: install gcc, or set CC"
    return None


def deepspeed_missing() -> Optional[str]:
    """Why the DeepSpeed-Ulysses baseline cannot train here (on the CPU), or None."""
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except ImportError:
        return "DeepSpeed is not installed: pip install -e '.[dev]' (or '.[deepspeed]')"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) for DeepSpeed's CPU collective: install g++, or set CXX"
    return None
