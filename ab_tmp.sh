#!/usr/bin/env bash
set -u
here=$(cd "$(dirname "$0")" && pwd)
PY=$here/.venv/bin/python
export AIORDMA_DEVICE=rxe0
for r in 1 2 3 4 5; do
  ib_write_bw -d rxe0 -x 1 -F -s 65536 -n 2000 >/tmp/srv 2>&1 & srv=$!; sleep 1
  bw=$(ib_write_bw -d rxe0 -x 1 -F -s 65536 -n 2000 127.0.0.1 2>&1 | awk '$1 == 65536 {print $4}'); wait $srv
  echo "round $r ib_write_bw $bw"
  for ext in 1 0; do
    for t in "-t 16" "-t 128"; do
      v=$(AIORDMA_PYVERBS_EXTENDED=$ext $PY -m aiordma.cli bench write_bw -s 65536 -n 2000 $t --provider pyverbs --baseline none --json 2>/tmp/err | $PY -c 'import json,sys; d=json.loads(sys.stdin.readline()); print(round(d["bw_MBps"],2), d.get("cpu_us_per_op", d.get("cpu", "")))' || cat /tmp/err)
      echo "round $r ext=$ext $t $v"
    done
  done
done
