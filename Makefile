# Every target creates .venv if missing and installs the project with all extras.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The JAX tests' virtualenv: keras-bn with its jax and test extras, and no TensorFlow.
VENV_JAX := .venv-jax
PY_JAX := $(VENV_JAX)/bin/python
STAMP_JAX := $(VENV_JAX)/.installed
# The PyTorch tests' virtualenv: keras-bn with its torch (CPU wheel) and test extras, and no
# TensorFlow.
VENV_TORCH := .venv-torch
PY_TORCH := $(VENV_TORCH)/bin/python
STAMP_TORCH := $(VENV_TORCH)/.installed
# --durations: every run's log names its 30 slowest tests, so CI's own log says where its time goes.
# --max-worker-restart=0: a worker that crashes (a segfault in a framework) fails the run at
# once, naming the test it crashed in. pytest-xdist 3.8 replaces a crashed worker, and under
# --dist loadgroup the run then hangs with every worker idle (pytest-dev/pytest-xdist#1323 and
# #1378; a fresh-clone CI run hung so on 2026-11-30): tests/test_worker_crash.py.
PYTEST_ARGS ?= -n 2 --dist loadgroup --max-worker-restart=0 --durations=30
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Python's bytecode cache (__pycache__, git-ignored) even where the environment turns it off:
# without it every pytest process compiles and assertion-rewrites the 25,000 lines of tests/
# again (collection under TensorFlow: 17.6 s a process without, 12.5 s with; 2026-11-30).
unexport PYTHONDONTWRITEBYTECODE

DEMO := artifacts/demo
EXPORT := $(VENV)/bin/keras-bn-export

.PHONY: demo venvs test test-tensorflow test-jax test-torch test-fast slow-tests lint typecheck docs bench bench-export gpu-check gpu-wheels \
	notebooks clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	@echo "Installing keras-bn with every extra (TensorFlow, JAX, export, examples, dev, docs) into $(VENV) (about 3 minutes)…"
	$(PY) -m pip install --quiet -e '.[all,torch,examples,dev,docs]'
	touch $(STAMP)

$(PY_JAX):
	python3 -m venv $(VENV_JAX)

$(STAMP_JAX): $(PY_JAX) pyproject.toml
	@echo "Installing keras-bn with JAX and its test dependencies, without TensorFlow, into $(VENV_JAX) (about 1 minute)…"
	$(PY_JAX) -m pip install --quiet -e '.[jax,test]'
	touch $(STAMP_JAX)

$(PY_TORCH):
	python3 -m venv $(VENV_TORCH)

$(STAMP_TORCH): $(PY_TORCH) pyproject.toml
	@echo "Installing keras-bn with PyTorch (CPU) and its test dependencies, without TensorFlow, into $(VENV_TORCH)…"
	$(PY_TORCH) -m pip install --quiet -e '.[torch,test]'
	touch $(STAMP_TORCH)

# The three virtualenvs side by side, each pip its own process: about 2 minutes on 2 cores
# from an empty checkout, where one after the other took 4 (2026-11-30).
venvs:
	$(MAKE) -j3 $(STAMP) $(STAMP_JAX) $(STAMP_TORCH)

# Train, save, fold, export (.tflite float32 and int8, .onnx), verify, report: into $(DEMO)/,
# then a table of what was written (size, format, verification, test accuracy).
demo: $(STAMP)
	mkdir -p $(DEMO)
	$(PY) examples/digits.py --save $(DEMO)/digits.keras --save-inputs $(DEMO)/digits_train_x.npy
	$(EXPORT) $(DEMO)/digits.keras --tflite $(DEMO)/digits.tflite --onnx $(DEMO)/digits.onnx \
		--report $(DEMO)/report.json
	$(EXPORT) $(DEMO)/digits.keras --tflite $(DEMO)/digits_int8.tflite --quantize int8 \
		--representative-data $(DEMO)/digits_train_x.npy \
		--report $(DEMO)/report_int8.json
	$(PY) examples/digits.py --summary $(DEMO)
	@echo "To use the virtualenv (python with keras_bn, keras-bn-export): . $(VENV)/bin/activate"

