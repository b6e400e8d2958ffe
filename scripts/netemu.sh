#!/usr/bin/env bash
# An emulated multi-node network on this host (root; iproute2 `ip` and `tc`).
#
#   scripts/netemu.sh up     --nodes N --uplinks U --uplink-GBps R [--latency-us L] [--name P]
#   scripts/netemu.sh down   [--name P]
#   scripts/netemu.sh status [--name P]
#   scripts/netemu.sh run    --nodes N --ranks-per-node G --uplinks U --uplink-GBps R [--latency-us L] [--name P]
#                            [--timeout S] -- COMMAND [ARGS...]
#
# Layout: one network namespace per emulated node (P-n0 .. P-n<N-1>) and one bridge namespace (P-br).
# Node i has U uplinks up0 .. up<U-1>, veth pairs whose other ends (n<i>u<k>) sit in P-br on bridge rail<k>
# (one bridge per uplink index: a rail-optimised fabric). Every uplink is rate-limited to R GB/s in each
# direction with tc tbf (on up<k> for traffic leaving the node, on n<i>u<k> for traffic entering it; MTU 9000,
# burst max(64 KiB, 50 us of traffic), queue max(2 MiB, 20 ms of traffic); TCP min RTO 5 ms on the emulated routes).
# Added latency needs the sch_netem qdisc; where the kernel lacks it a --latency-us request is refused.
#
# Addresses: 10.231.<k>.<i+1>/24 on uplink k of node i, inside the namespaces this script creates only.
# No interface of the host's own namespace is touched, nothing is routed outside the namespaces, and ranks of
# one node reach each other over the node namespace's loopback (unshaped, like the inside of a node).
#
# `run` brings the network up, starts N x G copies of COMMAND (rank r on node r / G; ranks of a node share its
# namespace) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# GLOO_SOCKET_IFNAME (uplink LOCAL_RANK mod U) and PIPER_EMULATE_TOPOLOGY=NxG set, waits for them (a rank that
# fails stops the others; --timeout S stops all, exit 124), and tears the network down whatever happened.
# Exit 3: refused (not root, no iproute2, no sch_netem for a latency, bad argument).
set -Eeuo pipefail

SUBNET=10.231
MTU=9000
name=pnet nodes=0 uplinks=1 rate_GBps="" latency_us=0 per_node=1 timeout_s=600
cmd=() pids=()

refuse() { echo "netemu: $*" >&2; exit 3; }

parse() {
  while (($#)); do
    case "$1" in
      --name) name=$2; shift 2 ;;
      --nodes) nodes=$2; shift 2 ;;
      --uplinks) uplinks=$2; shift 2 ;;
      --uplink-GBps) rate_GBps=$2; shift 2 ;;
      --latency-us) latency_us=$2; shift 2 ;;
      --ranks-per-node) per_node=$2; shift 2 ;;
      --timeout) timeout_s=$2; shift 2 ;;
      --) shift; cmd=("$@"); return ;;
      *) refuse "unknown argument '$1' (see the header of scripts/netemu.sh)" ;;
    esac
  done
}

check_host() {
  [[ $(id -u) == 0 ]] || refuse "needs root (ip netns, tc); run it as root"
  command -v ip >/dev/null && command -v tc >/dev/null || refuse "needs iproute2 (ip and tc) on PATH"
  [[ $name =~ ^[a-z][a-z0-9]{0,7}$ ]] || refuse "--name '$name': 1-8 lower-case letters/digits, starting with a letter"
}

check_shape() {
  [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 2 && nodes <= 16)) || refuse "--nodes '$nodes': an integer 2..16"
  [[ $uplinks =~ ^[0-9]+$ ]] && ((uplinks >= 1 && uplinks <= 8)) || refuse "--uplinks '$uplinks': an integer 1..8"
  [[ $rate_GBps =~ ^[0-9]*\.?[0-9]+$ ]] || refuse "--uplink-GBps '$rate_GBps': a positive number (GB/s per uplink)"
  awk -v r="$rate_GBps" 'BEGIN { exit !(r >= 0.001 && r <= 10) }' || refuse "--uplink-GBps $rate_GBps: allowed 0.001..10"
  [[ $latency_us =~ ^[0-9]+$ ]] || refuse "--latency-us '$latency_us': a non-negative integer"
  if ((latency_us > 0)) && ! netem_available; then
    refuse "--latency-us $latency_us needs the sch_netem qdisc, which this kernel does not have; drop --latency-us"
  fi
}

netem_available() {  # try netem on the loopback of a throw-away namespace
  local probe="${name}-probe" ok=1
  ip netns add "$probe" 2>/dev/null || return 1
  ip -n "$probe" link set lo up
  tc -n "$probe" qdisc add dev lo root netem delay 1us 2>/dev/null && ok=0
  ip netns del "$probe"
  return $ok
}

namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${name}-(n[0-9]+|br)$" || true; }

down() {
  local ns
  for ns in $(namespaces); do ip netns del "$ns" 2>/dev/null || true; done
}

# tbf rate in bit/s (tc's "bit" unit); burst a few packets (tight shaping), queue ~20 ms of traffic.
shape() {  # shape NS DEV
  local bits burst limit
  bits=$(awk -v r="$rate_GBps" 'BEGIN { printf "%.0f", r * 8e9 }')
  burst=$(awk -v r="$rate_GBps" 'BEGIN { b = r * 1e9 * 50e-6; printf "%.0f", (b < 65536 ? 65536 : b) }')
  limit=$(awk -v r="$rate_GBps" 'BEGIN { l = r * 1e9 * 20e-3; printf "%.0f", (l < 2097152 ? 2097152 : l) }')
  if ((latency_us > 0)); then
    tc -n "$1" qdisc add dev "$2" root handle 1: netem delay "${latency_us}us"
    tc -n "$1" qdisc add dev "$2" parent 1: handle 2: tbf rate "${bits}bit" burst "$burst" limit "$limit"
  else
    tc -n "$1" qdisc add dev "$2" root tbf rate "${bits}bit" burst "$burst" limit "$limit"
  fi
}

