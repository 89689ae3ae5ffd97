# Set-up and entry points. `make run` trains the default job; `make test` runs the test suite.
# On a machine without an NVIDIA GPU the virtualenv gets PyTorch's CPU build and no CUDA wheels.

PYTHON      ?= python3
VENV        ?= .venv
TORCH_CPU   ?= torch==2.13.0
# Where pip finds the CPU build if it is not configured locally, e.g.
# make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Extras beyond `dev`; `make setup EXTRAS=dev,gpu` adds Transformer Engine and flash-attn.
EXTRAS      ?= dev

# pip byte-compiles what it installs one file at a time (about 70 s of a 110 s set-up on two
# cores); compiling afterwards uses every core and leaves out the packages' own test suites, which
# nothing imports. A file that does not compile (torch ships some Python 3.12 syntax) is left
# to be compiled where imported, as pip leaves it.
PIP       := $(VENV)/bin/python -m pip
COMPILE   := $(VENV)/bin/python -c 'import compileall, re, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0, rx=re.compile(r"site-packages/(.+/)?tests?/"))'
HAS_GPU   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
READY     := $(VENV)/.ready-$(EXTRAS)

.PHONY: setup run test clean gpu-wheels gpu-check

setup: $(READY)

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),yes)
	$(PIP) install --quiet --no-compile -e '.[$(EXTRAS)]'
	$(COMPILE)
else
	$(PIP) install --quiet --no-compile $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH_CPU)'
	$(PIP) install --quiet --no-compile -e '.[$(EXTRAS)]'
	$(COMPILE)
	$(VENV)/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda and "a CUDA build of torch was installed on a machine without an NVIDIA GPU; run make clean, then make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu")'
endif
	touch $@

run: setup
	$(VENV)/bin/python run.py

test: setup
	$(VENV)/bin/python -m pytest

# The GPU validation pack (README, "On a lent GPU"): wheels the GPU machine lacks, then the pack.
gpu-wheels: setup
	$(VENV)/bin/python -m memo.gpucheck.wheels --dest .whl

gpu-check:
	python3 -m memo.gpucheck

clean:
	rm -rf $(VENV)