# Export latency (folded / unfolded / no BN) and ResNet50 fold time: prints a table.
bench-export: $(STAMP)
	$(PY) benchmarks/bench_export.py

# tests/ is one tree, run once per Keras backend, as Keras's own suite is: KERAS_BACKEND picks
# it, and Keras fixes it when first imported, so each run is a Python of its own
# (tests/conftest.py sets that backend's devices; a test marked backends(...) runs only under
# those, one marked requires_tensorflow only where TensorFlow imports). Under TensorFlow in
# $(VENV) (the default backend); under JAX in $(VENV_JAX) and under PyTorch in $(VENV_TORCH),
# where TensorFlow is not installed (KERAS_BN_NO_TENSORFLOW=1: test_no_tensorflow.py asserts
# it). Their comparisons with TensorFlow run its side in $(PY) (KERAS_BN_TF_PYTHON).
JAX_TESTS := KERAS_BACKEND=jax KERAS_BN_NO_TENSORFLOW=1 KERAS_BN_TF_PYTHON=$(CURDIR)/$(PY) \
	$(PY_JAX) -m pytest tests $(PYTEST_ARGS)
TORCH_TESTS := KERAS_BACKEND=torch KERAS_BN_NO_TENSORFLOW=1 KERAS_BN_TF_PYTHON=$(CURDIR)/$(PY) \
	$(PY_TORCH) -m pytest tests $(PYTEST_ARGS)
# Keras's SavedModel export tests under JAX, in $(PY): they need TensorFlow, which $(VENV_JAX)
# lacks (the rest of the parity file runs there; here, the count of Keras's test files run
# with TensorFlow importable too).
JAX_WITH_TF_TESTS := KERAS_BACKEND=jax $(PY) -m pytest tests/test_keras_parity.py \
	-k "saved_model_test or test_other_keras_test_files_are_run" $(PYTEST_ARGS) -q
# The PyTorch run again with TensorFlow installed beside PyTorch ($(PY) has both): the layer,
# the tools, fit and Keras's parity tests, with TensorFlow importable under KERAS_BACKEND=torch
# (test_no_tensorflow.py skips there). Not gpu-check's dry run, which is for the GPU machine,
# where there is no TensorFlow; nor the fake quantization and QAT recalibration files, which
# the run without TensorFlow compares with TensorFlow's answers already; nor the torch.compile
# tests, which trace with dynamo and compile with inductor, neither of which imports
# TensorFlow (130 s of this run's 170 s of tests, on 2 cores: CI's time budget).
TORCH_WITH_TF_FILES := test_layer_maths test_torch_layer test_torch_tools test_fold_backends \
	test_training_backends test_keras_parity
TORCH_WITH_TF_TESTS := KERAS_BACKEND=torch $(PY) -m pytest $(TORCH_WITH_TF_FILES:%=tests/%.py) \
	-k "not compile and not inductor" $(PYTEST_ARGS) -q

# The notebooks run once, in the docs site's build (tests/test_docs.py, at CI size): it fails
# on any failing cell, a claim's assert included, and its pages are checked for TensorFlow log
# lines; test_notebooks.py's own run of them (what `make notebooks` does at full size) would
# repeat that.
NOTEBOOKS_RUN_BY_THE_SITE := -k "not test_notebook_runs_and_its_checks_hold"
# Each backend's runs are a target of their own, so that a machine (or CI) with more than 2
# cores can run them side by side (`make -j3 test-tensorflow test-jax test-torch`, each on
# PYTEST_ARGS's workers); `make test` runs the three in turn.
test: venvs
	$(MAKE) test-tensorflow test-jax test-torch

test-tensorflow: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS) $(NOTEBOOKS_RUN_BY_THE_SITE)

test-jax: $(STAMP) $(STAMP_JAX)
	$(JAX_WITH_TF_TESTS)
	$(JAX_TESTS)

test-torch: $(STAMP) $(STAMP_TORCH)
	$(TORCH_TESTS)
	$(TORCH_WITH_TF_TESTS)

