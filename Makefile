# Everything a newcomer needs, installed on demand: `make demo`, `make test`.
# Runs as root on a fresh Debian machine with no stdin (CI); elsewhere uses sudo
# for the few system packages FUSE and the cluster tier's tests need.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
EXTRAS  := s3,metrics,test,bench,proto
# fuse3: fusermount3 (fsclient mounts through it when not root). The rest is
# for development only: libfuse3-dev + pkg-config build pyfuse3 (the bench
# extra's passthrough floor) when no wheel fits; fio is a bench workload;
# memcached: the cluster tier's tests start their own servers on loopback ports.
SYSPKGS := fuse3 libfuse3-dev pkg-config fio memcached
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# pytest-xdist workers: one per core and one more, as the suite mostly waits
# on processes and timeouts (on 2 cores, 2 workers kept 1.2 cores busy); a
# test file stays on one worker (its module fixtures built once).
# `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

.PHONY: setup sysdeps test demo bench proto clean install-systemd

setup: $(STAMP)

sysdeps:
	@missing=""; \
	for p in $(SYSPKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing </dev/null; \
	fi

$(STAMP): pyproject.toml devtools/pyproject.toml constraints.txt
	@$(MAKE) --no-print-directory sysdeps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip </dev/null
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]' </dev/null
	@# dev-only (not shipped): latency::, the demo, test and bench helpers
	$(PY) -m pip install -q -c constraints.txt --no-deps -e ./devtools </dev/null
	@touch $(STAMP)

test: $(STAMP)
	@$(MAKE) --no-print-directory sysdeps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	@$(MAKE) --no-print-directory sysdeps
	$(PY) -m devtools.demo

bench: $(STAMP)
	$(PY) -m bench

# blockcache-csi's gRPC stubs from its .proto (committed: users need no grpcio-tools)
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
		blockcache_csi/proto/csi.proto blockcache_csi/proto/registration.proto

# Bare metal (docs/deploy.md): units, example configs and the blockcache user.
# BINDIR is where the blockcached/fsclient scripts are (a venv's bin/). Never
# overwrites an existing config; DESTDIR installs into a staging root.
PREFIX     ?= /usr/local
BINDIR     ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
UNITDIR    ?= $(PREFIX)/lib/systemd/system
DOCDIR     ?= $(PREFIX)/share/doc/blockcache
ETCDIR     := $(DESTDIR)$(SYSCONFDIR)/blockcache

install-systemd:
	install -d $(DESTDIR)$(UNITDIR) $(ETCDIR)/volumes $(DESTDIR)$(SYSCONFDIR)/sysusers.d $(DESTDIR)$(DOCDIR)
	install -d -m 0700 $(ETCDIR)/keys
	for u in blockcached.service fsclient@.service; do \
	  sed -e 's|/usr/local/bin/|$(BINDIR)/|g' -e 's|/usr/local/share/doc/blockcache/|$(DOCDIR)/|g' \
	    systemd/$$u > $(DESTDIR)$(UNITDIR)/$$u && chmod 0644 $(DESTDIR)$(UNITDIR)/$$u || exit 1; \
	done
	install -m 0644 systemd/blockcache.sysusers.conf $(DESTDIR)$(SYSCONFDIR)/sysusers.d/blockcache.conf
	install -m 0644 systemd/blockcached.toml.example $(ETCDIR)/blockcached.toml.example
	install -m 0644 systemd/volume.toml.example $(ETCDIR)/volumes/volume.toml.example
	[ -e $(ETCDIR)/blockcached.toml ] || install -m 0644 systemd/blockcached.toml.example $(ETCDIR)/blockcached.toml
	install -m 0644 docs/deploy.md $(DESTDIR)$(DOCDIR)/deploy.md
	@for b in blockcached fsclient; do [ -x $(BINDIR)/$$b ] || \
	  echo "warning: $(BINDIR)/$$b missing: install the package there or set BINDIR"; done
	@if [ -z "$(DESTDIR)" ] && command -v systemd-sysusers >/dev/null; then \
	  systemd-sysusers $(SYSCONFDIR)/sysusers.d/blockcache.conf; fi
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
	  echo systemctl daemon-reload; systemctl daemon-reload; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
