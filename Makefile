# The engine is C11; only spm_c.cc (the SentencePiece wrapper) is C++.
#   make            builds ./run
#   make test       unit tests (cmocka) and parity/integration tests (pytest)
#   make bench      the latency tables (bench/README.md)
#   make test-asan  the test suite under AddressSanitizer + UBSan
#   make test-tsan  the threaded modes under ThreadSanitizer
#   make fuzz       libFuzzer harnesses (clang)
CC ?= gcc
CXX ?= g++
PYTHON ?= /usr/bin/python3
ARCH ?= -march=native
OPT ?= -O3
# -ffp-contract=off: every fused multiply-add is written out (simd.h), so the compiler
# never changes a reduction order behind our back.
CFLAGS ?= $(OPT) $(ARCH) -g
CFLAGS += -std=c11 -D_POSIX_C_SOURCE=200809L -I. -pthread -ffp-contract=off -Wall -Wextra -Wshadow -Werror
CXXFLAGS ?= -O2 -g
CXXFLAGS += -std=c++17 -I. -Wall -Wextra -Werror
SPM_LIBS := $(shell pkg-config --libs sentencepiece 2>/dev/null || echo -lsentencepiece)
LDLIBS = $(SPM_LIBS) -lm
B = build

# the layers, from the bottom: kernels/ (kernels, SIMD, threads, file helpers, UTF-8); the model
# (model, attention, kvcache, loader); serve/ (scheduler, sampler, the modes, the command
# line, output); tokenizer/ on the side; run.c on top.
KERNELS = kernels/kernels.c kernels/threads.c kernels/fileio.c kernels/utf8.c
MODEL = model.c attention.c kvcache.c kvtier.c loader.c shape.c
SERVE = serve/scheduler.c serve/sampler.c serve/session.c serve/generate.c serve/check.c serve/ppl.c serve/info.c \
  serve/cli.c serve/output.c serve/json.c serve/textfile.c serve/version.c \
  serve/profile.c serve/attn_dump.c serve/indexlist.c serve/draft.c
