# The two commands: `make run` and `make test`. Both create or reuse .venv.
# CPU installs go through deploy/constraints-cpu.txt, which pins the local
# CPU build of torch so nothing can pull a CUDA torch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
CONSTRAINTS := deploy/constraints-cpu.txt
STAMP  := $(VENV)/.tlt-installed
DEV_STAMP := $(VENV)/.tlt-dev-installed
MODEL  := artifacts/tiny
PRESET ?= cpu-tiny

.PHONY: run test test-slow install install-dev proto model clean

# `make run` installs what the product needs; `make test` adds the test tools (the `dev` extra: pytest,
# scipy, pyarrow, grpcio-tools, ...), ~30 s more on a 2-core VM, and regenerates the gRPC modules.
# pip compiles an installed package's bytecode, but not an editable install's source tree: with
# PYTHONDONTWRITEBYTECODE set (as on these VMs) every process would compile the modules it imports from
# source again, ~0.5 CPU-s for a service's (a `tlt run` starts six). A source file edited later is
# compiled in memory as before (its cached copy no longer matches).
BYTECODE = $(PY) -m compileall -q tlt services kernels > /dev/null
install: $(STAMP)
install-dev: $(DEV_STAMP)

# A .venv whose Python no longer runs (a removed or upgraded pyenv Python leaves .venv/bin/python a dangling
# link) is made again, `venv --clear`, which also deletes the stamps it holds; its stamps no longer count.
VENV_BROKEN := $(shell test -e $(VENV) && ! $(PY) -c '' > /dev/null 2>&1 && echo yes)
.PHONY: venv-broken
venv-broken: ;

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS) $(if $(VENV_BROKEN),venv-broken)
	@if ! $(PY) -c '' > /dev/null 2>&1; then \
	  if test -e $(VENV); then echo "$(VENV): its Python does not run; making it again"; fi; \
	  $(PYTHON) -m venv --clear $(VENV); fi
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0+cpu setuptools wheel
	DS_BUILD_OPS=0 $(PIP) install -q -c $(CONSTRAINTS) --no-build-isolation --no-cache-dir deepspeed==0.19.8
	$(PIP) install -q -c $(CONSTRAINTS) -e .
	$(BYTECODE)
	@touch $@

$(DEV_STAMP): $(STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	$(PY) -m tlt.protogen
	$(BYTECODE)
	@touch $@

proto: $(DEV_STAMP)
	$(PY) -m tlt.protogen

# The tiny model is seeded and cached: rebuilt only when missing (the install is an order-only
# prerequisite: a reinstall after editing pyproject.toml does not rebuild the model).
model: $(MODEL)/.complete
$(MODEL)/.complete: | $(STAMP)
	$(VENV)/bin/tlt model build --preset tiny --out $(MODEL)

run: $(STAMP) model
	$(VENV)/bin/tlt run --preset $(PRESET)

# pytest exits 5 when it collected no test: not a failure of the suite.
# The default suite builds its tiny models in code; only the slow tests need
# the pre-trained artifacts/tiny, so only test-slow builds it.
test: $(DEV_STAMP)
	@$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-slow: $(DEV_STAMP) model
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(MODEL) build *.egg-info
