# fuzz/fuzz.mk: libFuzzer harnesses (clang), included by the main Makefile.
# docs/ROBUSTNESS.md says what each harness feeds and checks.
#
#   make fuzz                 builds the harnesses and seed corpora, runs each harness for
#                             FUZZ_SECONDS (default 60) and prints its execution count
#   make fuzz FUZZ_RUNS=1000000 FUZZ_SECONDS=0
#                             a campaign of 1,000,000 executions per harness, no time limit
#   make fuzz FUZZ_HARNESSES=loader   one harness only
#   make fuzz-build           the harnesses only: build/fuzz/fuzz_{loader,tokenizer,tokenizer_model,cli,ppl}
#   make fuzz-seeds           the seed corpora only: build/fuzz/seeds-*/
#   make fuzz-regress         replays fuzz/regressions/<harness>/ with the harnesses
#
# Corpora grow in build/fuzz/corpus-<harness>/, crashes land in build/fuzz/crashes-<harness>/,
# logs in build/fuzz/<harness>.log. The objects are built without OpenMP (the pragmas are
# ignored, everything runs on one thread), with ASan + UBSan and libFuzzer's coverage.
FUZZ_CC ?= clang
FUZZ_CXX ?= clang++
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?=
FUZZ_ARGS ?=
FUZZ_HARNESSES ?= loader tokenizer tokenizer_model cli ppl
FUZZ_B = $(B)/fuzz
FUZZ_SAN = -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS = -g -O1 $(ARCH) $(FUZZ_SAN) -fsanitize=fuzzer-no-link -std=c11 -D_POSIX_C_SOURCE=200809L \
  -ffp-contract=off -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-function -I.
FUZZ_CXXFLAGS = -g -O1 $(FUZZ_SAN) -fsanitize=fuzzer-no-link -std=c++17 -I. -Wall -Wextra
FUZZ_OBJS = $(ENGINE:%.c=$(FUZZ_B)/obj/%.o) $(FUZZ_B)/obj/tokenizer/spm_c.o $(FUZZ_B)/obj/tokenizer_checks.o
FUZZ_BINS = $(FUZZ_HARNESSES:%=$(FUZZ_B)/fuzz_%)
REAL_TOKENIZER = tokenizer/tokenizer.model

.PHONY: fuzz fuzz-build fuzz-seeds fuzz-regress
.SECONDARY: $(FUZZ_OBJS) $(FUZZ_HARNESSES:%=$(FUZZ_B)/obj/fuzz_%.o)

$(FUZZ_B)/obj/%.o: %.c $(HEADERS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_B)/obj/tokenizer/spm_c.o: tokenizer/spm_c.cc tokenizer/spm_c.h kernels/utf8.h
	@mkdir -p $(@D)
	$(FUZZ_CXX) $(FUZZ_CXXFLAGS) -DSPM_TEST_HOOKS -c $< -o $@

