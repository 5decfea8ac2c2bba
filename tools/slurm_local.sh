#!/usr/bin/env bash
# A one-node Slurm on this machine, for trying `sweep.py --executor slurm` and for its tests.
#
#   tools/slurm_local.sh install   # Debian's munge and Slurm packages (root; what `make slurm` runs)
#   tools/slurm_local.sh start     # munge, slurmctld and slurmd; prints the SLURM_CONF to export
#   tools/slurm_local.sh status    # whether it runs, and the node's state
#   tools/slurm_local.sh stop
#
# Needs Debian's munge, slurmctld, slurmd and slurm-client (`make slurm`, as root). The node is
# described by `slurmd -C`; no cgroups (proctrack/linuxproc), no accounting database (nothing here
# uses sacct). Its files live in $GPTLITE_SLURM_DIR (default ~/.cache/gptlite/slurm); /etc/slurm is
# left alone, so clients find it through SLURM_CONF. One partition, `debug`, the default.
set -euo pipefail

DIR="${GPTLITE_SLURM_DIR:-$HOME/.cache/gptlite/slurm}"
CONF="$DIR/slurm.conf"

die() { echo "slurm_local.sh: $*" >&2; exit 2; }

need() {
    for cmd in munged slurmctld slurmd sbatch squeue scontrol sinfo; do
        command -v "$cmd" >/dev/null || die "$cmd not found: install munge, slurmctld, slurmd and slurm-client (make slurm, as root)"
    done
    [ "$(id -u)" = 0 ] || die "the local Slurm runs its daemons as root; run this as root"
}

running() {  # slurmctld and slurmd of this configuration answer
    [ -f "$CONF" ] && SLURM_CONF="$CONF" timeout 10 scontrol ping 2>/dev/null | grep -q "UP" \
        && SLURM_CONF="$CONF" timeout 10 sinfo -h -o %T 2>/dev/null | grep -qvE "down|drain|unknown|not_responding"
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    local node host
    host="$(hostname -s)"
    # The node as slurmd sees it (CPUs, sockets, cores, memory); its name this host's.
    node="$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")"
    cat > "$CONF" <<EOF
# Written by tools/slurm_local.sh: a one-node Slurm for trying and testing sweep.py --executor slurm.
ClusterName=gptlite-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${GPTLITE_SLURMCTLD_PORT:-6817}
SlurmdPort=${GPTLITE_SLURMD_PORT:-6818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it starts again (default 120): 5 here.
AuthInfo=cred_expire=5
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# Schedule every 2 s (defaults: 60 s main loop, 30 s backfill): a job submitted, or requeued, starts at once.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# Seconds between a job's SIGTERM and SIGKILL (cancel, time limit), and a finished job kept in squeue.
KillWait=10
MinJobAge=300
SlurmdTimeout=60
InactiveLimit=0
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    need
    if running; then
        echo "the local Slurm already runs; export SLURM_CONF=$CONF"
        return 0
    fi
    write_conf
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
        if id munge >/dev/null 2>&1; then
            su -s /bin/sh munge -c munged 2>/dev/null || munged --force
        else
            munged --force
        fi
    fi
    pkill -f "slurmctld -f $CONF" 2>/dev/null || true
    pkill -f "slurmd -f $CONF" 2>/dev/null || true
    slurmctld -f "$CONF" -c   # -c: a fresh controller state (no jobs from an earlier start)
    slurmd -f "$CONF"
    for _ in $(seq 60); do
        if running; then
            SLURM_CONF="$CONF" scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
            echo "the local Slurm runs (node $(hostname -s), partition debug); export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 1
    done
    echo "slurm_local.sh: Slurm did not come up within 60 s; logs in $DIR/log" >&2
    tail -5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
    exit 1
}

stop() {
    [ -f "$CONF" ] || { echo "the local Slurm is not configured ($CONF missing)"; return 0; }
    for daemon in slurmd slurmctld; do
        pkill -f "$daemon -f $CONF" 2>/dev/null || true
    done
    echo "the local Slurm is stopped"
}

status() {
    if running; then
        echo "the local Slurm runs; export SLURM_CONF=$CONF"
        SLURM_CONF="$CONF" sinfo
    else
        echo "the local Slurm does not run"
        return 1
    fi
}

install() {  # Debian's packages, where apt-get exists and we are root
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        echo "munge and Slurm are installed"
        return 0
    fi
    command -v apt-get >/dev/null || die "no apt-get here: install munge, slurmctld, slurmd and slurm-client with this system's package manager"
    [ "$(id -u)" = 0 ] || die "installing Slurm's packages needs root (sudo make slurm)"
    echo "Installing munge, slurmctld, slurmd and slurm-client (Debian's packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null 2>&1 || \
        { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null; } || \
        die "apt-get could not install munge and Slurm"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    conf) echo "$CONF" ;;
    *) echo "usage: tools/slurm_local.sh install|start|stop|status|conf" >&2; exit 2 ;;
esac
