#!/usr/bin/env bash
# fuzz/valgrind.sh: full generations of small random checkpoints under valgrind's memcheck,
# with and without --kv, and the other modes once (an int8 cache, --prompts, a FIFO refused).
# Fails (exit 1) on any invalid read or write, use of uninitialised memory, or definite/indirect
# leak.
#
#   make valgrind            (builds build-valgrind/run, then runs this)
#   fuzz/valgrind.sh [RUN]   RUN: a ./run built without AVX-512 (default build-valgrind/run)
#
# The checkpoints are train/export.py --random VARIANT --small (the real tokenizer, dim 64,
# 2 layers, context 64); a generation with --ignore-eos fills the whole context.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-build-valgrind/run}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=build-valgrind
mkdir -p "$OUT"
[ -x "$RUN" ] || make "$RUN"
for v in gqa mla64; do
  [ -f "$OUT/$v.bin" ] || "$PYTHON" train/export.py --random "$v" "$OUT/$v.bin" --small --seed 3 >/dev/null
done
printf 'Once upon a time there was a cat.\n<|endoftext|>\nTom had a red ball. He played with it every day!\n<|endoftext|>\n' > "$OUT/stories.txt"
printf 'Once upon a time\nTom had a red ball\n' > "$OUT/prompts.txt"
rm -f "$OUT/fifo" && mkfifo "$OUT/fifo"

# VALGRIND_ARGS adds options, e.g. --track-origins=yes to see where uninitialised values come from
VG=(valgrind --tool=memcheck --leak-check=full --errors-for-leak-kinds=definite,indirect
    --show-leak-kinds=definite,indirect --error-exitcode=1 -q ${VALGRIND_ARGS:-})
fail=0
check() {  # name, then the arguments of ./run
  local name=$1; shift
  local log="$OUT/valgrind-$name.log"
  local start=$SECONDS
  if "${VG[@]}" --log-file="$log" "$RUN" "$@" --threads 1 >"$OUT/valgrind-$name.out" 2>"$OUT/valgrind-$name.err"; then
    rc=0
  else
    rc=$?
  fi
  if [ -s "$log" ] || [ $rc -ne "${EXPECT_RC:-0}" ]; then
    echo "valgrind $name: FAILED (exit $rc; $log)"; cat "$log"; fail=1
  else
    echo "valgrind $name: clean, exit $rc, $((SECONDS - start)) s ($(tail -n 1 "$OUT/valgrind-$name.err" | cut -c1-90))"
  fi
}
for v in gqa mla64; do
  check "$v-no-kv" "$OUT/$v.bin" -p "Once upon a time" --ignore-eos -s 1 -q
  check "$v-kv"    "$OUT/$v.bin" -p "Once upon a time" --ignore-eos -s 1 -q --kv
done
check mla64-kv-expand "$OUT/mla64.bin" -p "Once upon a time" --ignore-eos -s 1 -q --kv --mla expand
check gqa-check-kv "$OUT/gqa.bin" --check-kv -p "Once upon a time" -n 20 --ignore-eos
check gqa-ppl "$OUT/gqa.bin" --ppl "$OUT/stories.txt"
check gqa-kv-int8 "$OUT/gqa.bin" -p "Once upon a time" --ignore-eos -s 1 -q --kv --kv-dtype int8
check gqa-prompts "$OUT/gqa.bin" --prompts "$OUT/prompts.txt" --batch 2 --kv -n 8 -s 1 -q
EXPECT_RC=1 check fifo-ppl "$OUT/gqa.bin" --ppl "$OUT/fifo"
EXPECT_RC=1 check bad-prompt "$OUT/gqa.bin" -p "$(printf 'bad \xff utf8')"
EXPECT_RC=2 check bad-flag "$OUT/gqa.bin" -k 5000
exit $fail
