# pimlayers: `make train` (the main job) and `make test` (build + full suite) from a clean clone.
# Needs only python3 (3.11+), a C++ compiler and, optionally, nvcc (CUDA handlers are built when found).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Pinned so CI and every developer run the same stack (jax 0.10.2 is what PyPI serves for CPython 3.11).
PINS   := jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 flax==0.12.8 equinox==0.13.8 optax==0.2.8 \
          jaxtyping==0.3.11 tqdm==4.70.1 pytest==9.2.0 pytest-xdist==3.8.0 ruff==0.17.6 \
          clang-format==23.1.5 scikit-build-core==1.1.2 pybind11==3.1.0 \
          tokenizers==0.23.3 safetensors==0.8.0 orbax-checkpoint==0.12.8 matplotlib==3.11.2
# Only the tests need these: logits compared with Hugging Face transformers on the CPU, notebooks run headless.
TEST_PINS := torch==2.13.0 transformers==5.24.0 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0
JOBS   ?= 2

.PHONY: venv build train test test-gpu lint format bench clean

$(VENV)/.stamp:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PINS)
	touch $@

venv: $(VENV)/.stamp

$(VENV)/.test-stamp: $(VENV)/.stamp
	$(PIP) install -q $(TEST_PINS)
	touch $@

# --no-build-isolation: the handlers must be built against the XLA FFI headers of the jaxlib that loads them.
build: venv
	$(PIP) install -q --no-build-isolation --no-deps -e . 2>&1 | tail -n 20

# The main job: a small Llama 3 trained on the Python standard library's sources with faults injected
# and repaired; prints the fault report. TRAIN_ARGS passes options (python -m train.llama3 --help).
train: build
	$(PY) -m train.llama3 $(TRAIN_ARGS)

test: build $(VENV)/.test-stamp
	$(PY) -c "import pimlayers; [print(' ', i) for i in pimlayers.native_info().values()]"
	$(PY) -m pytest -q -n $(JOBS) --durations=10

# One process per GPU test run; XLA's default preallocation (75% of the card per process) would
# starve parallel workers.
test-gpu: build
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -m gpu -rs

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror csrc/*.cc csrc/*.cu csrc/*.h

format: venv
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .
	$(VENV)/bin/clang-format -i csrc/*.cc csrc/*.cu csrc/*.h

bench: build
	$(PY) -m benchmarks.run

clean:
	rm -rf build $(VENV) pimlayers/*.so .cache runs
