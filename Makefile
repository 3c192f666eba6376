# The README's two commands: `make demo` (the main job on the embedded toy-world models) and `make test`.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdvg-installed

.PHONY: venv test lint demo clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

# two workers (the machines are 2-core; whole test files stay in one worker, so module fixtures are built once)
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache

# The main job on the embedded default: the toy world's trained models (sdvg/toy/models), a toy caption, SDVG
# routing with the toy critic; then a contact sheet of target-only, draft-only and SDVG videos.
demo: $(STAMP)
	$(PY) -m sdvg generate --prompt "a red circle moving right on a black background" --threads 2 \
		--out out/demo.mp4 --report out/demo_report.json --timeline out/demo_timeline.png
	$(PY) -m sdvg toy sheet --out out/demo_sheet.png
