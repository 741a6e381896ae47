# The two commands of the README. Each creates .venv (from pyproject.toml) if it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-all durations venv clean

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

# the test suite (CI runs this): two pytest runs of two workers each, a test file per worker at a time
# (a file's module fixtures, such as test_sharding's SPMD subprocess, run once); 11-15 min on 2 cores.
# It leaves out the tests marked as slow (end-to-end runs of fresh processes whose parts other tests cover;
# see the README). Two runs, so each worker process is fresh halfway: a process keeps every XLA:CPU
# executable it compiled (100-260 memory maps each), and one worker that ran half the suite passed the
# kernel's vm.max_map_count (65530) and segfaulted inside an XLA compile. tests/schedule.py deals the files
# into runs of about equal time by their measured seconds (tests/durations.json; `make durations`
# measures them again), heaviest first, and xdist keeps that order (--no-loadscope-reorder), so no worker
# is left alone with a long file at the end. Each run lists its 10 slowest tests (--durations)
TEST_WORKERS ?= 2
TEST_RUNS ?= 2
# $(call runs,PYTEST OPTIONS): every run in turn; $$status is 1 if one failed
runs = status=0; for k in $$(seq 1 $(TEST_RUNS)); do \
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 $(1) \
		$$($(VENV)/bin/python tests/schedule.py $(TEST_RUNS) $$k) || status=1; done

test: $(STAMP)
	$(call runs,-m "not slow"); exit $$status

# every test, the slow ones too
test-all: $(STAMP)
	$(call runs,); exit $$status

# the suite's seconds per test file, measured again into tests/durations.json (for the runs' split)
durations: $(STAMP)
	rm -f .pytest_cache/junit-*.xml; \
	$(call runs,-m "not slow" --junitxml=.pytest_cache/junit-$$k.xml); \
	$(VENV)/bin/python tests/schedule.py --record .pytest_cache/junit-*.xml; exit $$status

clean:
	rm -rf $(VENV)
