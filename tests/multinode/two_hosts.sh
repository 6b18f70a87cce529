#!/usr/bin/env bash
# Two "hosts" on this machine: two network namespaces joined by a veth pair, one torchrun agent in
# each (c10d rendezvous on node A's address). Checks, with apex-train:
#   - --ddp and --zero (each way) across the two hosts give the losses of --nproc 2 on loopback, bit for bit;
#   - the bytes a rank sends per step (node A's veth counter, jumbo frames so headers are ~0.1 %)
#     are DDP ~1.0 S, ZeRO-2 with the all-to-all reduce-scatter ~1.0 S, ZeRO-2 with Gloo's native
#     reduce-scatter ~1.5 S, ZeRO-2 in 0.25 MiB messages (--zero-message-cap-mb) ~1.0 S (S = the
#     model's fp32 bytes), each within 5 %;
#   - without GLOO_SOCKET_IFNAME every rank fails within seconds, naming it.
# Needs root and iproute2; fails (never skips) when it cannot set up. The namespaces go on every path.
# Usage: two_hosts.sh APEX_TRAIN PYTHON
set -euo pipefail
train=$1
torchrun=$(dirname "$2")/torchrun
py=$2
id=$$
A=apexA$id B=apexB$id
source "$(dirname "$0")/netns.sh"
work=$(mktemp -d)
cleanup() {
  remove_namespaces
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (network namespaces)"
command -v ip >/dev/null || fail "needs iproute2 (ip)"
[ -x "$torchrun" ] || fail "no torchrun beside $py"
two_namespaces "$A" "$B" "va$id" "vb$id" "10.77.$((id % 200 + 20))" 65000

common="--no-progress --model mlp --opt-level fp32 --batch-size 32 --train-size 4096 --test-size 64
        --threads 1 --log-every 5 --seed 1"
tx() { ip netns exec "$A" cat "/sys/class/net/$VA/statistics/tx_bytes"; }
port=$((29400 + id % 500))

# two_hosts TAG STEPS IFNAME(yes|no) FLAGS...: the run across the namespaces; prints the bytes
# node A sent.
two_hosts() {
  local tag=$1 steps=$2 ifname=$3
  shift 3
  port=$((port + 1))
  local before after pa pb
  before=$(tx)
  for node in A B; do
    local ns ip dev host
    if [ $node = A ]; then ns=$A ip=$ipA dev=$VA host=true; else ns=$B ip=$ipB dev=$VB host=false; fi
    local envs=(OMP_NUM_THREADS=1)
    [ "$ifname" = yes ] && envs+=(GLOO_SOCKET_IFNAME=$dev)
    # shellcheck disable=SC2086
    ip netns exec "$ns" env "${envs[@]}" timeout 300 "$torchrun" --nnodes 2 --nproc-per-node 1 \
      --rdzv-backend c10d --rdzv-endpoint "$ipA:$port" --rdzv-id "j$id$tag" --max-restarts 0 \
      --local-addr "$ip" --rdzv-conf "is_host=$host" --no-python "$train" --ddp $common \
      --steps "$steps" --metrics "$work/$tag.$node.jsonl" "$@" >"$work/$tag.$node.log" 2>&1 &
    if [ $node = A ]; then pa=$!; else pb=$!; fi
  done
  local sa=0 sb=0
  wait "$pa" || sa=$?
  wait "$pb" || sb=$?
  after=$(tx)
  echo "$sa $sb $((after - before))"
}

# The loss records of a metrics file (step and loss), one per line.
losses() {
  "$py" -c 'import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if not r.get("summary"): print(r["step"], repr(r["loss"]))' "$1"
}

ratio_ok() {  # NAME MEASURED EXPECTED: within 5 %
  "$py" -c 'import sys
m,e=float(sys.argv[2]),float(sys.argv[3]); r=m/e
print(f"{sys.argv[1]}: {m:.0f} B/step, {r:.3f} of the expected {e:.0f}")
sys.exit(0 if abs(r-1)<=0.05 else 1)' "$@"
}

params=""
declare -A per_step
for cfg in ddp zero native pieces; do
  case $cfg in
    ddp) flags=() ;;
    zero) flags=(--zero) ;;
    native) flags=(--zero --zero-reduce-scatter native) ;;
    pieces) flags=(--zero --zero-message-cap-mb 0.25) ;;
  esac
  read -r s1 s2 b10 <<<"$(two_hosts "${cfg}10" 10 yes "${flags[@]}")"
  [ "$s1$s2" = 00 ] || { cat "$work/${cfg}10".*.log; fail "$cfg across two hosts failed ($s1 $s2)"; }
  read -r s1 s2 b30 <<<"$(two_hosts "${cfg}30" 30 yes "${flags[@]}")"
  [ "$s1$s2" = 00 ] || { cat "$work/${cfg}30".*.log; fail "$cfg across two hosts failed ($s1 $s2)"; }
  per_step[$cfg]=$(((b30 - b10) / 20))
  # The same run on loopback: the same losses, bit for bit.
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 timeout 300 "$train" --nproc 2 $common --steps 30 \
    --metrics "$work/$cfg.loop.jsonl" "${flags[@]}" >"$work/$cfg.loop.log" 2>&1 ||
    { cat "$work/$cfg.loop.log"; fail "$cfg --nproc 2 failed"; }
  if [ "$(losses "$work/${cfg}30.A.jsonl")" != "$(losses "$work/$cfg.loop.jsonl")" ]; then
    diff <(losses "$work/${cfg}30.A.jsonl") <(losses "$work/$cfg.loop.jsonl") || true
    fail "$cfg: the losses across two hosts differ from --nproc 2's"
  fi
  echo "$cfg: losses equal --nproc 2's ($(losses "$work/$cfg.loop.jsonl" | wc -l) records)"
  if [ -z "$params" ]; then
    params=$(grep -o '([0-9]* parameters' "$work/${cfg}30.A.log" | head -1 | tr -dc 0-9 || true)
  fi
done
[ -n "$params" ] || { cat "$work/zero30.A.log"; fail "apex-train did not print the parameter count"; }
S=$((params * 4))
ok=0
ratio_ok "DDP" "${per_step[ddp]}" "$S" || ok=1
ratio_ok "ZeRO-2, all-to-all reduce-scatter" "${per_step[zero]}" "$S" || ok=1
ratio_ok "ZeRO-2, Gloo's reduce-scatter" "${per_step[native]}" "$((S * 3 / 2))" || ok=1
ratio_ok "ZeRO-2, 0.25 MiB messages" "${per_step[pieces]}" "$S" || ok=1
[ $ok = 0 ] || fail "wire bytes per step off by more than 5 %"

# Without GLOO_SOCKET_IFNAME Gloo would advertise loopback: every rank fails at once.
t0=$(date +%s)
read -r s1 s2 _ <<<"$(two_hosts noif 10 no --zero)"
t=$(($(date +%s) - t0))
[ "$s1" != 0 ] && [ "$s2" != 0 ] || { cat "$work/noif".*.log; fail "a rank ran without GLOO_SOCKET_IFNAME"; }
for node in A B; do
  grep -q "set GLOO_SOCKET_IFNAME" "$work/noif.$node.log" ||
    { cat "$work/noif.$node.log"; fail "node $node's error does not name GLOO_SOCKET_IFNAME"; }
done
[ "$t" -lt 60 ] || fail "the missing interface took ${t} s to fail"
echo "without GLOO_SOCKET_IFNAME: both hosts failed in ${t} s naming it"
echo "PASS"
