#!/usr/bin/env bash
# Run benchmarks/allreduce.py under torchrun inside a private network namespace whose loopback
# is rate-limited with tc (tbf). One tbf on the one shared loopback shapes the sum of every
# rank's traffic, like one shared link. The namespace is always removed (trap), also on failure.
#
#   usage: sudo benchmarks/netns.sh RATE NPROC [allreduce.py args...]
#   e.g.   sudo benchmarks/netns.sh 1gbit 4 --reps 2
#          sudo benchmarks/netns.sh 10gbit 2 --reps 3
#          BURST=4mb sudo benchmarks/netns.sh 10gbit 4
set -euo pipefail

rate=${1:?"usage: $0 RATE NPROC [allreduce.py args...]   (RATE e.g. 1gbit, 10gbit)"}
nproc=${2:?"usage: $0 RATE NPROC [allreduce.py args...]"}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
ns="harmony-bench-$$"
# tbf needs a bucket of at least rate / HZ bytes to reach its rate: 1 ms of traffic, >= 256 kB.
rate_bits=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+(?:\.\d+)?)([kmg]?)bit', sys.argv[1].lower()); \
print(int(float(m[1]) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m[2]])) if m else sys.exit('RATE must look like 1gbit')" "$rate")
burst=${BURST:-$(( rate_bits / 8 / 1000 > 262144 ? rate_bits / 8 / 1000 : 262144 ))}

cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$ns"
ip -n "$ns" link set lo up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst "$burst" latency 50ms
echo "namespace $ns: loopback limited to $rate (tbf burst $burst bytes), $nproc ranks" >&2

# gloo must use the namespace's loopback; the namespace has no other interface.
ip netns exec "$ns" env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    torchrun --nproc_per_node "$nproc" --master_addr 127.0.0.1 --master_port 29500 \
    "$here/allreduce.py" --link "$rate shared loopback (tbf), $nproc ranks" "$@"
ip netns exec "$ns" tc -s qdisc show dev lo | sed -n '1,3p' >&2
