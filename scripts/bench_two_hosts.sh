#!/usr/bin/env bash
# apex-train across two "hosts" (network namespaces joined by a veth pair, one torchrun agent
# each) on a link limited to RATE by tc tbf on both ends: DDP against ZeRO-2 (--zero), samples/s
# from rank 0's summary and the bytes node A sent per step. As root; the namespaces go on every
# path. ZeRO-2 runs with the default 100 MiB buckets, with them sent in 0.125 MiB messages, and
# with 0.25 MiB buckets. Figures go to docs/benchmarks.md ("ZeRO-2").
#   scripts/bench_two_hosts.sh 1gbit [STEPS]     (RATE: tc's syntax, or "none")
set -euo pipefail
rate=${1:-1gbit}
steps=${2:-30}
cd "$(dirname "$0")/.."
train=build/tools/apex-train
py=${APEX_PREFIX:-/opt/apex-cpp}/venv/bin/python
torchrun=$(dirname "$py")/torchrun
id=$$
A=bnA$id B=bnB$id
source tests/multinode/netns.sh
trap remove_namespaces EXIT
trap 'exit 1' INT TERM
work=$(mktemp -d)
two_namespaces "$A" "$B" "ba$id" "bb$id" "10.78.$((id % 200 + 20))" 1500
if [ "$rate" != none ]; then
  for nd in "$A:$VA" "$B:$VB"; do
    ip netns exec "${nd%%:*}" tc qdisc add dev "${nd##*:}" root tbf rate "$rate" burst 256kb \
      latency 50ms
  done
fi
port=$((29600 + id % 300))
common="--no-progress --model mlp --opt-level fp32 --batch-size 64 --train-size 8192 --test-size 64
        --threads 1 --log-every $steps --seed 1"
run() {  # TAG FLAGS...
  local tag=$1
  shift
  port=$((port + 1))
  local before pa pb
  before=$(ip netns exec "$A" cat "/sys/class/net/$VA/statistics/tx_bytes")
  for node in A B; do
    local ns ip dev host
    if [ $node = A ]; then ns=$A ip=$ipA dev=$VA host=true; else ns=$B ip=$ipB dev=$VB host=false; fi
    # shellcheck disable=SC2086
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME=$dev OMP_NUM_THREADS=1 timeout 900 "$torchrun" \
      --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "$ipA:$port" \
      --rdzv-id "b$id$tag" --max-restarts 0 --local-addr "$ip" --rdzv-conf "is_host=$host" \
      --no-python "$train" --ddp $common --steps "$steps" --metrics "$work/$tag.$node.jsonl" "$@" \
      >"$work/$tag.$node.log" 2>&1 &
    if [ $node = A ]; then pa=$!; else pb=$!; fi
  done
  wait "$pa" || { cat "$work/$tag.A.log"; exit 1; }
  wait "$pb" || { cat "$work/$tag.B.log"; exit 1; }
  local sent=$(($(ip netns exec "$A" cat "/sys/class/net/$VA/statistics/tx_bytes") - before))
  "$py" -c 'import json,sys
s=[json.loads(l) for l in open(sys.argv[1]) if "\"summary\": true" in l][-1]
sps=s["samples_per_s"]; mb=int(sys.argv[3])/int(sys.argv[4])/1e6
print(f"{sys.argv[2]:12s} {sps:10.1f} samples/s  {mb:8.2f} MB sent by node A per step (whole run)")' \
    "$work/$tag.A.jsonl" "$tag" "$sent" "$steps"
}
echo "two namespaces, link $rate, mlp fp32, 1 thread per rank, $steps steps"
for round in 1 2; do
  run "ddp-$round"
  run "zero-$round" --zero
  run "zero-cap-$round" --zero --zero-message-cap-mb 0.125
  run "zero-small-$round" --zero --bucket-cap-mb 0.25
done
rm -rf "$work"
