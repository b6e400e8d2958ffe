#!/usr/bin/env bash
# slurm-local.sh — start a throw-away, single-machine Slurm "cluster" for piper's tests and CI.
# (Adapted from shared/reference/slurm-local/; it is ours now.)
#
# Tested on Debian 12 (bookworm), Slurm 22.05.8 from Debian, run as root,
# no systemd (daemons are started by hand). Idempotent: running it again while
# the cluster is up is a no-op (exit 0); if the generated config changed, the
# Slurm daemons are restarted with the new config.
#
# It emulates N compute nodes on this one host with one slurmd per node
# ("multiple-slurmd" mode: Debian's build has MULTIPLE_SLURMD=Yes), each with
# its own port, spool dir, pid file and log. Nodes may declare more CPUs and
# GPUs than the machine has (SlurmdParameters=config_overrides); the fake GPUs
# are /dev/null symlinks so --gpus-per-node/--gpus-per-task work and set
# CUDA_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES.
#
# Node shapes and partitions (what piper's emitted scripts request):
#   node[1-N]   64 declared CPUs, 8 fake GPUs (Frontier-shaped: 8 GCDs, -c7 per task)
#               partitions: cpu  = node[1-4] (local-cpu jobs; the default partition)
#                           batch = node[1-N] (Frontier's partition name)
#   dgx[1-M]    128 declared CPUs, 8 fake GPUs (DGX H100-shaped); partition: gpu
#   Every node runs its own slurmd (one per emulated node, ~10 MB each).
#
# Usage:   slurm-local.sh [--smoke]        start (and optionally run a smoke job)
# Stop:    slurm-local-stop.sh [--purge]
#
# Environment knobs (defaults in brackets):
#   PIPER_SLURM_DIR          state/log/pid root                  [/tmp/piper-slurm]
#   PIPER_SLURM_NODES        emulated node[] running a slurmd    [4]
#   PIPER_SLURM_NODE_PREFIX  node name prefix (node1..nodeN)     [node]
#   PIPER_SLURM_CPUS         CPUs declared per node[]            [64]
#   PIPER_SLURM_GPUS         fake GPUs per node (0 = no GRES)    [8]
#   PIPER_SLURM_DGX_NODES    emulated dgx[] nodes (partition gpu) [2]
#   PIPER_SLURM_DGX_CPUS     CPUs declared per dgx[] node        [128]
#   PIPER_SLURM_MEM_MB       RealMemory declared per node (MB)   [16000]
#   PIPER_SLURM_CLUSTER      ClusterName                         [piperci]
#   PIPER_SLURM_CTLD_PORT    slurmctld port                      [6817]
#   PIPER_SLURM_SLURMD_PORT  first slurmd port (one per node)    [17001]
#   PIPER_SLURM_ACCOUNTING   1 = mariadb + slurmdbd (real sacct) [0]
#   PIPER_SLURM_DBD_PORT     slurmdbd port                       [6819]
#   PIPER_SLURM_CRED_EXPIRE  AuthInfo cred_expire (also = delay before a
#                            requeued job may start again)       [20]
#   PIPER_SLURM_INSTALL      1 = apt-get install missing pkgs    [1]
#   PIPER_SLURM_EDIT_HOSTS   1 = add node names to /etc/hosts so
#                            MASTER_ADDR=$(scontrol show hostnames|head -1)
#                            resolves                            [1]
#   PIPER_SLURM_LINK_ETC     1 = symlink /etc/slurm/{slurm,gres}.conf to the
#                            generated files so plain sbatch works [1]
#   PIPER_SLURM_TIMEOUT      seconds to wait for readiness       [60]
set -euo pipefail

