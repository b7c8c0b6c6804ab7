# Two commands do everything on a fresh machine:
#   make demo   set up .venv, install verispec and the demo models, run the demo
#   make test   set up .venv, install verispec with its test dependencies and the demo models, run the tests
VENV   := .venv
PYTHON := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test install models clean

$(PYTHON):
	python3 -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

install: $(VENV)/.installed

models: install
	$(VENV)/bin/verispec models --install

demo: models
	$(VENV)/bin/verispec demo

test: models
	$(PYTHON) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
