#!/usr/bin/env bash
# A one-node Slurm on this machine, for trying `sweep.py --executor slurm` and for its tests; and,
# with --nodes 2, a two-node one on a private network of namespaces, for multi-node launches.
#
#   tools/slurm_local.sh install   # Debian's munge and Slurm packages (root; what `make slurm` runs)
#   tools/slurm_local.sh start     # munge, slurmctld and slurmd; prints the SLURM_CONF to export
#   tools/slurm_local.sh status    # whether it runs, and the node's state
#   tools/slurm_local.sh stop
#   tools/slurm_local.sh start|status|stop|conf --nodes 2   # the two-node cluster (below)
#
# Needs Debian's munge, slurmctld, slurmd and slurm-client (`make slurm`, as root). The node is
# described by `slurmd -C`; no cgroups (proctrack/linuxproc), no accounting database (nothing here
# uses sacct). Its files live in $GPTLITE_SLURM_DIR (default ~/.cache/gptlite/slurm); /etc/slurm is
# left alone, so clients find it through SLURM_CONF. One partition, `debug`, the default.
#
# The two-node cluster is real Slurm across real (if virtual) hosts, so that srun -N2, torchrun's
# rendezvous and submitit see two machines: a bridge, glbr0 (10.77.0.1/24), in this namespace and,
# per node, a network namespace gl-node1 / gl-node2 (10.77.0.11 / .12, on the bridge by a veth
# pair), whose slurmd runs there in its own UTS namespace, so `hostname` in a job step says which
# node it is. slurmctld runs here, as gl-ctl, reached at 10.77.0.1. The three names go into
# /etc/hosts between `# gptlite-slurm-2nodes begin/end` lines, which stop removes. It has its own
# directory ($GPTLITE_SLURM_DIR2, default $GPTLITE_SLURM_DIR-2nodes), cluster name and controller
# port (6827), so it runs beside the one-node cluster and neither start nor stop touches the other
# (plain `stop` says when the two-node one is still up). A node lost on purpose (its slurmd killed)
# comes back with `start --nodes 2` again, the controller and its jobs kept.
set -euo pipefail

DIR="${GPTLITE_SLURM_DIR:-$HOME/.cache/gptlite/slurm}"
CONF="$DIR/slurm.conf"

DIR2="${GPTLITE_SLURM_DIR2:-$DIR-2nodes}"
CONF2="$DIR2/slurm.conf"
PORT2="${GPTLITE_SLURMCTLD_PORT2:-6827}"
BRIDGE=glbr0
SUBNET=10.77.0                  # the bridge (and so the controller) .1, node i .1i
CTL=gl-ctl                      # the controller's hostname (its UTS namespace) and Slurm name
NODES2=(gl-node1 gl-node2)      # each node's network namespace, hostname and Slurm name
HOSTS_MARK="# gptlite-slurm-2nodes"

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

