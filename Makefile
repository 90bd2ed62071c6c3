# Every target creates .venv if missing and installs the project with all extras.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test bench notebooks clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[export,examples,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits.py

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The example notebooks at full size; executed copies, with outputs, go to build/notebooks.
notebooks: $(STAMP)
	KERAS_BN_SMALL=0 KERAS_BN_CELL_TIMEOUT=7200 KERAS_BN_EXECUTED_DIR=build/notebooks \
		$(PY) -m pytest tests/test_notebooks.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_layer.py
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_sync.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
