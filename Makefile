# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.computron-installed
# torch 2.13.0: on these CPU machines pip takes the CPU wheel that lies on disk; an open range
# would download a multi-GB CUDA build. colossalai only provides the `colossalai run` launcher:
# installed without its pins (they would replace torch and transformers), plus what its CLI needs.
TORCH       := torch==2.13.0
DEPS        := "transformers>=5,<6" safetensors numpy matplotlib pytest pytest-timeout psutil
LAUNCHER    := colossalai==0.5.0
LAUNCHER_DEPS := psutil click fabric

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q $(TORCH) $(DEPS) $(LAUNCHER_DEPS)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps $(LAUNCHER)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	$(PY) -c "import torch, transformers, computron; print('computron', computron.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

demo: setup
	$(PY) examples/opt/serve_opt.py --models 3 --tp 2 --pp 1 --max-loaded 1 --requests 9

test: setup
	$(PY) -m pytest -q --timeout 900 tests

bench: setup
	$(PY) benchmarks/swap.py --size-gb 1

clean:
	rm -rf $(VENV) *.egg-info