# The inner loop: the tree under TensorFlow and under JAX, less the notebooks, the docs build,
# three files of end-to-end runs (the CLI's, each a new Python importing TensorFlow; the
# property-based tests, 700 examples a property; bench_export's smoke run) and the slow tests:
# those marked slow in the code, and those that tests/slow_tests.txt names for the run's
# backend (each took 1 s or more there). `make test` stays the full suite, which CI runs.
FAST_SKIP := test_notebooks test_docs test_cli test_properties test_bench_export
FAST_ARGS := -m "not slow" $(FAST_SKIP:%=--ignore=tests/%.py)
test-fast: $(STAMP) $(STAMP_JAX)
	$(PY) -m pytest tests $(PYTEST_ARGS) $(FAST_ARGS)
	$(JAX_TESTS) $(FAST_ARGS)

# tests/slow_tests.txt from a full run per backend with every test's duration (about half an
# hour on 2 cores): rerun it when test-fast grows slow.
DURATIONS := $(PYTEST_ARGS) --durations=0 -q
slow-tests: $(STAMP) $(STAMP_JAX) $(STAMP_TORCH)
	mkdir -p build
	$(PY) -m pytest tests $(DURATIONS) $(NOTEBOOKS_RUN_BY_THE_SITE) > build/durations_tensorflow.log
	$(JAX_TESTS) --durations=0 -q > build/durations_jax.log
	$(TORCH_TESTS) --durations=0 -q > build/durations_torch.log
	$(PY) tests/find_slow_tests.py tensorflow=build/durations_tensorflow.log \
		jax=build/durations_jax.log torch=build/durations_torch.log

# Lint, format check and type check (.ci/run runs it before the tests).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(MAKE) typecheck

# mypy on the package as installed: a link tree with export/ as keras_bn/export (mypy cannot
# follow setuptools' editable-install finder).
TYPECHECK := build/typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/keras_bn
	ln -s $(CURDIR)/keras_bn/* $(TYPECHECK)/keras_bn/
	ln -s $(CURDIR)/export $(TYPECHECK)/keras_bn/export
	cd $(TYPECHECK) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml -p keras_bn

# The documentation site, into $(DOCS)/html. Executes every notebook (full size unless
# KERAS_BN_SMALL=1; cached per size in $(DOCS)); any warning fails the build.
DOCS := build/docs
docs: $(STAMP)
	@echo "Building the site into $(DOCS)/html; a line \"<notebook>: Executing notebook\" starts \
	each notebook that changed (at full size unless KERAS_BN_SMALL=1: minutes each)."
	$(PY) -m sphinx -W --keep-going -b html docs $(DOCS)/html
	@echo "Open $(DOCS)/html/index.html"

# The example notebooks at full size; executed copies, with outputs, go to build/notebooks.
notebooks: $(STAMP)
	KERAS_BN_SMALL=0 KERAS_BN_CELL_TIMEOUT=7200 KERAS_BN_EXECUTED_DIR=build/notebooks \
		$(PY) -m pytest tests/test_notebooks.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_layer.py --json benchmarks/results/bench_layer.json
	$(PY) benchmarks/bench_large_counts.py
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_sync.py
	$(PY) benchmarks/bench_recalibrate.py --json benchmarks/results/bench_recalibrate.json

# GPU readiness, in at most 8 minutes: the exactness tests and the layer benchmark on the GPU,
# JSON results into build/gpu_check/; under TensorFlow where it is importable, else under JAX
# and then PyTorch where both are (the GPU machine), else the one that is
# (benchmarks/gpu_check.py). No venv prerequisite: it runs with .venv's Python if there is one,
# else python3 (PYTHON=... picks another), and says in one line when it cannot run. Where Keras
# is missing (the GPU machine) it installs the wheels of `make gpu-wheels` into a temporary
# folder first: carry build/gpu_wheels there with the repository.
gpu-check:
	benchmarks/gpu_check.sh

# Keras and the dependencies it needs beyond JAX, as cp312 manylinux wheels, into
# build/gpu_wheels (under 40 MiB): what gpu-check installs on a machine without Keras (under
# JAX and under PyTorch alike).
gpu-wheels:
	benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(VENV_JAX) $(VENV_TORCH) .pytest_cache .hypothesis *.egg-info
