# fuzz/tsan.mk: the threaded code under ThreadSanitizer; included by the main Makefile.
#
#   make test-tsan   builds ./run and the unit tests that start threads into build-tsan/
#                    (-O1, TSan, the main rules with B=build-tsan), runs them, then runs
#                    build-tsan/run once for each line of fuzz/tsan-runs.txt (every mode
#                    that shares its steps with the thread team or the tier's reader). A
#                    report stops the process with exit 66 and fails the target. (The
#                    pytest suite is not run here: TSan's shadow memory breaks its memory
#                    checks, and it would take most of an hour.)
TSAN_B = build-tsan
TSAN_MAKE = $(MAKE) -s B=$(TSAN_B) OPT=-O1 CC="$(CC) -fsanitize=thread" CXX="$(CXX) -fsanitize=thread"
TSAN_UNIT_TESTS = test_threads test_scheduler test_attention test_kernels test_kvtier test_shape
TSAN_ENV = TSAN_OPTIONS=halt_on_error=1:exitcode=66:second_deadlock_stack=1

.PHONY: test-tsan
# ./run of a build directory other than the top one (make B=build-tsan build-tsan/run)
ifneq ($(B),build)
$(B)/run: $(B)/run.o $(ENGINE_OBJS)
	$(CXX) -pthread $^ -o $@ $(LDLIBS)
endif

test-tsan:
	$(TSAN_MAKE) $(TSAN_B)/run $(TSAN_UNIT_TESTS:%=$(TSAN_B)/tests/%) $(TSAN_B)/tests/tiny.model
	@set -e; for t in $(TSAN_UNIT_TESTS); do echo "== tsan $$t"; $(TSAN_ENV) $(TSAN_B)/tests/$$t $(TSAN_B)/tests/tiny.model; done
	@set -e; T=$(TSAN_B)/tmp; rm -rf $$T; mkdir -p $$T; \
	while IFS= read -r args; do case "$$args" in ''|'#'*) continue;; esac; \
	  echo "== tsan ./run $$args"; rm -f $$T/*; \
	  eval "$(TSAN_ENV) $(TSAN_B)/run $$args -q" >/dev/null 2>$(TSAN_B)/stderr \
	    || { cat $(TSAN_B)/stderr; echo "test-tsan: failed: ./run $$args"; exit 1; }; \
	done < fuzz/tsan-runs.txt

clean-sanitizers: clean-tsan
.PHONY: clean-tsan
clean-tsan:
	rm -rf $(TSAN_B)
