# fuzz/asan.mk: the test suite under AddressSanitizer + UndefinedBehaviorSanitizer, and
# valgrind; included by the main Makefile. docs/ROBUSTNESS.md has the figures.
#
#   make test-asan   builds every object, the unit-test binaries, ./run and the fuzz
#                    harnesses' replay drivers into build-asan/ (gcc, -O1, ASan + UBSan,
#                    any report is fatal), then runs the cmocka tests, replays the fuzz
#                    seeds and fuzz/regressions/, and runs the pytest suite against
#                    build-asan/run (tests/conftest.py reads RUN_BINARY)
#   make valgrind    fuzz/valgrind.sh: full generations under memcheck, with and without --kv
#
# ASAN_PYTEST_ARGS picks pytest tests (default: all of tests/), e.g.
#   make test-asan ASAN_PYTEST_ARGS=tests/test_cli.py
ASAN_B = build-asan
ASAN_SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
ASAN_CFLAGS = -O1 -g $(ARCH) $(ASAN_SAN) -std=c11 -D_POSIX_C_SOURCE=200809L -I. -pthread -ffp-contract=off \
  -Wall -Wextra -Wshadow -Werror
ASAN_CXXFLAGS = -O1 -g $(ASAN_SAN) -std=c++17 -I. -Wall -Wextra -Werror
ASAN_OBJS = $(ENGINE:%.c=$(ASAN_B)/%.o) $(ASAN_B)/tokenizer/spm_c.o
ASAN_UNIT_BINS = $(UNIT_TESTS:%=$(ASAN_B)/tests/%)
ASAN_REPLAYS = $(FUZZ_HARNESSES:%=$(ASAN_B)/fuzz/replay_%)
ASAN_PYTEST_ARGS ?= tests
# Leaks are errors, with no suppression: libgomp reports none (checked with 1, 2 and 4 threads).
# Stack use after return is checked on AVX2 and portable builds only: with it, ASan moves
# locals to a "fake stack" whose slots GCC 12 aligns to 32 bytes, and an AVX-512 build's
# 64-byte __m512 spills there (vmovaps) then fault in correct code (seen in
# test_exp_nonpositive at -O1 on a Zen 5 EPYC; the same binary passes without the option).
# (Expanded only by test-asan's recipe, so other targets never run the probe.)
ASAN_UAR = $(shell $(CC) $(ARCH) -dM -E - </dev/null 2>/dev/null | grep -q __AVX512F__ && echo 0 || echo 1)
ASAN_ENV = ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=$(ASAN_UAR) \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: test-asan valgrind
.SECONDARY: $(ASAN_OBJS) $(ASAN_B)/tests/spm_c_hooks.o $(ASAN_B)/run.o $(ASAN_B)/fuzz/replay.o $(ASAN_B)/fuzz/tokenizer_checks.o \
  $(FUZZ_HARNESSES:%=$(ASAN_B)/fuzz/fuzz_%.o)

$(ASAN_B)/%.o: %.c $(HEADERS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_CFLAGS) -c $< -o $@

$(ASAN_B)/serve/version.o: ASAN_CFLAGS += $(COMMIT_FLAG)
$(ASAN_B)/serve/version.o: $(B)/git-commit

$(ASAN_B)/tokenizer/spm_c.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h
	@mkdir -p $(@D)
	$(CXX) $(ASAN_CXXFLAGS) -c $< -o $@

$(ASAN_B)/run: $(ASAN_B)/run.o $(ASAN_OBJS)
	$(CXX) -pthread $(ASAN_SAN) $^ -o $@ $(LDLIBS)

$(ASAN_B)/tests/%.o: tests/%.c tests/testutil.h $(HEADERS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_CFLAGS) -I. -Wno-unused-parameter -c $< -o $@

ASAN_TEST_OBJS = $(filter-out $(ASAN_B)/tokenizer/spm_c.o,$(ASAN_OBJS)) $(ASAN_B)/tests/spm_c_hooks.o
$(ASAN_B)/tests/spm_c_hooks.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h
	@mkdir -p $(@D)
	$(CXX) $(ASAN_CXXFLAGS) -DSPM_TEST_HOOKS -c $< -o $@

$(ASAN_B)/tests/test_%: $(ASAN_B)/tests/test_%.o $(ASAN_B)/tests/testutil.o $(ASAN_TEST_OBJS)
	$(CXX) -pthread $(ASAN_SAN) $^ -o $@ $(LDLIBS) -lcmocka

# the fuzz harnesses with fuzz/replay.c's main() instead of libFuzzer
$(ASAN_B)/fuzz/%.o: fuzz/%.c fuzz/tokenizer_checks.h $(HEADERS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_CFLAGS) -I. -DFUZZ_TINY_MODEL='"$(CURDIR)/$(TINY_TOKENIZER)"' \
	  -DFUZZ_REAL_MODEL='"$(CURDIR)/$(REAL_TOKENIZER)"' -c $< -o $@

$(ASAN_B)/fuzz/replay_%: $(ASAN_B)/fuzz/replay.o $(ASAN_B)/fuzz/fuzz_%.o $(ASAN_B)/fuzz/tokenizer_checks.o $(ASAN_TEST_OBJS)
	$(CXX) -pthread $(ASAN_SAN) $^ -o $@ $(LDLIBS)

test-asan: $(ASAN_B)/run build/roofline $(ASAN_UNIT_BINS) $(ASAN_REPLAYS) $(TINY_TOKENIZER) fuzz-seeds
	@set -e; for t in $(UNIT_TESTS); do echo "== asan $$t"; $(ASAN_ENV) $(ASAN_B)/tests/$$t $(TINY_TOKENIZER); done
	@set -e; for h in $(FUZZ_HARNESSES); do echo "== asan replay $$h"; \
	  $(ASAN_ENV) $(ASAN_B)/fuzz/replay_$$h $(FUZZ_B)/seeds-$$h $$(ls -d fuzz/regressions/$$h 2>/dev/null); done
	$(ASAN_ENV) OMP_NUM_THREADS=2 RUN_BINARY=$(CURDIR)/$(ASAN_B)/run $(PYTHON) -m pytest -q $(ASAN_PYTEST_ARGS)

valgrind: $(VG_B)/run
	fuzz/valgrind.sh

# ./run for valgrind: memcheck knows no AVX-512, so this build stops at AVX2 + FMA.
VG_B = build-valgrind
VG_CFLAGS = -O2 -g -mavx2 -mfma -std=c11 -D_POSIX_C_SOURCE=200809L -I. -pthread -ffp-contract=off -Wall -Wextra -Wshadow -Werror
VG_OBJS = $(ENGINE:%.c=$(VG_B)/%.o) $(VG_B)/tokenizer/spm_c.o
.SECONDARY: $(VG_OBJS) $(VG_B)/run.o

$(VG_B)/%.o: %.c $(HEADERS)
	@mkdir -p $(@D)
	$(CC) $(VG_CFLAGS) -c $< -o $@

$(VG_B)/tokenizer/spm_c.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h
	@mkdir -p $(@D)
	$(CXX) -O2 -g -std=c++17 -I. -Wall -Wextra -Werror -c $< -o $@

$(VG_B)/run: $(VG_B)/run.o $(VG_OBJS)
	$(CXX) -pthread $^ -o $@ $(LDLIBS)

.PHONY: clean-sanitizers
clean-sanitizers:
	rm -rf $(ASAN_B) $(VG_B)
clean: clean-sanitizers
