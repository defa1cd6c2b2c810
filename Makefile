# Every target that runs Python builds .venv first and installs through constraints.txt, so a fresh
# machine with Python 3.11 needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install sysdeps demo test test-slow trained-model lint bench clean deploy-wheels deploy-base deploy-image \
	deploy-prometheus deploy-check

$(STAMP): pyproject.toml setup.py constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[dev,quant,topology,gateway,plots,ckks]"
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
# ruff's S101 keeps `assert` out of the package (a check that `python -O` strips is no check)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tests/support/layout.py

# PYTHONNODEBUGRANGES: Python 3.11 parses source with `ast` to underline tracebacks, and two threads doing so at
# once (the test's swarm threads log failures of killed peers) corrupt a shared counter: "SystemError: AST
# constructor recursion depth mismatch" in whatever parses next, pytest's own reporting included.
TEST_ENV := PYTHONNODEBUGRANGES=1

HOSTILE_TESTS := tests/swarm/test_bad_input.py tests/swarm/test_hostile_dht.py tests/swarm/test_hostile_lanes.py \
	tests/swarm/test_hostile_decoding.py tests/swarm/test_hostile_training.py tests/unit/test_messages.py \
	tests/unit/test_tensors.py tests/unit/test_dht_validation.py tests/unit/test_answer_bounds.py

# `make test` runs in passes. First every test but those marked `serial`, in TEST_WORKERS pytest-xdist workers, each
# given whole test files (their module-scoped swarms stay in one worker); then the `serial` ones alone: they measure
# time or throughput (recovery bounds, link measurements, a shaped link's speed-up), which another worker's load
# would skew. On 2 cores `make test` takes about 35 minutes this way (lint 0.3, the trained model 2-3 where none is
# cached, parallel pass 23-25, serial 7-8, `-O` about 2 in both workers). The parallel pass keeps both cores busy and its files are
# spread evenly (longest-first order would end it no sooner): its time is the work of the real peers it starts, over
# 500 p2pd daemons (over 600 CPU-seconds) and the `nesa-node` processes of the command-line tests (about 1000, most
# of it importing torch, transformers and hivemind). TEST_WORKERS=0: one process for all.
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# the trained tiny model of the accuracy and LoRA tests (tests/conftest.py `trained_model`), trained before pytest
# when this machine has none cached (2 to 3 minutes on 2 cores): inside a test it would count against that test's
# timeout, and a worker training it while the other runs tests can take longer than that
trained-model: $(STAMP)
	$(PY) -c "from nesa_node.devtools.tiny_train import train_tiny_model; print(train_tiny_model(progress=False).path)"

test: $(STAMP) sysdeps lint trained-model
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_WORKERS) -m "not slow and not serial" tests
	$(TEST_ENV) $(PY) -m pytest -q -m "serial and not slow" tests
	# bad input from peers (RELIABILITY.md D, G) again with asserts stripped; `make lint` keeps them out of the package
	$(TEST_ENV) $(PY) -O -m pytest -q $(PYTEST_WORKERS) $(HOSTILE_TESTS)

test-slow: $(STAMP) sysdeps
	$(TEST_ENV) $(PY) -m pytest -q -m slow tests

bench: $(STAMP)
	$(PY) bench/inference.py
	$(PY) bench/batch_pass.py
	$(PY) bench/compression.py
	$(PY) bench/failover.py
	$(PY) bench/routing.py
	$(PY) bench/partition.py
	$(PY) bench/topology.py
	$(PY) bench/gateway.py
	$(PY) bench/lora.py
	$(PY) bench/finetune.py

# deploy/: the container image and the compose swarm. Not part of `make test`: they need docker (a daemon and
# compose v2), and root for the base image (debootstrap). The image build needs no network: deploy-wheels builds
# every wheel on this machine first, through constraints.txt, into build/deploy/ (the only part of the tree in the
# build context, .dockerignore). DEPLOY_VARIANT=cuda: torch from PyPI as published for Linux (CUDA builds; the
# local pip configuration, whose find-links may hold a CPU build, is ignored) and the quant extra.
DEPLOY_VARIANT ?= cpu
DEPLOY_BASE_IMAGE ?= nesa-node-base:bookworm
DEPLOY_IMAGE ?= nesa-node:$(DEPLOY_VARIANT)
DEPLOY_PROMETHEUS_IMAGE ?= nesa-node-prometheus:bookworm
DEPLOY_BUILD := build/deploy
ifeq ($(DEPLOY_VARIANT),cuda)
DEPLOY_PIP_ENV := PIP_CONFIG_FILE=/dev/null
DEPLOY_EXTRAS := gateway,topology,quant
else
DEPLOY_PIP_ENV :=
DEPLOY_EXTRAS := gateway,topology
endif

deploy-wheels: $(STAMP)
	@echo "wheels ($(DEPLOY_VARIANT)) into $(DEPLOY_BUILD)"
	rm -rf $(DEPLOY_BUILD)/wheels-$(DEPLOY_VARIANT) $(DEPLOY_BUILD)/project build/lib build/bdist.*
	$(DEPLOY_PIP_ENV) $(PIP) wheel -q -q -c constraints.txt -w $(DEPLOY_BUILD)/wheels-$(DEPLOY_VARIANT) \
		torch==2.13.0 ".[$(DEPLOY_EXTRAS)]"
	# setuptools builds the project's wheel in build/lib: drop it, so a removed module never reaches the next wheel
	rm -rf build/lib build/bdist.*
	mkdir -p $(DEPLOY_BUILD)/project
	mv $(DEPLOY_BUILD)/wheels-$(DEPLOY_VARIANT)/nesa_node-*.whl $(DEPLOY_BUILD)/project/

deploy-base:
	deploy/base-image.sh $(DEPLOY_BASE_IMAGE)

# --network none: the build reaches nothing, its wheels are all in the context
deploy-image: deploy-wheels deploy-base
	docker build -q --network none -f deploy/Dockerfile --build-arg BASE_IMAGE=$(DEPLOY_BASE_IMAGE) \
		--build-arg VARIANT=$(DEPLOY_VARIANT) -t $(DEPLOY_IMAGE) .
	@docker image ls $(DEPLOY_IMAGE)

# its build installs Debian's prometheus package: the one image build that reaches Debian's mirror
deploy-prometheus: deploy-base
	@docker image inspect $(DEPLOY_PROMETHEUS_IMAGE) >/dev/null 2>&1 || \
		docker build -q --network host -f deploy/prometheus.Dockerfile --build-arg BASE_IMAGE=$(DEPLOY_BASE_IMAGE) \
		-t $(DEPLOY_PROMETHEUS_IMAGE) deploy

# the compose swarm end to end (deploy/check.py): healthy within 120 s, the reference tokens through the gateway, a
# node killed mid-stream, peer ids kept across down and up; it removes the containers and volumes it made
deploy-check: deploy-image deploy-prometheus
	$(PY) deploy/check.py --image $(DEPLOY_IMAGE) --prometheus-image $(DEPLOY_PROMETHEUS_IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
