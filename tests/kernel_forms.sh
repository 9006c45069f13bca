#!/usr/bin/env bash
# Fails when the kernels' object code holds an instruction form that AMD
# Zen 4 runs in microcode at a small fraction of its usual rate: a vector
# compress straight to memory (vpcompress{b,w,d,q} / vcompressp{s,d} with a
# memory destination; ~10x on a whole top-k Select there). Use
# CompressStore16 (common/simd_reduce.h): compress in a register, then a
# plain store.
#   kernel_forms.sh OBJDUMP LIBRARY
set -euo pipefail
objdump="$1"
lib="$2"
[ -s "$lib" ] || { echo "kernel_forms: no library at $lib" >&2; exit 2; }
asm="$("$objdump" -d --no-show-raw-insn -C "$lib")"
# Guard against an objdump that printed nothing useful.
grep -q 'karat::SelectTopK' <<<"$asm" ||
  { echo "kernel_forms: $lib has no karat::SelectTopK to check" >&2; exit 2; }
# AT&T syntax puts the destination last: a memory one has parentheses.
bad="$(awk '/^[0-9a-f]+ <.*>:$/ { fn = $0 }
  $2 ~ /^v(p)?compress/ && $NF ~ /\(/ { print fn; print "    " $0 }' <<<"$asm")"
if [ -n "$bad" ]; then
  echo "kernel_forms: vector compresses to memory (use CompressStore16):" >&2
  echo "$bad" >&2
  exit 1
fi
echo "kernel_forms: no vector compress to memory in $lib"
