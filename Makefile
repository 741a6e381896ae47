# The two commands of the README. Each creates .venv (from pyproject.toml) if it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --progress-bar off -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# the main job on the embedded default checkpoint
demo: $(STAMP)
	$(VENV)/bin/python -m mmzoo.infer model=qwen2_vl attention=pallas

# the test suite (CI runs this)
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV)