DIR=${PIPER_SLURM_DIR:-/tmp/piper-slurm}
NODES=${PIPER_SLURM_NODES:-4}
PREFIX=${PIPER_SLURM_NODE_PREFIX:-node}
CPUS=${PIPER_SLURM_CPUS:-64}
DGX_NODES=${PIPER_SLURM_DGX_NODES:-2}
DGX_CPUS=${PIPER_SLURM_DGX_CPUS:-128}
GPUS=${PIPER_SLURM_GPUS:-8}
MEM=${PIPER_SLURM_MEM_MB:-16000}
CLUSTER=${PIPER_SLURM_CLUSTER:-piperci}
CTLD_PORT=${PIPER_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${PIPER_SLURM_SLURMD_PORT:-17001}
ACCOUNTING=${PIPER_SLURM_ACCOUNTING:-0}
DBD_PORT=${PIPER_SLURM_DBD_PORT:-6819}
CRED_EXPIRE=${PIPER_SLURM_CRED_EXPIRE:-20}
INSTALL=${PIPER_SLURM_INSTALL:-1}
EDIT_HOSTS=${PIPER_SLURM_EDIT_HOSTS:-1}
LINK_ETC=${PIPER_SLURM_LINK_ETC:-1}
TIMEOUT=${PIPER_SLURM_TIMEOUT:-60}
SMOKE=0
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    *) echo "slurm-local: unknown argument: $a" >&2; exit 2 ;;
  esac
done

MARK="# piper-slurm-local"
ETC=$DIR/etc
RUN=$DIR/run
LOG=$DIR/log
CONF=$ETC/slurm.conf
export SLURM_CONF=$CONF

log() { printf '[slurm-local %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; for f in "$LOG"/*.log; do [ -f "$f" ] && { echo "--- tail $f"; tail -n 20 "$f"; }; done; exit 1; }

# alive PID -> true if the process exists and is not a zombie (some container inits
# reap orphaned daemons late, so /proc/PID can linger in state Z)
alive() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1; [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]; }

# pid_alive PIDFILE COMM -> 0 if the pid in PIDFILE is alive and its comm is COMM
pid_alive() {
  local pf=$1 comm=$2 pid
  [ -s "$pf" ] || return 1
  pid=$(tr -dc '0-9' <"$pf")
  [ -n "$pid" ] && alive "$pid" || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]
}

wait_for() { # wait_for SECONDS DESCRIPTION CMD...
  local t=$1 what=$2; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -ge $end ] && die "timed out after ${t}s waiting for $what"
    sleep 0.5
  done
}

[ "$(id -u)" = 0 ] || { echo "slurm-local: must run as root" >&2; exit 1; }
[ "$NODES" -ge 1 ] || die "PIPER_SLURM_NODES must be >= 1"

# ---------------------------------------------------------------- packages
need_pkgs=()
command -v slurmctld >/dev/null || need_pkgs+=(slurmctld)
command -v slurmd    >/dev/null || need_pkgs+=(slurmd)
command -v sbatch    >/dev/null || need_pkgs+=(slurm-client)
command -v munged    >/dev/null || need_pkgs+=(munge)
if [ "$ACCOUNTING" = 1 ]; then
  command -v slurmdbd >/dev/null || need_pkgs+=(slurmdbd)
  command -v mariadbd >/dev/null || need_pkgs+=(mariadb-server)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || die "missing packages: ${need_pkgs[*]} (set PIPER_SLURM_INSTALL=1)"
  log "installing: ${need_pkgs[*]}"
  t0=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d may forbid starting services from postinst; that is fine, we start them by hand.
  apt-get update -qq || apt-get update
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >"/tmp/piper-slurm-apt.log" 2>&1 \
    || { tail -n 30 /tmp/piper-slurm-apt.log; die "apt-get install failed"; }
  log "installed in $((SECONDS - t0))s"
fi

mkdir -p "$ETC" "$RUN" "$LOG" "$DIR/ctld" "$DIR/fakegpu"

