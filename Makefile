# Every target builds .venv first and installs through constraints.txt, so a fresh
# machine with Python 3.11 needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install sysdeps demo test test-slow lint bench clean

$(STAMP): pyproject.toml setup.py constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[dev,quant,topology,gateway]"
	touch $(STAMP)

install: $(STAMP)

# tcpdump for the loopback-capture test (RELIABILITY.md C), promtool (Debian's prometheus) for the metrics naming
# check, headless chromium and its driver for the dashboard test, systemd-analyze for the unit's checks, ip and tc
# for the network-namespace tests; installed where apt-get and root are available
sysdeps:
	@command -v tcpdump >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tcpdump >/dev/null; \
		else echo "tcpdump is missing and cannot be installed here: the capture test will fail"; fi; }
	@command -v promtool >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			prometheus >/dev/null; \
		else echo "promtool is missing and cannot be installed here: the metrics naming check is skipped"; fi; }
	@command -v chromedriver >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null; \
		else echo "chromium is missing and cannot be installed here: the dashboard test is skipped"; fi; }
	@command -v systemd-analyze >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			systemd >/dev/null; \
		else echo "systemd-analyze is missing and cannot be installed here: the unit checks are skipped"; fi; }
	@command -v tc >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			iproute2 >/dev/null; \
		else echo "ip and tc are missing and cannot be installed here: the network-namespace tests are skipped"; fi; }

DEMO_PORT ?= 8000
demo: $(STAMP)
	$(VENV)/bin/nesa-node demo --nodes 3 --serve --gateway-port $(DEMO_PORT)

# the import contracts of pyproject.toml, checked on a tree of links laid out as installed (nesa_node.routing is
# routing/, ...): see tests/support/layout.py
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tests/support/layout.py

# PYTHONNODEBUGRANGES: Python 3.11 parses source with `ast` to underline tracebacks, and two threads doing so at
# once (the test's swarm threads log failures of killed peers) corrupt a shared counter: "SystemError: AST
# constructor recursion depth mismatch" in whatever parses next, pytest's own reporting included.
TEST_ENV := PYTHONNODEBUGRANGES=1

test: $(STAMP) sysdeps lint
	$(TEST_ENV) $(PY) -m pytest -q tests
	# the suite again with asserts stripped: no check may rely on them. The `cli` tests (nesa-node processes driven
	# from outside, a third of the time) and the `once` ones (accuracy tables, pure data) run once, above.
	$(TEST_ENV) $(PY) -O -m pytest -q -m "not slow and not cli and not once" tests

test-slow: $(STAMP) sysdeps
	$(TEST_ENV) $(PY) -m pytest -q -m slow tests

bench: $(STAMP)
	$(PY) bench/inference.py
	$(PY) bench/compression.py
	$(PY) bench/failover.py
	$(PY) bench/routing.py
	$(PY) bench/partition.py
	$(PY) bench/topology.py
	$(PY) bench/gateway.py
	$(PY) bench/lora.py
	$(PY) bench/finetune.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
