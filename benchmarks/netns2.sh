#!/usr/bin/env bash
# Two emulated servers on this machine: network namespaces A and B joined by a veth pair whose two ends are
# rate-limited with tc (tbf), so traffic between the "servers" crosses a link of RATE each way while ranks inside
# one namespace talk over its own loopback at memory speed. Runs COMMAND with NS_A, NS_B (the namespaces),
# ADDR_A, ADDR_B (their addresses) and IF_A, IF_B (their interfaces, for GLOO_SOCKET_IFNAME) in its environment;
# COMMAND starts its processes in them with `ip netns exec`. The namespaces are always removed (trap).
#
#   usage: sudo benchmarks/netns2.sh RATE COMMAND...
#   e.g.   sudo benchmarks/netns2.sh 1gbit python benchmarks/hybrid.py --emulated-inner
set -euo pipefail

rate=${1:?"usage: $0 RATE COMMAND...   (RATE e.g. 1gbit)"}
shift
rate_bits=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+(?:\.\d+)?)([kmg]?)bit', sys.argv[1].lower()); \
print(int(float(m[1]) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m[2]])) if m else sys.exit('RATE must look like 1gbit')" "$rate")
# tbf needs a bucket of at least rate / HZ bytes to reach its rate: 1 ms of traffic, >= 256 kB. Below a few Mbit/s
# that floor is a large share of a second's traffic, which the bucket, refilled while the link idles, sends at once:
# there the floor is 50 ms of traffic, at least 70000 bytes (a 64 KiB GSO segment and its headers, which tbf would
# otherwise drop whole).
floor=$(( rate_bits / 8 / 20 < 262144 ? (rate_bits / 8 / 20 > 70000 ? rate_bits / 8 / 20 : 70000) : 262144 ))
burst=${BURST:-$(( rate_bits / 8 / 1000 > floor ? rate_bits / 8 / 1000 : floor ))}
a="harmony-a-$$"
b="harmony-b-$$"

cleanup() {
    # what the link's queues did (bytes sent, drops, overlimits): a drop costs its TCP flow a retransmission
    ip netns exec "$a" tc -s qdisc show dev va 2>/dev/null | sed "s/^/$a: /" >&2 || true
    ip netns exec "$b" tc -s qdisc show dev vb 2>/dev/null | sed "s/^/$b: /" >&2 || true
    ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$a"
ip netns add "$b"
ip link add va type veth peer name vb
ip link set va netns "$a"
ip link set vb netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev va
ip -n "$b" addr add 10.77.0.2/24 dev vb
for ns in "$a" "$b"; do
    ip -n "$ns" link set lo up
done
ip -n "$a" link set va up
ip -n "$b" link set vb up
ip netns exec "$a" tc qdisc add dev va root tbf rate "$rate" burst "$burst" latency 50ms
ip netns exec "$b" tc qdisc add dev vb root tbf rate "$rate" burst "$burst" latency 50ms
echo "namespaces $a, $b joined by a $rate link each way (tbf burst $burst bytes)" >&2

NS_A="$a" NS_B="$b" ADDR_A=10.77.0.1 ADDR_B=10.77.0.2 IF_A=va IF_B=vb "$@"
