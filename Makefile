# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Each creates .venv and installs what it needs: the pinned CPU torch wheel first, then the package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ZOO ?= zoo
BUNDLE ?= bundles/tiny-small
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench bench-scale llama-src llama-tools serve-bundle serve-bench serve-bench-triton clean triton-env gpu-carry zoo-seeds \
	zoo zoo-release zoo-release-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[onnx,triton,bench,serve,data,dev]"
	touch $(STAMP)

venv: $(STAMP)

# Main job on the embedded default: install the trained tiny model pair that ships (hash-checked), compile an
# ONNX Runtime (CPU) engine bundle, generate with ReTrace from it, and print tau against DFlash.
demo: $(STAMP)
	$(BIN)/retrace zoo tiny --out $(ZOO) --size small
	$(BIN)/retrace-export build --target $(ZOO)/target --drafter $(ZOO)/drafter --out $(BUNDLE) --force
	$(BIN)/retrace generate --engine $(BUNDLE) --prompt "def parse_args(argv):" --max-new-tokens 96 --mode retrace
	$(BIN)/retrace eval --target $(ZOO)/target --drafter $(ZOO)/drafter --prompts $(ZOO)/prompts/code.jsonl --max-new-tokens 64 --limit 32

lint: $(STAMP)
	$(BIN)/ruff check retrace tests benchmarks

# tritonserver 2.51 (from nvidia-pytriton) + the model's numpy<2 env, built once and cached (~1-3 min)
triton-env: $(STAMP)
	PYTHON=$(BIN)/python scripts/triton_env.sh

test: $(STAMP)
	$(BIN)/ruff check retrace tests benchmarks
	PYTHON=$(BIN)/python scripts/triton_env.sh
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations=15

bench: $(STAMP)
	$(BIN)/retrace zoo tiny --out $(ZOO) --size small
	$(BIN)/retrace zoo draft-ar --from $(ZOO) --quiet
	$(BIN)/retrace bench --target $(ZOO)/target --drafter $(ZOO)/drafter --prompts $(ZOO)/prompts --batch-sizes 1,8 --runs 3 --limit 16 --max-new-tokens 128 --threads 1 --json bench-out/bench.json --plot bench-out/bench.png --profile bench-out/retrace.prof --markdown bench-out/bench.md --readme-table

# The deployment-shape benchmark: the zoo pair inflated function-preservingly to Qwen3-0.6B's shape (real
# compute and memory traffic, the zoo's acceptance), its ONNX Runtime bundle, every system at batch 1 and 4.
# The precision axis (SCALE_WEIGHTS): our int4 / int8 bundles (retrace-export build --weights, built into the
# bench cache), onnxruntime-genai's int4 / int8 builder models and llama.cpp's Q4_K_M / Q8_0 (llama-cpp-python;
# its converter from LLAMA_CPP_SRC, see retrace/bench/llamacpp_peers.py) beside the fp32 systems.
LLAMA_SRC_DIR ?= .cache/llama-cpp-src
SCALE_ZOO ?= zoo-qwen3-0.6b
SCALE_BUNDLE ?= bundles/qwen3-0.6b
SCALE_WEIGHTS ?= fp32,int8,int4,w8a8
bench-scale: $(STAMP)
	$(BIN)/retrace zoo tiny --out $(ZOO) --size small
	$(BIN)/retrace zoo draft-ar --from $(ZOO) --quiet
	$(BIN)/retrace zoo inflate --from $(ZOO) --out $(SCALE_ZOO) --shape qwen3-0.6b --quiet
	$(MAKE) llama-src || echo "no llama.cpp converter: the llama.cpp rows will say why"
	$(MAKE) llama-tools || echo "no llama-server: the llama.cpp speculative rows will say why"
	test -f $(SCALE_BUNDLE)/manifest.json || $(BIN)/retrace-export build --target $(SCALE_ZOO)/target --drafter $(SCALE_ZOO)/drafter --out $(SCALE_BUNDLE) --max-batch 4 --max-seq-len 512
	$(BIN)/retrace bench --target $(SCALE_ZOO)/target --drafter $(SCALE_ZOO)/drafter --engine $(SCALE_BUNDLE) --draft-ar $(ZOO)/draft-ar --prompts $(SCALE_ZOO)/prompts --batch-sizes 1,4 --runs 1 --limit 32 --max-new-tokens 96 --threads 2 --peer-env defaults --prompt-lookup --weights $(SCALE_WEIGHTS) --json bench-out/scale.json --plot bench-out/scale.png --markdown bench-out/scale.md --readme-table

# llama.cpp's converter for the bench's llama.cpp peers (convert_hf_to_gguf.py + gguf-py): the vendor/llama.cpp of the
# installed llama-cpp-python's source distribution (PyPI, ~75 MB), unpacked once into $(LLAMA_SRC_DIR), where
# retrace/bench/llamacpp_peers.py looks when LLAMA_CPP_SRC is unset. Not needed by `make test` (its tests skip).
LLAMA_CPP_VERSION ?= 0.3.36
llama-src: $(STAMP)
	test -f $(LLAMA_SRC_DIR)/vendor/llama.cpp/convert_hf_to_gguf.py || ( set -e; \
	  V=$$($(BIN)/python -c "import llama_cpp; print(llama_cpp.__version__)" 2>/dev/null || echo $(LLAMA_CPP_VERSION)); \
	  mkdir -p $(LLAMA_SRC_DIR); \
	  $(BIN)/pip download -q --no-deps --no-binary :all: -d $(LLAMA_SRC_DIR) llama-cpp-python==$$V; \
	  tar xzf $(LLAMA_SRC_DIR)/llama_cpp_python-$$V.tar.gz -C $(LLAMA_SRC_DIR) --strip-components=1 )

