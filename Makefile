# One entry point for every task. Each target installs what it needs first and is
# safe to re-run; stamps under .stamps/ make a second run fast when nothing changed.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV     ?= .venv
PY       := $(VENV)/bin/python
XLA_VENV := .venv-xla
XLA_PY   := $(XLA_VENV)/bin/python
MLFLOW_VENV := .venv-mlflow
STAMPS   ?= .stamps
CDK      := npx --no-install cdk
# The app runs in $(VENV) whatever cdk.json's "app" says (that is the plain `npx cdk` path).
CDK_APP  := --app "$(PY) app.py"
CDK_OUT  ?= cdk.out
# Context overrides for every target below, e.g. CONTEXT="-c gpuInstanceCount=2" (cdk.json is the
# place for lasting values); other CDK CLI options, e.g. CDK_ARGS=--force.
CONTEXT  ?=
CDK_ARGS ?=
PROJECT  ?= $(shell python3 -c 'import json; print(json.load(open("cdk.json"))["context"]["projectName"])')

.PHONY: help setup setup-deploy setup-xla setup-mlflow synth audit deploy teardown teardown-all demo test test-training test-rest test-platform test-xla lint clean image push-image serve-smoke wheelhouse agent-releases mirror-dcgm-image

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

# The deploy path needs Python 3.11+, Node and npm only: any OS, no sudo, no GPU stack.
setup-deploy: $(STAMPS)/venv-deploy $(STAMPS)/npm ## install what synth/audit/deploy need: the CDK app's packages (requirements-deploy.txt) + the CDK CLI

setup: $(STAMPS)/venv $(STAMPS)/npm $(STAMPS)/system ## install everything for the tests and the demo (training stack, Slurm, MariaDB, podman... on Debian/Ubuntu)

$(STAMPS)/venv-deploy: requirements-deploy.txt
	@mkdir -p $(STAMPS)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-deploy.txt
	@touch $@

$(STAMPS)/venv: requirements.txt requirements-deploy.txt training/requirements-gpu.txt
	@mkdir -p $(STAMPS)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@touch $@

$(STAMPS)/npm: package.json package-lock.json
	@mkdir -p $(STAMPS)
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

$(STAMPS)/system: scripts/install-system-packages.sh
	@mkdir -p $(STAMPS)
	bash scripts/install-system-packages.sh
	@touch $@

setup-xla: $(STAMPS)/venv-xla ## build .venv-xla (torch 2.9 + torch-xla 2.9, CPU PJRT) for the Trainium tests

$(STAMPS)/venv-xla: training/requirements-xla-test.txt training/requirements-neuron.txt
	@mkdir -p $(STAMPS)
	@test -x $(XLA_PY) || python3 -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install --quiet --upgrade pip
	$(XLA_PY) -m pip install --quiet -r training/requirements-xla-test.txt
	@touch $@

# The MLflow tracking server the observability tests run on loopback (tests/observability): its
# own venv, so .venv keeps only the client the training package uses (mlflow-skinny).
setup-mlflow: $(STAMPS)/venv-mlflow ## build .venv-mlflow (the MLflow server, PyPI's mlflow) for the tracking tests

$(STAMPS)/venv-mlflow: requirements-mlflow-server.txt
	@mkdir -p $(STAMPS)
	@test -x $(MLFLOW_VENV)/bin/python || python3 -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install --quiet -r requirements-mlflow-server.txt
	@touch $@

synth: setup-deploy ## cdk synth through the real CLI into cdk.out/ (offline, no credentials)
	$(CDK) synth --quiet $(CDK_APP) --output $(CDK_OUT) $(CONTEXT)

# privateNetwork=true: the nodes install their envs from these (stacks/wheelhouse.py, runbooks/deploy.md
# "Private network"); needs PyPI and Neuron's pip repository here. KINDS=gpu|neuron limits it. The
# observability agents' release archives come with them (agent-releases).
KINDS ?= gpu neuron
wheelhouse: $(STAMPS)/venv-deploy ## resolve the node envs' pins for the nodes (CPython 3.11, manylinux x86_64) into build/wheelhouse/, cached by their hash; fetch the agent releases too
	$(PY) -m stacks.wheelhouse build $(KINDS)
	$(PY) -m stacks.agent_releases build

# The observability agents of a private cluster (stacks/agent_releases.py, runbooks/private-network.md);
# needs github.com here.
agent-releases: $(STAMPS)/venv-deploy ## fetch the pinned exporter/Prometheus release archives, check their sha256, lock them into build/wheelhouse/ (cached by the pins)
	$(PY) -m stacks.agent_releases build

# A private cluster's GPU nodes pull the DCGM exporter from this account's ECR (runbooks/observability.md);
# needs nvcr.io and docker/podman/buildah here.
mirror-dcgm-image: $(STAMPS)/venv-deploy ## copy the pinned DCGM exporter image into this account's ECR (REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com)
	@test -n "$(REGISTRY)" || { echo "make mirror-dcgm-image: set REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com (storage stack output DcgmExporterRepositoryUri without the path)" >&2; exit 2; }
	$(PY) -m containers.image mirror dcgm-exporter --registry $(REGISTRY)