ENGINE = $(KERNELS) $(MODEL) $(SERVE)
ENGINE_OBJS = $(ENGINE:%.c=$(B)/%.o) $(B)/tokenizer/spm_c.o
HEADERS = $(wildcard *.h kernels/*.h serve/*.h tokenizer/*.h)

.PHONY: all test test-unit test-isa test-py bench clean demo report FORCE
all: run

$(B)/%.o: %.c $(HEADERS) | $(B)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -c $< -o $@

$(B)/tokenizer/spm_c.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h | $(B)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) -c $< -o $@

$(B):
	mkdir -p $(B)/tests

# The commit --version names: `git rev-parse --short HEAD`, with -dirty when tracked files
# differ from it, or "unknown" outside this project's own git checkout. The file is
# rewritten only when that changes, so only version.o rebuilds, and only then.
$(B)/git-commit: FORCE | $(B)
	@top=$$(git rev-parse --show-toplevel 2>/dev/null) && [ "$$(cd "$$top" && pwd -P)" = "$$(pwd -P)" ] \
	  && c=$$(git rev-parse --short HEAD 2>/dev/null) || c=unknown; \
	if [ "$$c" != unknown ] && [ -n "$$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then c=$$c-dirty; fi; \
	[ "$$(cat $@ 2>/dev/null)" = "$$c" ] || echo "$$c" > $@
COMMIT_FLAG = -DGIT_COMMIT="\"$$(cat $(B)/git-commit)\""
$(B)/serve/version.o: CFLAGS += $(COMMIT_FLAG)
$(B)/serve/version.o: $(B)/git-commit

run: $(B)/run.o $(ENGINE_OBJS)
	$(CXX) -pthread $^ -o $@ $(LDLIBS)

# ---- tests ----
UNIT_TESTS = test_kernels test_threads test_attention test_scheduler test_kvcache test_kvtier test_check test_sampler test_loader test_textfile test_tokenizer test_cli_parse test_utf8 test_shape
UNIT_BINS = $(UNIT_TESTS:%=$(B)/tests/%)

$(B)/tests/%.o: tests/%.c tests/testutil.h $(HEADERS) | $(B)
	$(CC) $(CFLAGS) -I. -Wno-unused-parameter -c $< -o $@

# The tests link the tokenizer with its test hook (SPM_TEST_HOOKS), which ./run leaves out.
TEST_ENGINE_OBJS = $(filter-out $(B)/tokenizer/spm_c.o,$(ENGINE_OBJS)) $(B)/tests/spm_c_hooks.o
$(B)/tests/spm_c_hooks.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h | $(B)
	$(CXX) $(CXXFLAGS) -DSPM_TEST_HOOKS -c $< -o $@

$(B)/tests/test_%: $(B)/tests/test_%.o $(B)/tests/testutil.o $(TEST_ENGINE_OBJS)
	$(CXX) -pthread $^ -o $@ $(LDLIBS) -lcmocka

TINY_TOKENIZER = $(B)/tests/tiny.model
$(TINY_TOKENIZER): tests/fixtures/tiny.txt | $(B)
	spm_train --input=$< --model_prefix=$(B)/tests/tiny --model_type=bpe --vocab_size=320 \
	  --byte_fallback=true --character_coverage=1.0 --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 \
	  --split_digits=true --normalization_rule_name=identity --minloglevel=2 >/dev/null 2>&1

test-unit: $(UNIT_BINS) $(TINY_TOKENIZER)
	@set -e; for t in $(UNIT_TESTS); do echo "== $$t"; $(B)/tests/$$t $(TINY_TOKENIZER); done

test-py: run build/roofline
	$(PYTHON) -m pytest -q tests

# Every kernel build must follow the same canonical order: the AVX-512, AVX2 and portable
# builds each run the kernel and attention tests (whatever this machine's -march=native
# picks). A build this CPU cannot execute (AVX-512 on an AVX2-only machine) is compiled,
# so it cannot rot unseen, and reported as not run.
ISA_BUILDS = avx512:-march=x86-64-v4:avx512bw avx2:-march=x86-64-v3:avx2 portable:-march=x86-64:
test-isa:
	@set -e; for isa in $(ISA_BUILDS); do n=$${isa%%:*}; rest=$${isa#*:}; arch=$${rest%%:*}; flag=$${rest#*:}; \
	  $(MAKE) -s B=build-$$n ARCH=$$arch build-$$n/tests/test_kernels build-$$n/tests/test_attention build-$$n/tests/tiny.model; \
	  if [ -n "$$flag" ] && ! grep -qw "$$flag" /proc/cpuinfo; then echo "== $$n: built; not run, this CPU has no $$flag"; continue; fi; \
	  for t in test_kernels test_attention; do echo "== $$t ($$n)"; build-$$n/tests/$$t build-$$n/tests/tiny.model; done; done

test: test-unit test-isa test-py

clean:
	rm -rf $(B) build-avx512 build-avx2 build-portable run

# The README's first command ends here: the GQA demo, or a plain word on what weights/ holds.
DEMO_PROMPT ?= Once upon a time
demo: run
	@if [ -f weights/gqa.bin ]; then ./run weights/gqa.bin -p "$(DEMO_PROMPT)" --kv; \
	else first=$$(ls weights/*.bin 2>/dev/null | head -n 1); \
	  if [ -z "$$first" ]; then echo "demo: weights/ is empty: no trained checkpoint yet (weights/README.md says how to train one)."; \
	  else echo "demo: weights/gqa.bin is not trained yet; running $$first instead."; ./run $$first -p "$(DEMO_PROMPT)" --kv; fi; fi

# make fuzz, make test-asan, make test-tsan, make valgrind (docs/ROBUSTNESS.md)
include fuzz/fuzz.mk fuzz/asan.mk fuzz/tsan.mk
include bench/bench.mk

# One page of the five variants on one prompt (the gqa run's steps, every variant's heads
# side by side) and a --prompts run's pool: build/report.html, self-contained.
R := build/report
report: run build/roofline
	@mkdir -p $(R)
	build/roofline --mib 64 --reps 3 --flop-seconds 0.05 > $(R)/roofline.txt
	for v in mha gqa mqa mla64 mla128; do \
	  ./run weights/$$v.bin -p "Once upon a time" -k 1 -n 60 --kv -q --json --profile \
	    --profile-peaks $(R)/roofline.txt --log $(R)/$$v.csv --dump-attn $(R)/$$v.attn \
	    --dump-attn-layers 0 > $(R)/$$v.json || exit 1; done
	./run weights/gqa.bin --prompts docs/prompts.txt --batch 3 -n 40 --kv -q --json --profile \
	  --log $(R)/pool.csv > $(R)/pool.json
	$(PYTHON) tools/report.py --json $(R)/gqa.json --log $(R)/gqa.csv --pool-log $(R)/pool.csv \
	  --pool-title "gqa, docs/prompts.txt through 3 slots" \
	  $(foreach v,mha gqa mqa mla64 mla128,--attn $(v)=$(R)/$(v).attn) --out build/report.html
	@echo "report: build/report.html"