shared_conf() {  # the settings both clusters (one node, two) share
    cat <<'EOF'
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
EOF
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
$(shared_conf)
SlurmdTimeout=60
InactiveLimit=0
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {  # one munged for both clusters: its socket, /run/munge, is seen from every namespace
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
        if id munge >/dev/null 2>&1; then
            su -s /bin/sh munge -c munged 2>/dev/null || munged --force
        else
            munged --force
        fi
    fi
}

start() {
    need
    if running; then
        echo "the local Slurm already runs; export SLURM_CONF=$CONF"
        return 0
    fi
    write_conf
    start_munge
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
    # -n 5: `tail -5` with two files is refused ("option used in invalid context") and showed nothing.
    tail -n 5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
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

# ---- The two-node cluster (--nodes 2) -------------------------------------------------------

node_addr() { echo "$SUBNET.$((10 + $1))"; }  # node 1, 2 -> 10.77.0.11, .12

need2() {
    need
    for cmd in ip nsenter unshare hostname awk; do
        command -v "$cmd" >/dev/null || die "$cmd not found: the two-node Slurm needs iproute2 and util-linux"
    done
}

nodes_idle() {  # how many of the nodes sinfo calls idle
    SLURM_CONF="$CONF2" timeout 10 sinfo -h -N -o "%N %T" 2>/dev/null | grep -cE " idle$" || true
}

running2() {  # the controller answers, and every node is up (idle, or running a job)
    [ -f "$CONF2" ] && SLURM_CONF="$CONF2" timeout 10 scontrol ping 2>/dev/null | grep -q "UP" \
        && [ "$(SLURM_CONF="$CONF2" timeout 10 sinfo -h -N -o "%N %T" 2>/dev/null \
                | grep -cE " (idle|allocated|mixed|completing)$")" = "${#NODES2[@]}" ]
}

two_nodes_made() {  # anything of the two-node cluster on this machine: a namespace, the bridge, hosts lines
    local node
    for node in "${NODES2[@]}"; do [ -e "/run/netns/$node" ] && return 0; done
    ip link show "$BRIDGE" >/dev/null 2>&1 || grep -q "^$HOSTS_MARK begin" /etc/hosts 2>/dev/null
}

write_conf2() {
    mkdir -p "$DIR2/state" "$DIR2/spool" "$DIR2/log"
    local hw cpus mem i
    # The machine as slurmd sees it, halved between the two nodes (at least a CPU each): Slurm then
    # places no more tasks than there are cores. Memory is not consumed (CR_Core), only described.
    hw="$(slurmd -C | head -1)"
    cpus="$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
    mem="$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
    cpus=$(( ${cpus:-2} / 2 > 0 ? ${cpus:-2} / 2 : 1 ))
    mem=$(( ${mem:-2048} / 2 ))
    cat > "$CONF2" <<EOF
# Written by tools/slurm_local.sh start --nodes 2: two nodes, each a network and UTS namespace here.
ClusterName=gptlite-2nodes
# slurmctld runs as $CTL (its own UTS namespace) and is reached at the bridge's address.
SlurmctldHost=$CTL($SUBNET.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT2
# Each slurmd has a network namespace to itself, so each listens on the usual port.
SlurmdPort=6818
StateSaveLocation=$DIR2/state
# %n: the node's name, so the two slurmd (one filesystem) keep their files apart.
SlurmdSpoolDir=$DIR2/spool/%n
SlurmctldPidFile=$DIR2/slurmctld.pid
SlurmdPidFile=$DIR2/slurmd-%n.pid
SlurmctldLogFile=$DIR2/log/slurmctld.log
SlurmdLogFile=$DIR2/log/slurmd-%n.log
$(shared_conf)
# A node whose slurmd stops answering is DOWN, its jobs ended (srun: NODE_FAIL) or requeued
# (sbatch), 15 s after its last answer, not the one-node cluster's 60: losing a node is what this
# cluster is for trying (a killed slurmd's node was DOWN some 30 s after, pings being periodic).
# Not less, so that a slurmd slow to answer on a busy two-core machine is not taken for lost.
SlurmdTimeout=15
InactiveLimit=0
EOF
    for i in "${!NODES2[@]}"; do
        echo "NodeName=${NODES2[$i]} NodeAddr=$(node_addr $((i + 1))) CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$CONF2"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES2[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$CONF2"
}

net_up() {  # the namespaces first: where they are refused, nothing else is tried
    local i node err
    for node in "${NODES2[@]}"; do
        if ! err="$(ip netns add "$node" 2>&1)"; then
            echo "slurm_local.sh: this machine refuses network namespaces (ip netns add $node: $(echo $err)); the two-node Slurm needs them" >&2
            exit 2
        fi
    done
    err="$(ip link add "$BRIDGE" type bridge 2>&1)" || die "no Linux bridge here (ip link add $BRIDGE type bridge: $(echo $err))"
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in "${!NODES2[@]}"; do
        node="${NODES2[$i]}"
        # glv1 here, on the bridge; its peer, eth0, in the namespace: the node's one network card.
        ip link add "glv$((i + 1))" type veth peer name eth0 netns "$node"
        ip link set "glv$((i + 1))" master "$BRIDGE" up
        ip -n "$node" addr add "$(node_addr $((i + 1)))/24" dev eth0
        ip -n "$node" link set eth0 up
        ip -n "$node" link set lo up   # torchrun and gloo talk to themselves too
    done
}

net_down() {
    local i node
    for i in "${!NODES2[@]}"; do
        node="${NODES2[$i]}"
        if [ -e "/run/netns/$node" ]; then ip netns del "$node"; fi
        # Deleting the namespace deletes the pair, eth0 with glv1; a glv1 left by a half start goes here.
        # The kernel removes the namespace's devices after `ip netns del` returns: glv1 may vanish
        # between the check and the delete ("Cannot find device", a CI teardown 2026-11-28), so a
        # delete that fails fails the stop only if glv1 is still there.
        if ip link show "glv$((i + 1))" >/dev/null 2>&1 && ! ip link del "glv$((i + 1))" 2>/dev/null \
                && ip link show "glv$((i + 1))" >/dev/null 2>&1; then
            echo "slurm_local.sh: cannot delete the link glv$((i + 1))" >&2
            exit 1
        fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
}

hosts_without_ours() {  # /etc/hosts without the lines between our markers, on stdout
    grep -q "^$HOSTS_MARK begin" /etc/hosts && ! grep -q "^$HOSTS_MARK end" /etc/hosts \
        && die "/etc/hosts has '$HOSTS_MARK begin' without its end line: remove that block by hand"
    awk -v mark="$HOSTS_MARK" 'index($0, mark " begin") == 1 { skip = 1; next }
                               index($0, mark " end") == 1 { skip = 0; next }
                               !skip' /etc/hosts
}

hosts_replace() {  # /etc/hosts := the file $1, never seen half-written by a lookup meanwhile
    # A rename is atomic: every other process (a rank resolving this host's name while a test starts
    # or stops the cluster) reads the old file or the new one. Where /etc/hosts is a mount point (a
    # container's), it cannot be renamed over: written in place, in one write.
    if mountpoint -q /etc/hosts 2>/dev/null; then
        cat "$1" > /etc/hosts
        rm -f "$1"
    else
        chmod --reference=/etc/hosts "$1" 2>/dev/null || chmod 644 "$1"
        mv -f "$1" /etc/hosts
    fi
}

hosts_remove() {  # the lines between our markers, and nothing else
    grep -q "^$HOSTS_MARK begin" /etc/hosts || return 0
    local new
    new="$(mktemp /etc/.hosts.gptlite.XXXXXX)"   # beside /etc/hosts: the rename stays on one filesystem
    hosts_without_ours > "$new"
    hosts_replace "$new"
}

hosts_add() {  # job steps name the nodes (torchrun's rendezvous endpoint, MASTER_ADDR): from anywhere
    local i new
    new="$(mktemp /etc/.hosts.gptlite.XXXXXX)"
    hosts_without_ours > "$new"
    [ -z "$(tail -c 1 "$new")" ] || echo >> "$new"
    {
        echo "$HOSTS_MARK begin: tools/slurm_local.sh start --nodes 2 wrote these; stop --nodes 2 removes them"
        echo "$SUBNET.1 $CTL"
        for i in "${!NODES2[@]}"; do echo "$(node_addr $((i + 1))) ${NODES2[$i]}"; done
        echo "$HOSTS_MARK end"
    } >> "$new"
    hosts_replace "$new"
}

kill_namespace() {  # every process in a node's namespace: its slurmd, slurmstepd, a job's tasks
    local node="$1" pids
    [ -e "/run/netns/$node" ] || return 0
    pids="$(ip netns pids "$node")"
    [ -n "$pids" ] || return 0
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do
        [ -n "$(ip netns pids "$node")" ] || return 0
        sleep 0.5
    done
    pids="$(ip netns pids "$node")"
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    sleep 0.5
}

kill_controller() {  # and wait for it, so that a start right after finds its port free
    pkill -f "slurmctld -f $CONF2" 2>/dev/null || return 0
    for _ in $(seq 20); do
        pgrep -f "slurmctld -f $CONF2" >/dev/null || return 0
        sleep 0.5
    done
    pkill -9 -f "slurmctld -f $CONF2" 2>/dev/null || true
}

has_slurmd() {  # a slurmd runs in the node's namespace
    local pid
    for pid in $(ip netns pids "$1" 2>/dev/null); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] && return 0
    done
    return 1
}

start_slurmd() {
    local node="$1"
    mkdir -p "$DIR2/spool/$node"   # slurmd makes no SlurmdSpoolDir of its own
    # nsenter --net, not `ip netns exec`: that mounts a fresh /sys for the namespace, without
    # /sys/fs/cgroup, and slurmd will not start without its cgroup plugin ("No filesystem mounted
    # on /sys/fs/cgroup"); the node needs only its own network and hostname.
    nsenter --net="/run/netns/$node" unshare --uts \
        sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$node" "$CONF2"
}

revive() {  # the controller and network are up, a node's slurmd is not: start it again, the queue kept
    local i node revived=()
    for node in "${NODES2[@]}"; do
        [ -e "/run/netns/$node" ] || return 1
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && [ -f "$CONF2" ] \
        && SLURM_CONF="$CONF2" timeout 10 scontrol ping 2>/dev/null | grep -q "UP" || return 1
    for i in "${!NODES2[@]}"; do  # a node cut off the network (its link down) is plugged in again
        ip link set "glv$((i + 1))" up 2>/dev/null || true
    done
    for node in "${NODES2[@]}"; do
        has_slurmd "$node" && continue
        # As a rebooted machine: what ran there without its slurmd (a job's slurmstepd and tasks
        # outlive it) goes first. Left, the old step's slurmstepd answers to the same step id as
        # the requeued job's new one, and the controller's kill for the old one ends the new one.
        kill_namespace "$node"
        start_slurmd "$node"
        revived+=("$node")
    done
    [ ${#revived[@]} -gt 0 ] || return 1
    for _ in $(seq 60); do
        if running2; then
            echo "the two-node Slurm runs again (slurmd restarted on ${revived[*]}; jobs kept); export SLURM_CONF=$CONF2"
            return 0
        fi
        sleep 1
    done
    echo "slurm_local.sh: ${revived[*]} did not come back within 60 s; logs in $DIR2/log (stop --nodes 2, then start --nodes 2)" >&2
    SLURM_CONF="$CONF2" timeout 10 sinfo -N >&2 2>/dev/null || true
    exit 1
}

start2() {
    need2
    if running2; then
        echo "the two-node Slurm already runs; export SLURM_CONF=$CONF2"
        return 0
    fi
    # A node lost (its slurmd killed, to see what Slurm does): that node back, the controller's jobs kept.
    if revive; then
        return 0
    fi
    # Otherwise whatever an earlier start left (half a network, a controller alone) goes, then all
    # afresh; and a start that fails below takes down what it made.
    stop2 >/dev/null
    trap 'stop2 >/dev/null 2>&1 || true' EXIT
    net_up
    hosts_add
    write_conf2
    start_munge
    # -c: a fresh controller state, as for the one-node cluster.
    unshare --uts sh -c 'hostname "$1" && exec slurmctld -f "$2" -c' sh "$CTL" "$CONF2"
    for node in "${NODES2[@]}"; do
        start_slurmd "$node"
    done
    for _ in $(seq 60); do
        if [ "$(nodes_idle)" = "${#NODES2[@]}" ]; then
            trap - EXIT
            echo "the two-node Slurm runs (nodes $(IFS=' '; echo "${NODES2[*]}"), partition debug); export SLURM_CONF=$CONF2"
            return 0
        fi
        sleep 1
    done
    echo "slurm_local.sh: the two-node Slurm did not come up within 60 s (taken down again); logs in $DIR2/log" >&2
    SLURM_CONF="$CONF2" timeout 10 sinfo -N >&2 2>/dev/null || true
    tail -n 5 "$DIR2/log/slurmctld.log" "$DIR2"/log/slurmd-*.log >&2 2>/dev/null || true
    exit 1
}

stop2() {  # every process, namespace, link and hosts line of the two-node cluster; its files stay
    local node
    if [ ! -f "$CONF2" ] && ! two_nodes_made; then
        echo "the two-node Slurm is not configured ($CONF2 missing)"
        return 0
    fi
    for node in "${NODES2[@]}"; do kill_namespace "$node"; done
    [ ! -f "$CONF2" ] || kill_controller
    net_down
    hosts_remove
    echo "the two-node Slurm is stopped"
}

status2() {
    if running2; then
        echo "the two-node Slurm runs; export SLURM_CONF=$CONF2"
        SLURM_CONF="$CONF2" sinfo -N
    else
        echo "the two-node Slurm does not run"
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

usage() { echo "usage: tools/slurm_local.sh install|start|stop|status|conf [--nodes 1|2]" >&2; exit 2; }

command="${1:-}"
[ $# -gt 0 ] && shift
nodes=1
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) [ $# -ge 2 ] || usage; nodes="$2"; shift 2 ;;
        --nodes=*) nodes="${1#--nodes=}"; shift ;;
        *) usage ;;
    esac
done
case "$nodes" in 1|2) ;; *) die "--nodes $nodes: this machine's Slurm has one node or two" ;; esac

if [ "$nodes" = 2 ]; then
    case "$command" in
        install) install ;;
        start) start2 ;;
        stop) stop2 ;;
        status) status2 ;;
        conf) echo "$CONF2" ;;
        *) usage ;;
    esac
else
    case "$command" in
        install) install ;;
        start) start ;;
        # The one-node cluster only, as ever (the tests stop theirs; a two-node one beside it stays).
        stop) stop; if two_nodes_made; then echo "the two-node Slurm is still up: tools/slurm_local.sh stop --nodes 2"; fi ;;
        status) status ;;
        conf) echo "$CONF" ;;
        *) usage ;;
    esac
fi
