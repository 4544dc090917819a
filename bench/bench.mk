# bench/bench.mk: `make bench`, included by the main Makefile (bench/README.md).
#
#   make bench                                   every weights/*.bin, all cores, 5 C reps, 3 PyTorch reps
#   make bench BENCH_CHECKPOINTS="weights/mha.bin weights/gqa.bin" BENCH_THREADS=1 BENCH_REPS=9
#
# BENCH_CHECKPOINTS  checkpoints to measure (default: empty = every weights/*.bin)
# BENCH_THREADS      threads for the engine, PyTorch and the roofline probe (default: empty = all cores)
# BENCH_REPS         timed runs of the C engine per checkpoint and mode, after one warm-up (default 5)
# BENCH_PT_REPS      timed runs of the PyTorch reference per checkpoint and mode, after one warm-up (default 3)
# BENCH_OUT          where the report goes (default bench/results)
# BENCH_FLAGS        any further bench/bench.py flags (bench/bench.py -h)
# Included anywhere in the main Makefile, this fragment leaves its default goal alone.
_bench_default_goal := $(.DEFAULT_GOAL)
PYTHON ?= /usr/bin/python3
BENCH_CHECKPOINTS ?=
BENCH_THREADS ?=
BENCH_REPS ?= 5
BENCH_PT_REPS ?= 3
BENCH_OUT ?= bench/results
BENCH_FLAGS ?=

.PHONY: bench
bench: run build/roofline
	$(PYTHON) bench/bench.py --reps $(BENCH_REPS) --pt-reps $(BENCH_PT_REPS) --out $(BENCH_OUT) --cc "$(CC)" \
	  $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) $(BENCH_FLAGS) $(BENCH_CHECKPOINTS)

# the matmul kernel alone on the model's shapes (bench/matmul.c); not part of `make bench`
build/matmul_bench: bench/matmul.c $(B)/kernels.o $(B)/parallel.o kernels.h parallel.h
	$(CC) $(CFLAGS) -I. $< $(B)/kernels.o $(B)/parallel.o -o $@ -lm

build/roofline: bench/roofline.c
	@mkdir -p build
	$(CC) -O3 -march=native -fopenmp -std=c11 $< -o $@

.DEFAULT_GOAL := $(_bench_default_goal)
