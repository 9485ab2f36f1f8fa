#!/usr/bin/env bash
# Start-up of the clone command, two trees alternated (docs/benchmarks.md, "clone start-up").
# Alternate the two trees, 10 runs each, wall and CPU (user+sys) ms; median.
# usage: scripts/bench_cli_startup.sh BEFORE_TREE AFTER_TREE PORT  (PORT..PORT+13 free)
OUT=$(mktemp -d)
B=$1; A=$2; PORT=$3
# Absolute, but not through its symlink: realpath led to the base interpreter,
# outside the venv, where the pair could not start (no zmq) and get failed.
PY=${CLONE_VENV:-.venv}/bin/python; PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
cd /tmp  # python -m puts the cwd first on sys.path: neither tree
S="--servers 127.0.0.1:$PORT,127.0.0.1:$((PORT+10))"
PYTHONPATH=$A $PY -m clone.tools.run_pair --in-memory --port $PORT --bind 127.0.0.1 >$OUT/pair2.log 2>&1 &
PAIR=$!
for i in $(seq 1 100); do PYTHONPATH=$A $PY -m clone.client.cli $S set /bench/k v >/dev/null 2>&1 && break; sleep 0.3; done
one() { # tree args...
  local tree=$1; shift
  /usr/bin/time -f "%e %U %S" -o $OUT/t env PYTHONPATH=$tree $PY -m clone.client.cli "$@" >/dev/null 2>&1
  awk '{printf "%d %d\n", $1*1000, ($2+$3)*1000}' $OUT/t
}
: > $OUT/raw
for i in $(seq 10); do
  for t in before after; do
    tree=$B; [ $t = after ] && tree=$A
    echo "$t help $(one $tree --help)" >> $OUT/raw
    echo "$t get $(one $tree $S get /bench/k)" >> $OUT/raw
  done
done
for t in before after; do for c in help get; do
  w=$(awk -v t=$t -v c=$c '$1==t && $2==c {print $3}' $OUT/raw | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  u=$(awk -v t=$t -v c=$c '$1==t && $2==c {print $4}' $OUT/raw | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  echo "$t $c wall_ms=$w cpu_ms=$u"
done; done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
kill $PAIR; wait $PAIR 2>/dev/null
