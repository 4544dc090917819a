# bench/bench.mk: `make bench` and `make bench-quick`, included by the main Makefile (bench/README.md).
#
#   make bench                                   every weights/*.bin, all cores, 5 C reps, 3 PyTorch reps
#   make bench BENCH_CHECKPOINTS="weights/mha.bin weights/gqa.bin" BENCH_THREADS=1 BENCH_REPS=9
#   make bench-quick                             every weights/*.bin, C engine only, 64 decode steps, 3 reps
#   make bench BENCH_BATCHES=1,16,64             the throughput table at these batch sizes only
#   make quality                                 every weights/*.bin: NLL and greedy agreement by --kv-dtype and --window
#   make bench-offload                           the KV tier: swap against recompute, streaming (bench/offload.py)
#   make bench-scale                             a 1.1B shape's MHA/GQA/MQA/MLA twins, contexts 512 to 32k (bench/scale.py)
#   make bench-spec                              speculative decoding (prompt lookup, draft model, corpus table) against plain decoding (bench/spec.py)
#   make bench-kivi                              the cache dtypes: bytes, full contexts in 64 MiB, tokens/s at B=1 and 64 (bench/kivi.py)
#
# BENCH_CHECKPOINTS  checkpoints to measure (default: empty = every weights/*.bin)
# BENCH_THREADS      threads for the engine, PyTorch and the roofline probe (default: empty = all cores)
# BENCH_REPS         timed runs of the C engine per checkpoint and mode, after a warm-up (default: empty = 5, quick 3)
# BENCH_PT_REPS      timed runs of the PyTorch reference per checkpoint and mode, after a warm-up (default: empty = 3)
# BENCH_OUT          where the report goes (default: empty = bench/results, quick bench/results/tmp/quick)
# BENCH_BATCHES      batch sizes of the throughput table, e.g. 1,4,16 or none (default: empty = 1,4,16,64,256, quick 1,16)
# BENCH_FLAGS        any further bench/bench.py flags (bench/bench.py -h)
# BENCH_SCALE        0 leaves the scale section (bench/scale.py, about 20 minutes on 2 cores) out of make bench
# An empty knob leaves bench.py's own default, which differs between the two targets.
# Included anywhere in the main Makefile, this fragment leaves its default goal alone.
_bench_default_goal := $(.DEFAULT_GOAL)
PYTHON ?= /usr/bin/python3
BENCH_CHECKPOINTS ?=
BENCH_THREADS ?=
BENCH_REPS ?=
BENCH_PT_REPS ?=
BENCH_OUT ?=
BENCH_BATCHES ?=
BENCH_FLAGS ?=
BENCH_SCALE ?= 1
_bench_knobs = --cc "$(CC)" $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) \
  $(if $(strip $(BENCH_REPS)),--reps $(BENCH_REPS)) $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT)) \
  $(if $(strip $(BENCH_BATCHES)),--batches $(BENCH_BATCHES)) \
  $(BENCH_FLAGS) $(BENCH_CHECKPOINTS)

.PHONY: bench bench-quick bench-scale bench-offload bench-spec bench-kivi quality
bench: run build/roofline
	$(PYTHON) bench/bench.py $(if $(strip $(BENCH_PT_REPS)),--pt-reps $(BENCH_PT_REPS)) $(_bench_knobs)
	$(if $(filter 1,$(BENCH_SCALE)),$(PYTHON) bench/scale.py $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT)))

# the posts' scale: generated 1.1B twins, the cached step from 512 to 32,768 positions
bench-scale: run build/roofline
	$(PYTHON) bench/scale.py $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT))

# the KV tier: swap out and in against recompute, every weights/*.bin (bench/offload.py)
bench-offload: run build/roofline
	$(PYTHON) bench/offload.py $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT)) $(BENCH_CHECKPOINTS)

# the C engine alone, 64 decode steps a run: every checkpoint compared in well under a minute
bench-quick: run
	$(PYTHON) bench/bench.py --quick $(_bench_knobs)

# the cache dtypes side by side, fp32 to int2 (bench/kivi.py): capacity and decode speed
bench-kivi: run
	$(PYTHON) bench/kivi.py $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT))

# what --kv-dtype and --window cost in NLL and greedy agreement (bench/quality.py); no timings
QUALITY_VALID ?= ../shared/tinystories/valid.txt
quality: run
	$(PYTHON) bench/quality.py --valid $(QUALITY_VALID) $(BENCH_CHECKPOINTS)

# what the bench tools link of the engine: the kernels, the thread team and its messages' UTF-8
BENCH_KERNEL_OBJS = $(B)/kernels/kernels.o $(B)/kernels/threads.o $(B)/kernels/utf8.o

# the matmul kernel alone on the model's shapes (bench/matmul.c); not part of `make bench`
build/matmul_bench: bench/matmul.c $(BENCH_KERNEL_OBJS) kernels/kernels.h kernels/threads.h
	$(CC) $(CFLAGS) $< $(BENCH_KERNEL_OBJS) -o $@ -lm -pthread

# the attention kernels alone on one item of a long-context step (bench/attention.c); not part of `make bench`
build/attention_bench: bench/attention.c $(BENCH_KERNEL_OBJS) kernels/kernels.h kernels/simd.h kernels/threads.h
	$(CC) $(CFLAGS) $< $(BENCH_KERNEL_OBJS) -o $@ -lm -pthread

build/roofline: bench/roofline.c $(BENCH_KERNEL_OBJS) kernels/kernels.h
	$(CC) -O3 -march=native -fopenmp -std=c11 -I. $< $(BENCH_KERNEL_OBJS) -o $@ -lm -pthread

.DEFAULT_GOAL := $(_bench_default_goal)

# speculative decoding (issue 43): speedup, acceptance and verify cost by K, batch 1, 16, 64
bench-spec: run
	$(PYTHON) bench/spec.py $(if $(strip $(BENCH_THREADS)),--threads $(BENCH_THREADS)) $(if $(strip $(BENCH_OUT)),--out $(BENCH_OUT))