# ---------------------------------------------------------------- config
# nodespec PREFIX COUNT -> "node[1-4]" (or "node1"); portspec FIRST COUNT -> "[17001-17004]"
nodespec() { if [ "$2" -eq 1 ]; then echo "${1}1"; else echo "${1}[1-$2]"; fi; }
portspec() { if [ "$2" -eq 1 ]; then echo "$1"; else echo "[$1-$(($1 + $2 - 1))]"; fi; }
NODESPEC=$(nodespec "$PREFIX" "$NODES"); PORTSPEC=$(portspec "$SLURMD_PORT" "$NODES")
CPU_NODES=$((NODES < 4 ? NODES : 4))
CPUSPEC=$(nodespec "$PREFIX" "$CPU_NODES")
DGX_PREFIX=dgx
DGX_PORT=$((SLURMD_PORT + NODES))
if [ "$DGX_NODES" -gt 0 ]; then DGXSPEC=$(nodespec "$DGX_PREFIX" "$DGX_NODES"); DGX_PORTSPEC=$(portspec "$DGX_PORT" "$DGX_NODES"); fi
ALL_NODES=$((NODES + DGX_NODES))
GRES_LINE=""; GRESTYPES=""
if [ "$GPUS" -gt 0 ]; then
  GRES_LINE=" Gres=gpu:$GPUS"; GRESTYPES="GresTypes=gpu"
  for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/fakegpu/gpu$i"; done