# llama.cpp's own tools from that source, for the bench's llama-server peers (retrace/bench/llamacpp_server.py:
# its DFlash mode with our drafter, a draft model): llama-server and llama-quantize in $(LLAMA_BUILD_DIR)/bin
# (~6 min on 2 cores, once). Native ISA without AMX: llama.cpp's AMX kernels crash on quantized matmuls on
# some Xeons (llama.cpp issue 20824). Not needed by `make test` (its tests skip without them).
LLAMA_BUILD_DIR ?= .cache/llama-cpp-build
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-tools: llama-src
	test -x $(LLAMA_BUILD_DIR)/bin/llama-server -a -x $(LLAMA_BUILD_DIR)/bin/llama-quantize || ( set -e; \
	  cmake -S $(LLAMA_SRC_DIR)/vendor/llama.cpp -B $(LLAMA_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	    -DCMAKE_C_FLAGS="$(LLAMA_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_NO_AMX)" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	    -DLLAMA_BUILD_TESTS=OFF > /dev/null; \
	  cmake --build $(LLAMA_BUILD_DIR) -j$$(nproc) --target llama-server llama-quantize )

# Servers under load (benchmarks, not in CI), on a bundle of the zoo pair (built once):
#  serve-bench: `retrace serve` under AIPerf (in its own venv: its pins are not the project's), OpenAI
#    endpoints chat and completions, streaming, concurrency 1, 4, 16 -> bench-out/serve.md.
#    AIPERF= (empty) uses the built-in asyncio load generator instead.
#  serve-bench-triton: the Triton model under genai-perf (kserve, gRPC streaming), concurrency 1, 4, 16 ->
#    bench-out/serve-triton.md. genai-perf in its own venv (GENAI_PERF; install: benchmarks/serve_bench_triton.py).
SERVE_BUNDLE ?= bundles/zoo-small-serve
AIPERF_VENV ?= .venv-aiperf
AIPERF ?= $(AIPERF_VENV)/bin/aiperf
SERVE_CONVENTION ?= tensorrtllm
GENAI_PERF ?= /tmp/bench-venv/bin/genai-perf
SERVE_PROMPTS ?=
serve-bundle: $(STAMP)
	$(BIN)/retrace zoo tiny --out $(ZOO) --size small
	test -f $(SERVE_BUNDLE)/manifest.json || $(BIN)/retrace-export build --target $(ZOO)/target --drafter $(ZOO)/drafter --out $(SERVE_BUNDLE) --max-batch 16 --max-seq-len 512

serve-bench: serve-bundle
	test -z "$(AIPERF)" || test -x $(AIPERF) || ($(PY) -m venv $(AIPERF_VENV) && $(AIPERF_VENV)/bin/pip install -q aiperf)
	$(BIN)/python -m benchmarks.serve_bench --engine $(SERVE_BUNDLE) --prompts $(ZOO)/prompts --out bench-out/serve $(if $(AIPERF),--aiperf $(AIPERF))

serve-bench-triton: serve-bundle
	PYTHON=$(BIN)/python scripts/triton_env.sh
	$(BIN)/python -m benchmarks.serve_bench_triton --bundle $(SERVE_BUNDLE) --convention $(SERVE_CONVENTION) --genai-perf $(GENAI_PERF) --concurrency 1,4,16 $(if $(SERVE_PROMPTS),--prompts $(SERVE_PROMPTS)) --out bench-out/serve-triton.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# What the coordinator carries to a lent GPU machine for scripts/gpu_check.sh (both git-ignored):
# gpu-carry/ (test-size zoo pair + its CPU greedy reference) and .whl/ (transformers 5.23 + fallbacks).
gpu-carry: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu_carry.sh

# The zoo's figures over 3 seeds (portable numerics; each seed cached under zoo-seeds/seed-N): the spread the
# docs/bench/zoo.md gives. About 3x one `make demo` zoo build.
zoo-seeds: $(STAMP)
	$(BIN)/python benchmarks/zoo_seeds.py --size small --seeds 0,1,2 --root zoo-seeds --json bench-out/zoo-seeds.json --markdown bench-out/zoo-seeds.md --plot bench-out/zoo-seeds.png

# The zoo from scratch (portable numerics, 25-50 min on 2 cores) instead of the shipped one; zoo-release makes a
# fresh build the shipped release (retrace/train/shipped/, after a recipe change); zoo-release-check retrains and
# compares the bytes with what ships (benchmarks/zoo_release_check.py).
zoo: $(STAMP)
	$(BIN)/retrace zoo tiny --train --out $(ZOO) --size small --threads 1

ZOO_RELEASE_BUILD ?= .zoo-release-build
zoo-release: $(STAMP)
	$(BIN)/retrace zoo tiny --train --force --out $(ZOO_RELEASE_BUILD) --size small --seed 0 --threads 1
	$(BIN)/python -m retrace.train.zoo_release $(ZOO_RELEASE_BUILD) "retrace zoo tiny --train --size small --seed 0 --threads 1 --numerics portable"

zoo-release-check: $(STAMP)
	$(BIN)/python benchmarks/zoo_release_check.py --size small --seed 0 --out zoo-release-check --json bench-out/zoo-release-check.json
