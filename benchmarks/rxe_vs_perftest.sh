#!/usr/bin/env bash
# rxe_vs_perftest.sh - aiordma against perftest on the same kernel Soft-RoCE device, same run.
#
# Run inside the rxe VM (or on any host with an active RDMA device):
#   scripts/rxe-vm run -- benchmarks/rxe_vs_perftest.sh [ROUNDS]
#
# Each round runs, back to back on rxe0 (server and client on the same device):
#   ib_write_bw -s 65536              vs  aiordma bench write_bw (plain, and with --post-list)
#   ib_write_lat -s 64                vs  aiordma bench write_lat --progress busy and event (asyncio, uvloop)
# and prints one line per measurement; the last lines are the medians and ratios.
# Environment: AIORDMA_DEVICE (default rxe0), ITERS_BW (2000), ITERS_LAT (1000),
#              BW_VARIANTS (aiordma write_bw options, ';'-separated; default
#              "-t 16;-t 128;-t 128 -l 16;-t 128 -l 32;-t 256 -l 64"), PERFTEST_BW_ARGS
#              (extra ib_write_bw options, e.g. "-t 256"), BW=0 skips the bandwidth tests,
#              LAT=0 the latency tests, LAT_MODES (progress modes, default "busy event"),
#              PY (default: the repository's .venv/bin/python).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$here/.venv/bin/python}
DEV=${AIORDMA_DEVICE:-rxe0}
ROUNDS=${1:-3}
ITERS_BW=${ITERS_BW:-2000}
ITERS_LAT=${ITERS_LAT:-1000}
GIDX=${AIORDMA_GID_INDEX:-1}
export AIORDMA_DEVICE=$DEV
out=$(mktemp -d)

perftest() {  # perftest() TOOL ARGS... -> the tool's client output
    local tool=$1; shift
    "$tool" -d "$DEV" -x "$GIDX" -F "$@" >"$out/srv" 2>&1 &
    local srv=$!
    sleep 1
    "$tool" -d "$DEV" -x "$GIDX" -F "$@" 127.0.0.1 2>&1
    wait $srv
}

aiordma_bench() {  # aiordma_bench ARGS... -> JSON lines
    "$PY" -m aiordma.cli bench "$@" --provider pyverbs --baseline none --json 2>"$out/err" || cat "$out/err" >&2
}

for r in $(seq "$ROUNDS"); do
  if [[ ${BW:-1} != 0 ]]; then
    bw=$(perftest ib_write_bw -s 65536 -n "$ITERS_BW" ${PERFTEST_BW_ARGS:-} | awk '$1 == 65536 {print $4}')
    echo "round $r ib_write_bw 64K MB/s: $bw"
    echo "ib_write_bw $bw" >>"$out/results"
    IFS=';' read -r -a variants <<<"${BW_VARIANTS:--t 16;-t 128;-t 128 -l 16;-t 128 -l 32;-t 256 -l 64}"
    for variant in "${variants[@]}"; do
        v=$(aiordma_bench write_bw -s 65536 -n "$ITERS_BW" $variant | "$PY" -c 'import json,sys; print(round(json.loads(sys.stdin.readline())["bw_MBps"], 2))')
        echo "round $r aiordma write_bw 64K ($variant) MB/s: $v"
        echo "aiordma_write_bw[$variant] $v" >>"$out/results"
    done
  fi
    [[ ${LAT:-1} == 0 ]] && continue
    lat=$(perftest ib_write_lat -s 64 -n "$ITERS_LAT" | awk '$1 == 64 {print $5}')
    echo "round $r ib_write_lat 64B t_typical us: $lat"
    echo "ib_write_lat $lat" >>"$out/results"
    for mode in ${LAT_MODES:-busy event}; do
      for loop in asyncio uvloop; do
        v=$(aiordma_bench write_lat -s 64 -n "$ITERS_LAT" --progress "$mode" --loop $loop | "$PY" -c 'import json,sys; print(round(json.loads(sys.stdin.readline())["lat_us"]["p50"], 2))')
        echo "round $r aiordma write_lat 64B $mode $loop p50 us: $v"
        echo "aiordma_write_lat[$mode $loop] $v" >>"$out/results"
      done
    done
done

echo "== medians over $ROUNDS rounds (MB = 2^20 bytes on both sides, as perftest counts)"
"$PY" - "$out/results" <<'EOF'
import statistics, sys
vals = {}
for line in open(sys.argv[1]):
    k, _, v = line.rpartition(" ")
    try:
        vals.setdefault(k, []).append(float(v))
    except ValueError:
        pass
med = {k: statistics.median(v) for k, v in vals.items()}
for k, v in med.items():
    extra = ""
    if k.startswith("aiordma_write_bw") and med.get("ib_write_bw"):
        extra = f"  ratio {v / med['ib_write_bw']:.2f} x ib_write_bw (bar >= 0.9)"
    if k.startswith("aiordma_write_lat") and med.get("ib_write_lat"):
        extra = f"  ratio {v / med['ib_write_lat']:.1f} x ib_write_lat (bar <= 4)"
    print(f"{k:32s} {v:10.2f}   runs {vals[k]}{extra}")
EOF
rm -rf "$out"