sysctl_ns() { ip netns exec "$1" sh -c "echo '$3' > /proc/sys/net/ipv4/$2"; }

up() {
  [[ -z $(namespaces) ]] || refuse "a network named '$name' is already up (scripts/netemu.sh down --name $name)"
  trap 'down; echo "netemu: setup failed; removed what was created" >&2' ERR
  local br="${name}-br" i k ns
  ip netns add "$br"
  ip -n "$br" link set lo up
  for ((k = 0; k < uplinks; k++)); do
    ip -n "$br" link add "rail$k" type bridge
    ip -n "$br" link set "rail$k" up
  done
  for ((i = 0; i < nodes; i++)); do
    ns="${name}-n$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    sysctl_ns "$ns" conf/all/rp_filter 0
    sysctl_ns "$ns" tcp_slow_start_after_idle 0
    sysctl_ns "$ns" tcp_wmem "4096 65536 16777216"
    sysctl_ns "$ns" tcp_rmem "4096 131072 16777216"
    for ((k = 0; k < uplinks; k++)); do
      ip link add "up$k" netns "$ns" type veth peer name "n${i}u$k" netns "$br"
      ip -n "$ns" addr add "$SUBNET.$k.$((i + 1))/24" dev "up$k"
      ip -n "$ns" link set "up$k" mtu $MTU up
      ip -n "$ns" route replace "$SUBNET.$k.0/24" dev "up$k" proto kernel scope link src "$SUBNET.$k.$((i + 1))" rto_min 5ms
      sysctl_ns "$ns" "conf/up$k/rp_filter" 0
      ip -n "$br" link set "n${i}u$k" mtu $MTU master "rail$k" up
      shape "$ns" "up$k"
      shape "$br" "n${i}u$k"
    done
  done
  trap - ERR
  echo "netemu $name: $nodes nodes (namespaces $name-n0..$name-n$((nodes - 1))), $uplinks uplink(s) each at" \
       "$rate_GBps GB/s per direction (tc tbf$( ((latency_us > 0)) && echo " + netem ${latency_us} us")), bridges" \
       "rail0..rail$((uplinks - 1)) in $br; uplink k of node i = $SUBNET.k.(i+1)/24; nothing routed outside" >&2
}

status() {
  local ns
  for ns in $(namespaces); do
    echo "$ns: $(ip -n "$ns" -br addr show | awk '$1 != "lo" {printf "%s %s; ", $1, $3}')"
    tc -n "$ns" qdisc show | grep -E "tbf|netem" | sed 's/^/  /'
  done
}

uplink_bytes() {  # bytes each uplink sent (node -> fabric), from the tbf counters
  local i k line=""
  for ((i = 0; i < nodes; i++)); do
    for ((k = 0; k < uplinks; k++)); do
      line+=" n$i/up$k=$(tc -s -n "${name}-n$i" qdisc show dev "up$k" | awk '/Sent/ {print $2; exit}')"
    done
  done
  echo "netemu $name: bytes sent per uplink:$line" >&2
}

stop_ranks() {  # the ranks still running (timeout forwards the signal to its rank)
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

run_ranks() {
  local world=$((nodes * per_node)) port=$((20000 + RANDOM % 20000)) r rc=0 pid done_pid
  [[ $per_node =~ ^[0-9]+$ ]] && ((per_node >= 1 && world <= 64)) || refuse "--ranks-per-node '$per_node': 1.., at most 64 ranks"
  [[ $timeout_s =~ ^[0-9]+$ ]] && ((timeout_s >= 1)) || refuse "--timeout '$timeout_s': a positive integer (seconds)"
  ((${#cmd[@]})) || refuse "run needs a command after --"
  for ((r = 0; r < world; r++)); do
    local local_rank=$((r % per_node))
    timeout -k 5 "$timeout_s" ip netns exec "${name}-n$((r / per_node))" env RANK=$r WORLD_SIZE=$world \
      LOCAL_RANK=$local_rank LOCAL_WORLD_SIZE=$per_node MASTER_ADDR=$SUBNET.0.1 MASTER_PORT=$port \
      OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=up$((local_rank % uplinks)) PIPER_EMULATE_TOPOLOGY=${nodes}x$per_node \
      PIPER_NETEMU="$name" "${cmd[@]}" &
    pids+=($!)
  done
  while ((${#pids[@]})); do  # the first rank to fail (or time out: 124) stops the others
    wait -n -p done_pid "${pids[@]}" || { rc=$?; break; }
    local rest=()
    for pid in "${pids[@]}"; do [[ $pid == "$done_pid" ]] || rest+=("$pid"); done
    pids=("${rest[@]}")
  done
  stop_ranks
  ((rc != 124)) || echo "netemu: ranks still running after $timeout_s s; stopped them" >&2
  return $rc
}

action=${1:-}
shift || true
parse "$@"
case "$action" in
  up) check_host; check_shape; up ;;
  down) check_host; down ;;
  status) check_host; status ;;
  run)
    check_host; check_shape
    up
    trap 'stop_ranks; down' EXIT
    trap 'exit 130' INT TERM
    rc=0
    run_ranks || rc=$?
    uplink_bytes
    exit $rc
    ;;
  *) refuse "usage: scripts/netemu.sh up|down|status|run [options] (see its header)" ;;
esac