fi
if [ "$ACCOUNTING" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

new_conf=$(cat <<EOF
$MARK — generated by slurm-local.sh, do not edit
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=$CRED_EXPIRE
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
MinJobAge=300
KillWait=5
InactiveLimit=0
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt
$ACCT
$GRESTYPES
NodeName=$NODESPEC NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORTSPEC CPUs=$CPUS RealMemory=$MEM$GRES_LINE State=UNKNOWN
PartitionName=cpu Nodes=$CPUSPEC Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=batch Nodes=$NODESPEC MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)
if [ "$DGX_NODES" -gt 0 ]; then
  new_conf="$new_conf
NodeName=$DGXSPEC NodeHostname=localhost NodeAddr=127.0.0.1 Port=$DGX_PORTSPEC CPUs=$DGX_CPUS RealMemory=$MEM$GRES_LINE State=UNKNOWN
PartitionName=gpu Nodes=$DGXSPEC MaxTime=INFINITE State=UP OverSubscribe=NO"
fi
if [ "$GPUS" -gt 0 ]; then
  new_gres="$MARK
NodeName=$NODESPEC Name=gpu File=$DIR/fakegpu/gpu[0-$((GPUS - 1))]"
  if [ "$DGX_NODES" -gt 0 ]; then new_gres="$new_gres
NodeName=$DGXSPEC Name=gpu File=$DIR/fakegpu/gpu[0-$((GPUS - 1))]"; fi
else
  new_gres="$MARK"
fi

changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then printf '%s\n' "$new_conf" >"$CONF"; changed=1; fi
if [ ! -f "$ETC/gres.conf" ] || [ "$(cat "$ETC/gres.conf")" != "$new_gres" ]; then printf '%s\n' "$new_gres" >"$ETC/gres.conf"; changed=1; fi
: >"$ETC/plugstack.conf"   # empty: do not pick up /etc/slurm/plugstack.conf.d

if [ "$ACCOUNTING" = 1 ]; then
  cat >"$ETC/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageLoc=piper_slurm_acct_db
StorageUser=piperslurm
StoragePass=piperslurm
EOF
  chmod 600 "$ETC/slurmdbd.conf"
fi

if [ "$LINK_ETC" = 1 ]; then
  mkdir -p /etc/slurm
  for f in slurm.conf gres.conf; do
    tgt=/etc/slurm/$f
    if [ -e "$tgt" ] && [ ! -L "$tgt" ] && ! grep -q "$MARK" "$tgt" 2>/dev/null; then
      die "$tgt exists and was not written by slurm-local.sh; move it away or set PIPER_SLURM_LINK_ETC=0 (then export SLURM_CONF=$CONF)"
    fi
    ln -sfn "$ETC/$f" "$tgt"
  done
  if [ "$ACCOUNTING" = 1 ]; then ln -sfn "$ETC/slurmdbd.conf" /etc/slurm/slurmdbd.conf; fi
fi

if [ "$EDIT_HOSTS" = 1 ]; then
  names=$(for ((i = 1; i <= NODES; i++)); do printf '%s%d ' "$PREFIX" "$i"; done
           for ((i = 1; i <= DGX_NODES; i++)); do printf '%s%d ' "$DGX_PREFIX" "$i"; done)
  want="127.0.0.1 ${names}$MARK"
  if ! grep -qxF "$want" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite in place instead of mv
    tmp=$(mktemp); grep -vF "$MARK" /etc/hosts >"$tmp" || true; echo "$want" >>"$tmp"
    cat "$tmp" >/etc/hosts; rm -f "$tmp"
  fi
fi

# ---------------------------------------------------------------- munge
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged already running"
else
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
  fi
  chown -R munge:munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 755 /run/munge
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  wait_for 20 munged sh -c 'munge -n | unmunge'
  cp /run/munge/munged.pid "$RUN/munged.pid"   # marks "started by slurm-local.sh"
  log "munged started (pid $(cat "$RUN/munged.pid"))"
fi

stop_pidfiles() { # stop_pidfiles COMM PIDFILE... : SIGTERM all, wait <=15 s, SIGKILL the rest
  local comm=$1 pf pid pids=() left; shift
  for pf in "$@"; do
    [ -e "$pf" ] || continue
    if pid_alive "$pf" "$comm"; then pids+=("$(tr -dc '0-9' <"$pf")"); fi
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 60); do
      left=(); for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
      [ ${#left[@]} -eq 0 ] && break; sleep 0.25
    done
    [ ${#left[@]} -gt 0 ] && kill -9 "${left[@]}" 2>/dev/null || true
  fi
  rm -f "$@"
}

if [ "$changed" = 1 ]; then
  # config changed (or first run): restart Slurm daemons that may still run with an old config
  stop_pidfiles slurmd "$RUN"/slurmd-*.pid
  stop_pidfiles slurmctld "$RUN/slurmctld.pid"
fi

# ---------------------------------------------------------------- accounting (optional)
if [ "$ACCOUNTING" = 1 ]; then
  if mariadb -e 'select 1' >/dev/null 2>&1; then
    log "mariadb already running"
  else
    mkdir -p /run/mysqld "$RUN/mysql" && chown mysql:mysql /run/mysqld "$RUN/mysql"
    if [ ! -d /var/lib/mysql/mysql ]; then
      mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG/mariadb-install.log" 2>&1 \
        || die "mariadb-install-db failed (see $LOG/mariadb-install.log)"
    fi
    # mariadbd drops to user mysql, so its pid file must live in a mysql-owned dir
    (setsid mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
       --pid-file="$RUN/mysql/mariadbd.pid" --bind-address=127.0.0.1 --port=3306 \
       >>"$LOG/mariadb.log" 2>&1 </dev/null &)
    wait_for "$TIMEOUT" mariadb mariadb -e 'select 1'
    cp "$RUN/mysql/mariadbd.pid" "$RUN/mariadbd.pid"   # marks "started by slurm-local.sh"
    log "mariadb started (pid $(cat "$RUN/mariadbd.pid"))"
  fi
  # fresh controller state (first run or after --purge) => start from an empty accounting DB too,
  # otherwise sacct mixes stale records whose job ids collide with the new ones
  if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd && [ ! -e "$DIR/ctld/job_state" ] && [ ! -e "$DIR/ctld/job_state.old" ]; then
    mariadb -e "DROP DATABASE IF EXISTS piper_slurm_acct_db;"
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS piper_slurm_acct_db;
              CREATE USER IF NOT EXISTS 'piperslurm'@'localhost' IDENTIFIED BY 'piperslurm';
              GRANT ALL ON piper_slurm_acct_db.* TO 'piperslurm'@'localhost'; FLUSH PRIVILEGES;"
  if pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
    log "slurmdbd already running"
  else
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    slurmdbd || die "slurmdbd failed to start"
    wait_for "$TIMEOUT" slurmdbd sacctmgr -n show cluster
    log "slurmdbd started (pid $(cat "$RUN/slurmdbd.pid"))"
  fi
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    # slurmctld registers with slurmdbd at start-up: restart it if it was already up
    stop_pidfiles slurmctld "$RUN/slurmctld.pid"
  fi
fi

# ---------------------------------------------------------------- slurmctld
if pid_alive "$RUN/slurmctld.pid" slurmctld; then
  log "slurmctld already running"
else
  t0=$SECONDS
  # -c: clear saved state when the config changed (old node/job records may not fit)
  if [ "$changed" = 1 ]; then slurmctld -c -f "$CONF"; else slurmctld -f "$CONF"; fi \
    || die "slurmctld failed to start"
  wait_for "$TIMEOUT" "slurmctld (scontrol ping)" sh -c 'scontrol ping | grep -q "is UP"'
  log "slurmctld started (pid $(cat "$RUN/slurmctld.pid")) in $((SECONDS - t0))s"
fi

# ---------------------------------------------------------------- slurmd x N
t0=$SECONDS
for n in $(for ((i = 1; i <= NODES; i++)); do echo "$PREFIX$i"; done
           for ((i = 1; i <= DGX_NODES; i++)); do echo "$DGX_PREFIX$i"; done); do
  if pid_alive "$RUN/slurmd-$n.pid" slurmd; then continue; fi
  mkdir -p "$DIR/spool-$n"
  slurmd -f "$CONF" -N "$n" || die "slurmd -N $n failed to start"
done

# wait until every node is idle (resume any that came back down/drained)
nodes_ready() {
  local out bad
  out=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  [ "$(printf '%s\n' "$out" | grep -c .)" -eq "$ALL_NODES" ] || return 1
  bad=$(printf '%s\n' "$out" | awk '$2 ~ /(down|drain|drng|fail|inval)/ {print $1}')
  if [ -n "$bad" ]; then
    for b in $bad; do scontrol update nodename="$b" state=resume >/dev/null 2>&1 || true; done
    return 1
  fi
  ! printf '%s\n' "$out" | awk '{print $2}' | grep -qvE '^(idle|mix|alloc|comp)$'
}
wait_for "$TIMEOUT" "all $ALL_NODES nodes to become idle" nodes_ready
log "slurmd x$ALL_NODES ready in $((SECONDS - t0))s"
sinfo -N -o '%N %P %t %c %m %G' | sed 's/^/    /'

cat >"$DIR/env.sh" <<EOF
export SLURM_CONF=$CONF
EOF

# ---------------------------------------------------------------- smoke test
if [ "$SMOKE" = 1 ]; then
  out=$DIR/smoke-%j.out
  jid=$(sbatch --parsable -J piper-smoke -p cpu -N "$CPU_NODES" --ntasks-per-node=2 -t 2 -o "$out" \
        --wrap 'echo MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); getent hosts $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); srun -l bash -c "echo rank=\$SLURM_PROCID node=\$SLURMD_NODENAME"')
  end=$((SECONDS + TIMEOUT))
  while squeue -h -j "$jid" 2>/dev/null | grep -q .; do
    [ $SECONDS -ge $end ] && { scancel "$jid"; die "smoke job $jid did not finish in ${TIMEOUT}s"; }
    sleep 0.5
  done
  f=${out//%j/$jid}
  cat "$f"
  state=$(scontrol show job "$jid" 2>/dev/null | grep -oP 'JobState=\K\S+' || true)
  ranks=$(grep -c 'rank=' "$f" || true)
  [ "$state" = COMPLETED ] && [ "$ranks" -eq $((CPU_NODES * 2)) ] || die "smoke job $jid: state=$state ranks=$ranks"
  log "smoke job $jid COMPLETED with $ranks ranks"
fi
log "up: SLURM_CONF=$CONF  (source $DIR/env.sh)"