$(FUZZ_B)/obj/tokenizer_checks.o: fuzz/tokenizer_checks.c fuzz/tokenizer_checks.h $(HEADERS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_B)/obj/fuzz_%.o: fuzz/fuzz_%.c fuzz/tokenizer_checks.h $(HEADERS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -DFUZZ_TINY_MODEL='"$(CURDIR)/$(TINY_TOKENIZER)"' \
	  -DFUZZ_REAL_MODEL='"$(CURDIR)/$(REAL_TOKENIZER)"' -c $< -o $@

$(FUZZ_B)/fuzz_%: $(FUZZ_B)/obj/fuzz_%.o $(FUZZ_OBJS)
	$(FUZZ_CXX) -g $(FUZZ_SAN) -fsanitize=fuzzer $^ -o $@ $(LDLIBS)

fuzz-build: $(FUZZ_BINS) $(TINY_TOKENIZER)

# Seeds: valid inputs only, written fresh from the tests' helpers (nothing binary is committed).
$(FUZZ_B)/make_seeds: fuzz/make_seeds.c $(B)/tests/testutil.o $(ENGINE_OBJS) $(HEADERS) tests/testutil.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -I. -Itests -c fuzz/make_seeds.c -o $@.o
	$(CXX) -pthread $@.o $(B)/tests/testutil.o $(ENGINE_OBJS) -o $@ $(LDLIBS)

# A unigram tokenizer with a real precompiled charsmap (NFKC rules), as a seed of
# fuzz_tokenizer_model (the other seeds are BPE without normalization).
NFKC_TOKENIZER = $(FUZZ_B)/nfkc.model
$(NFKC_TOKENIZER): tests/fixtures/tiny.txt
	@mkdir -p $(@D)
	spm_train --input=$< --model_prefix=$(FUZZ_B)/nfkc --model_type=unigram --vocab_size=320 \
	  --byte_fallback=true --character_coverage=1.0 --normalization_rule_name=nmt_nfkc --minloglevel=2 >/dev/null 2>&1

$(FUZZ_B)/seeds.stamp: $(FUZZ_B)/make_seeds $(TINY_TOKENIZER) $(REAL_TOKENIZER) $(NFKC_TOKENIZER)
	rm -rf $(FUZZ_B)/seeds-*
	$(FUZZ_B)/make_seeds $(FUZZ_B) $(TINY_TOKENIZER) $(REAL_TOKENIZER) $(NFKC_TOKENIZER)
	@touch $@

fuzz-seeds: $(FUZZ_B)/seeds.stamp

# Each harness runs on its growing corpus plus the seeds; a crash stops that harness (its
# input is saved in crashes-<harness>/), the others still run, and the target fails.
fuzz: fuzz-build fuzz-seeds
	@fail=0; for h in $(FUZZ_HARNESSES); do \
	  mkdir -p $(FUZZ_B)/corpus-$$h $(FUZZ_B)/crashes-$$h; \
	  echo "== fuzz_$$h: $(if $(FUZZ_RUNS),$(FUZZ_RUNS) executions,)$(if $(filter-out 0,$(FUZZ_SECONDS)), at most $(FUZZ_SECONDS) s,)"; \
	  start=$$(date +%s); \
	  $(FUZZ_B)/fuzz_$$h -max_total_time=$(FUZZ_SECONDS) $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS)) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_B)/crashes-$$h/ $(FUZZ_ARGS) $(FUZZ_B)/corpus-$$h $(FUZZ_B)/seeds-$$h \
	    > $(FUZZ_B)/$$h.log 2>&1; rc=$$?; \
	  secs=$$(( $$(date +%s) - start )); \
	  execs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $(FUZZ_B)/$$h.log | tail -n 1); \
	  crashes=$$(ls $(FUZZ_B)/crashes-$$h | wc -l); \
	  echo "fuzz_$$h: $${execs:-?} executions in $$secs s, corpus $$(ls $(FUZZ_B)/corpus-$$h | wc -l) files, $$crashes crash inputs (exit $$rc)"; \
	  if [ $$rc -ne 0 ]; then fail=1; grep -m 3 -E 'ERROR|SUMMARY|runtime error' $(FUZZ_B)/$$h.log; fi; \
	done; exit $$fail

# The committed regression inputs, through the libFuzzer binaries (each file runs once).
fuzz-regress: fuzz-build
	@for h in $(FUZZ_HARNESSES); do \
	  if [ -d fuzz/regressions/$$h ] && [ -n "$$(ls fuzz/regressions/$$h)" ]; then \
	    echo "== fuzz_$$h: fuzz/regressions/$$h"; \
	    $(FUZZ_B)/fuzz_$$h fuzz/regressions/$$h/* > $(FUZZ_B)/regress-$$h.log 2>&1 \
	      || { tail -n 30 $(FUZZ_B)/regress-$$h.log; exit 1; }; \
	    tail -n 1 $(FUZZ_B)/regress-$$h.log; fi; \
	done