audit: synth ## print cdk-nag (AWS Solutions + HIPAA) and cfn-lint findings; fail on any open one
	$(PY) -m stacks.audit $(CDK_OUT)

# Deploys exactly the assembly the audit passed (runbooks/deploy.md).
deploy: audit ## audit, then cdk deploy --all of that assembly (needs AWS credentials)
	$(CDK) deploy --all --app $(CDK_OUT) --require-approval broadening $(CDK_ARGS)

# runbooks/teardown.md: what each step removes, keeps and what the kept part costs.
teardown: setup-deploy ## stop the compute bill: destroy the serving and cluster stacks; data, FSx, network and observability stay
	@if $(CDK) list $(CDK_APP) $(CONTEXT) 2>/dev/null | grep -qx '$(PROJECT)-serving'; then \
	  $(CDK) destroy $(CDK_APP) $(CONTEXT) $(PROJECT)-serving $(CDK_ARGS); fi
	$(CDK) destroy $(CDK_APP) $(CONTEXT) $(PROJECT)-cluster $(CDK_ARGS)
	$(PY) -m stacks.cost kept --after teardown $(CONTEXT)

teardown-all: teardown ## then the storage and network stacks (and observability, which depends on storage); lists what dataRemovalPolicy=retain keeps and its cost
	$(PY) -m stacks.teardown unprotect-accounting $(CONTEXT)
	$(CDK) destroy $(CDK_APP) $(CONTEXT) $(PROJECT)-storage $(PROJECT)-network $(CDK_ARGS)
	$(PY) -m stacks.cost kept --after teardown-all $(CONTEXT)

# setup-xla: the demo's comparison benches the Trainium backend on torch-xla's CPU device.
demo: setup audit setup-xla ## the main job locally: audit, then precompute + train + resume + export + bench + report on CPU
	$(PY) -m training.demo --out demo-output

# The whole suite as two pytest sessions side by side, one per core: the training package's
# tests (torch on the CPU most of the time) and the rest (synth, lifecycle scripts, Slurm
# daemons, the image build: mostly waiting on subprocesses) followed by the XLA suite.
# --output-sync: each half's output is printed whole when it ends. Any failure fails `make test`.
TEST_TRAINING := tests/training tests/observability tests/docs
test: setup setup-xla setup-mlflow ## the whole test suite (what CI runs)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-training test-rest

test-training: setup setup-xla setup-mlflow
	$(PY) -m pytest $(TEST_TRAINING)

test-rest: setup setup-xla
	$(PY) -m pytest tests --ignore=tests/xla $(addprefix --ignore=,$(TEST_TRAINING))
	$(XLA_PY) -m pytest tests/xla

# Everything but tests/xla in one session (setup-xla too: tests/slurm submits
# train-trainium.sbatch, which runs in .venv-xla; setup-mlflow: tests/observability runs an
# MLflow server).
test-platform: setup setup-xla setup-mlflow
	$(PY) -m pytest tests --ignore=tests/xla

test-xla: setup setup-xla
	$(XLA_PY) -m pytest tests/xla

lint: setup ## ruff + shellcheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/shellcheck lifecycle_scripts/*.sh training/slurm/*.sh training/slurm/*.sbatch scripts/*.sh .ci/run

# On an inf2/trn host, in the Neuron env (PY=<that env's python>): compile a tiny Sana with
# torch-neuronx, serve it through the SageMaker handler, compare with CPU, time it
# (runbooks/serving.md). Elsewhere it stops in one line; --target cpu runs the same steps.
serve-smoke: ## on an inf2/trn host: compile a tiny Sana for Neuron, serve and time it (PY=neuron env python)
	$(PY) -m training.serve.smoke

# Training images (runbooks/containers.md). IMAGE=gpu|neuron; BASE=<image> overrides the
# Dockerfile's base; EFA=1 reinstalls EFA over the GPU base's (default: the DLC's matched stack, kept); the builder is detected (docker with
# a daemon, podman, buildah) or SANA_IMAGE_BUILDER. Tag: <package hash>-<recipe hash>.
IMAGE ?= gpu
image: $(STAMPS)/venv-deploy ## build the training image (IMAGE=gpu|neuron, BASE=..., EFA=1) with docker/podman/buildah
	$(PY) -m containers.image build $(IMAGE) $(if $(BASE),--base $(BASE)) $(if $(filter 1,$(EFA)),--efa)

push-image: $(STAMPS)/venv-deploy ## push the built image to its ECR repository (REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com)
	@test -n "$(REGISTRY)" || { echo "make push-image: set REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com (storage stack output GpuImageRepositoryUri without the path)" >&2; exit 2; }
	$(PY) -m containers.image push $(IMAGE) --registry $(REGISTRY) $(if $(BASE),--base $(BASE)) $(if $(filter 1,$(EFA)),--efa)

clean: ## remove build outputs (keeps the virtual envs)
	rm -rf cdk.out demo-output .pytest_cache
