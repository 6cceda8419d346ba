# Everything a newcomer needs, installed on demand: `make demo`, `make test`.
# Runs as root on a fresh Debian machine with no stdin (CI); elsewhere uses sudo
# for the few system packages FUSE needs.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
EXTRAS  := fuse,s3,metrics,test
# fuse3: fusermount3 + the kernel protocol helpers; libfuse3-dev + pkg-config:
# to build pyfuse3 from source when no wheel fits.
SYSPKGS := fuse3 libfuse3-dev pkg-config
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup sysdeps test demo bench clean

setup: $(STAMP)

sysdeps:
	@missing=""; \
	for p in $(SYSPKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing </dev/null; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory sysdeps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip </dev/null
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' </dev/null
	@touch $(STAMP)

test: $(STAMP)
	@$(MAKE) --no-print-directory sysdeps
	$(PY) -m pytest -q

demo: $(STAMP)
	@$(MAKE) --no-print-directory sysdeps
	$(PY) -m fsclient.demo

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
