# Sourced by tests/multinode/two_hosts.sh and scripts/bench_two_hosts.sh: two "hosts" on this
# machine, network namespaces joined by a veth pair.
#   two_namespaces NS_A NS_B VETH_A VETH_B SUBNET MTU   (SUBNET: three octets, e.g. 10.77.21)
# sets A, B, VA, VB, ipA (SUBNET.1) and ipB (SUBNET.2); the caller's EXIT trap calls
# remove_namespaces, so that they go on every path.
remove_namespaces() {
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
}

two_namespaces() {
  A=$1 B=$2 VA=$3 VB=$4 ipA=$5.1 ipB=$5.2
  ip netns add "$A"
  ip netns add "$B"
  ip link add "$VA" type veth peer name "$VB"
  ip link set "$VA" netns "$A"
  ip link set "$VB" netns "$B"
  ip -n "$A" addr add "$ipA/24" dev "$VA"
  ip -n "$B" addr add "$ipB/24" dev "$VB"
  local nd
  for nd in "$A:$VA" "$B:$VB"; do
    ip -n "${nd%%:*}" link set lo up
    ip -n "${nd%%:*}" link set "${nd##*:}" mtu "$6" up
  done
}
