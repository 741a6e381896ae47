# The two commands of the README. Each creates .venv (from pyproject.toml) if it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-all venv clean

# uv installs the ~8 GB of wheels in about a minute where pip took about 3.5 min (the same versions);
# pip is the fallback wherever uv cannot be installed or run. --compile-bytecode: pip writes every
# module's .pyc at install and uv does not, and with PYTHONDONTWRITEBYTECODE set (as on this machine)
# every fresh process would compile torch's and transformers' sources again (the suite ran ~35% slower)
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	( $(VENV)/bin/pip install --progress-bar off -q uv && $(VENV)/bin/uv pip install --compile-bytecode --python $(VENV)/bin/python -e ".[test]" ) \
		|| $(VENV)/bin/pip install --progress-bar off -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# the main job on the embedded default checkpoint
demo: $(STAMP)
	$(VENV)/bin/python -m mmzoo.infer model=qwen2_vl attention=pallas

# the test suite (CI runs this): two workers, a test file each at a time (a file's module fixtures, such
# as test_sharding's SPMD subprocess, run once); 14-16 min on 2 cores. It leaves out the tests marked
# as slow (end-to-end runs of fresh processes whose parts other tests cover; see the README)
# The files run in two pytest sessions, half each, so each worker process is fresh halfway: a process
# keeps every XLA:CPU executable it compiled (100-260 memory maps each), and one worker that ran half
# the suite passed the kernel's vm.max_map_count (65530) and segfaulted inside an XLA compile
# Each session lists its 10 slowest tests (--durations), to see where the time goes
TEST_WORKERS ?= 2
TEST_FILES := $(sort $(wildcard tests/test_*.py))
TEST_HALF := $(shell echo $$(( $(words $(TEST_FILES)) / 2 )))
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --durations=10 $(wordlist 1,$(TEST_HALF),$(TEST_FILES)); \
	first=$$?; \
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --durations=10 $(wordlist $(shell echo $$(( $(TEST_HALF) + 1 ))),1000,$(TEST_FILES)); \
	second=$$?; \
	exit $$(( first || second ))

# every test, the slow ones too
test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV)
