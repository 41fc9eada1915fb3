# Two entry points on a fresh machine: `make serve` (the main job) and `make test`.
# Both create .venv on first use, installing the CPU torch wheel before anything else
# so that no other package can drag a CUDA build in.
PY := .venv/bin/python
TORCH_VERSION ?= 2.13.0

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==$(TORCH_VERSION)
	.venv/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: install serve generate test bench lint
install: .venv/.installed

serve: .venv/.installed
	.venv/bin/tokenmill serve $(ARGS)

generate: .venv/.installed
	.venv/bin/tokenmill generate $(ARGS)

test: .venv/.installed
	$(PY) -m pytest -q -x --timeout=600 $(ARGS)

lint: .venv/.installed
	.venv/bin/ruff check tokenmill tests benchmarks
