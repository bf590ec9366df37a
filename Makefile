# chatmesh: `make run` starts the whole mesh on 127.0.0.1; `make test` runs every test.
# Both provision everything they need first (idempotent), so they work on a fresh clone.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.provisioned

.PHONY: setup run test lint typecheck helm-lint protos check-protos protos-baseline bench chaos clean help token

help:
	@echo "make run      start the local mesh on 127.0.0.1 and print the URL"
	@echo "make test     provision and run every test"
	@echo "make lint     ruff + mypy + buf lint + buf breaking + helm-lint"
	@echo "make protos   regenerate Python code from protos/"
	@echo "make bench    run the benchmarks in bench/"
	@echo "make chaos    kill, stop, pause and slow every component under load (ARGS=\"--repeat 2\")"
	@echo "make token    print a dev JWT (make token USER=alice TIER=pro; ROLE=operator opens /ops)"

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/provision.sh scripts/provision_helm.sh localmesh/cassandra/pom.xml tests/support/oidc_provider/package-lock.json
	@scripts/provision.sh
	@touch $@

run: setup
	$(PY) -m localmesh.mesh $(ARGS)

test: setup check-protos typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/buf lint
	@# Against the last release's contract; buf.yaml's ignore_only lets the removal of the internal
	@# per-request Generate RPCs through until the next baseline (CONTRIBUTING.md, "Protos and buf breaking").
	$(VENV)/bin/buf breaking --against protos/baseline.binpb
	$(PY) -m localmesh.front_door
	@$(MAKE) --no-print-directory helm-lint

# mypy over every package (pyproject.toml [tool.mypy]): private calls across mixins and protocol drift.
typecheck: setup
	$(VENV)/bin/mypy

# The Helm chart: lint --strict, and render it with the test values (tests/helm checks what it renders).
HELM := .cache/helm/helm
HELM_REQUIRED := --set 'cassandra.contactPoints[0]=cassandra' --set envoy.jwt.existingSecret=jwks
helm-lint: setup
	$(HELM) lint --strict helm/chatmesh $(HELM_REQUIRED)
	$(HELM) lint --strict helm/chatmesh -f tests/helm/values-full.yaml
	$(HELM) lint --strict helm/chatmesh -f tests/helm/values-gpu.yaml
	$(HELM) lint --strict helm/chatmesh -f helm/chatmesh/values-seeds-scale.yaml

protos: setup
	@PY=$(PY) scripts/gen_protos.sh

# Fails when the generated code in the tree differs from what the .proto files produce.
check-protos: setup
	@PY=$(PY) scripts/gen_protos.sh --check

# Records the current protos as the baseline that `buf breaking` compares against (at each release);
# buf.yaml's `breaking.ignore_only` exemption goes in the same commit.
protos-baseline: setup
	$(VENV)/bin/buf build -o protos/baseline.binpb

# A signed dev JWT that the local Envoy accepts (keys are made on first use in .cache/dev-jwt/).
# Only the token goes to stdout, so TOKEN=$$(make -s token) works even when setup has work to do.
# USER defaults to the login name; where none is set (containers, CI), to alice. ROLE=operator: a token
# for the operations page (/ops).
TIER ?= pro
ROLE ?=
token:
	@$(MAKE) --no-print-directory setup >&2
	@$(PY) -m localmesh.dev_jwt --user "$(or $(USER),alice)" --tier "$(TIER)" --role "$(ROLE)"

# Benchmarks take the machine-wide lock so two never run at once on a shared box.
bench: setup $(VENV)/.bench-provisioned
	@ls bench/*.py >/dev/null 2>&1 && for b in bench/bench_*.py; do flock /tmp/chatmesh-bench.lock $(PY) $$b || exit 1; done

# The chaos suite: faults of every component under a chat load on the multi-replica local mesh
# (bench/chaos.py --help for ARGS); prints the table per fault kind, writes .run/chaos/result.json.
chaos: setup
	flock /tmp/chatmesh-bench.lock $(PY) bench/chaos.py $(ARGS)

$(VENV)/.bench-provisioned: $(STAMP) scripts/provision_bench.sh
	@scripts/provision_bench.sh
	@touch $@

clean:
	rm -rf .run .pytest_cache .ruff_cache
