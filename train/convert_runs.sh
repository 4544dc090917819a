#!/bin/sh
# Issue 39's runs, one after another (weights/README.md, "MHA to GQA, MQA and MLA"):
# uptraining from train/convert.py's checkpoints and training from scratch, at 5% and 20%
# of the protocol's 19,070,976 tokens, with the protocol's hyperparameters and schedule shape.
# A run already finished is skipped; one stopped part way is resumed.
cd "$(dirname "$0")/.." || exit 1
PY=/usr/bin/python3
for v in gqa mqa mla64 mla128; do
    [ -f out/convert/$v.bin ] || $PY train/convert.py weights/mha.bin $v out/convert/$v.bin || exit 1
done
one() {  # one VARIANT TOKENS OUT [--init CKPT]
    v=$1 n=$2 o=$3; shift 3
    if [ -f "$o/done" ]; then return; fi
    if [ -f "$o/last.pt" ]; then set -- --resume; else set -- --force "$@"; fi
    echo "== $(date -u +%H:%M:%S) $v $n $o $*"
    $PY train/train.py --variant "$v" --tokens "$n" --out "$o" "$@" && touch "$o/done"
}
P5=953549 P20=3814195
for v in gqa mqa mla64 mla128; do one $v $P5 out/convert/up5-$v --init out/convert/$v.bin || exit 1; done
for v in gqa mqa mla64 mla128; do one $v $P5 out/convert/scratch5-$v || exit 1; done
# each variant's 20% pair together, so the table fills a whole row at a time
for v in gqa mqa mla64 mla128; do
    one $v $P20 out/convert/up20-$v --init out/convert/$v.bin || exit 1
    one $v $P20 out/convert/scratch20-$v || exit 1
done
