# The two set-up commands: `make demo` (the main job) and `make test` (every test). Both work from a
# clean clone on a fresh machine: they install what they need first (scripts/setup_env.sh).
PY := .venv/bin/python
RUN := PYTHONPATH=$(CURDIR) $(PY)

.PHONY: demo simulate test env build test-cpp test-cpp-arm test-py test-stubs bench wheel-check clean

# The main job: the reference engine chats with SmolLM2-135M-Instruct (its GGUF file; CUDA when available).
demo: build
	$(RUN) -m pagedkv.demo

# Block-manager-only serving simulation (no model).
simulate: build
	$(RUN) -m pagedkv.demo.simulate

# make test and the wheel compile the CUDA kernels wherever a toolkit is (no GPU needed), so CI proves
# they build; make demo / make build compile them only when a GPU is visible (scripts/build.sh).
test: export PAGEDKV_CUDA ?= auto
test: build test-cpp test-cpp-arm test-stubs test-py

env:
	scripts/setup_env.sh

build: env
	PY=$(PY) scripts/build.sh

# C++ core, the CPU attention kernels (tests/cpu_kernels) and the CUDA kernels on the CPU emulator
# (tests/cuda_emu), under AddressSanitizer + UndefinedBehaviorSanitizer. The kernel tests need torch's c10
# headers (no libtorch).
TORCH_INCLUDES = $(shell $(PY) -c "from torch.utils.cpp_extension import include_paths; print(';'.join(include_paths()))" 2>/dev/null)
test-cpp: env
	cmake -S . -B build/cpp-asan -G Ninja -DPAGEDKV_SANITIZE=ON -DCMAKE_MAKE_PROGRAM=$(CURDIR)/.venv/bin/ninja \
	  "-DPAGEDKV_TORCH_INCLUDE_DIRS=$(TORCH_INCLUDES)" >/dev/null
	cmake --build build/cpp-asan
	ctest --test-dir build/cpp-asan --output-on-failure

# The CPU attention kernels' Arm copies (NEON, NEON BF16, SVE at vector lengths of 128 to 2048 bits),
# cross-compiled for aarch64 and run under qemu-user against the same float64 reference, and the copy chosen
# on qemu's CPU models with and without SVE / BF16 (x86-64 hosts: scripts/setup_env.sh installs
# g++-aarch64-linux-gnu and qemu-user; on an aarch64 host test-cpp runs the copies this CPU has natively).
test-cpp-arm: env
	@if [ "$$(uname -m)" != x86_64 ] || ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
	  echo "test-cpp-arm: skipped (needs an x86-64 host with g++-aarch64-linux-gnu and qemu-user)"; \
	else \
	  cmake -S . -B build/cpp-aarch64 -G Ninja -DCMAKE_MAKE_PROGRAM=$(CURDIR)/.venv/bin/ninja \
	    -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/cmake/aarch64-linux-gnu.cmake -DPAGEDKV_CPU_KERNELS_ONLY=ON \
	    "-DPAGEDKV_TORCH_INCLUDE_DIRS=$(TORCH_INCLUDES)" >/dev/null && \
	  cmake --build build/cpp-aarch64 && \
	  ctest --test-dir build/cpp-aarch64 --output-on-failure; \
	fi

test-py: build
	$(RUN) -m pytest tests

# The type stub pagedkv/_C.pyi against the built module: every member, and only those (mypy's stubtest).
test-stubs: build
	$(RUN) -m mypy.stubtest pagedkv._C

bench: build
	$(RUN) benchmarks/bench_block_manager.py
	$(RUN) benchmarks/bench_attention.py
	$(RUN) benchmarks/bench_cache_ops.py
	$(RUN) benchmarks/bench_engine.py

# One wheel, checked as installed (about ten minutes after the build on two cores; scripts/wheel_check.sh):
# its libraries' NEEDED, ldd and auditwheel, then fresh venvs with a CPU-only torch 2.13, the building
# torch (with the [engine] extra and the demo) and torch 2.15 run the op, block-manager and tier tests
# from site-packages. Every leg must run (WHEEL_CHECK_STRICT=1).
wheel-check: export PAGEDKV_CUDA ?= auto
wheel-check: build
	PY=$(PY) WHEEL_CHECK_STRICT=1 scripts/wheel_check.sh

clean:
	rm -rf build dist pagedkv/*.so
