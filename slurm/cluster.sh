#!/usr/bin/env bash
# A real SLURM cluster of two nodes on this machine, for the tests and for trying the SLURM launcher:
# two slurmd daemons (a SLURM built with multiple slurmd, as Debian's is), nodes memo1 and memo2,
# each with this machine's CPUs, so that a job across nodes runs for real.
#
#   slurm/cluster.sh install             apt-get install what is missing
#   slurm/cluster.sh start  [STATE_DIR]  start munged, mariadbd, slurmdbd, slurmctld, two slurmd; print the env
#   slurm/cluster.sh stop   [STATE_DIR]  cancel jobs, stop the daemons, remove STATE_DIR
#   slurm/cluster.sh status [STATE_DIR]  sinfo and which daemons run
#   slurm/cluster.sh env    [STATE_DIR]  the export lines a client needs
#
# Every file (config, keys, database, sockets, pids, logs) lives in STATE_DIR, so the cluster
# neither reads nor disturbs a system SLURM, munge or MariaDB.  Start it with
#   eval "$(slurm/cluster.sh start)"
set -euo pipefail

# mariadb-server-core has the server without the system service; the client core has the
# my_print_defaults that mariadb-install-db needs; procps has pgrep.
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server-core mariadb-client-core procps)
DEFAULT_STATE_DIR="${TMPDIR:-/tmp}/memo-slurm"
CLUSTER_NAME=memo
PARTITION=debug
ACCOUNT=memo
NODES=("${CLUSTER_NAME}1" "${CLUSTER_NAME}2")
SLURMDS=("${NODES[@]/#/slurmd-}")  # a slurmd per node: its pid file slurmd-<node>.pid, its log slurmd-<node>.log
# Daemons in start order.
DAEMONS=(munged mariadbd slurmdbd slurmctld "${SLURMDS[@]}")
START_TIMEOUT_S=60

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

note() { echo "cluster.sh: $*" >&2; }

# --- install -------------------------------------------------------------------------------------

cmd_install() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed || missing+=("$pkg")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    local apt="apt-get install -y --no-install-recommends ${missing[*]}"
    [[ $EUID -eq 0 ]] || die "missing packages; run: sudo $apt"
    # The cluster runs its own daemons; keep the packages' init scripts from starting system ones
    # (a system slurmctld without a slurm.conf fails, and would fail the install with it).
    local policy=/usr/sbin/policy-rc.d
    if [[ ! -e $policy ]]; then
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Wait for another apt-get (a parallel test run installing the same) rather than fail.
    local apt_get=(apt-get -q -o DPkg::Lock::Timeout=300)
    # apt-get update only when the package lists lack a package (a fresh image has no lists).
    { "${apt_get[@]}" install -y --no-install-recommends "${missing[@]}" \
        || { "${apt_get[@]}" update && "${apt_get[@]}" install -y --no-install-recommends "${missing[@]}"; }
    } >&2 || die "apt-get install failed: $apt"
}

# --- state directory -----------------------------------------------------------------------------

# Absolute STATE_DIR.  Unix socket paths in it (slurmd's spool/<node>_<job>.<step> too) must stay
# under 108 bytes, and slurm.conf has no quoting for spaces.
set_state_dir() {
    local dir="${1:-$DEFAULT_STATE_DIR}"
    [[ $dir == /* ]] || dir="$PWD/$dir"
    S="${dir%/}"
    [[ ${#S} -le 64 ]] || die "state dir path too long for unix sockets (${#S} > 64 chars): $S"
    [[ $S != *[[:space:]]* ]] || die "state dir path has spaces: $S"
    SLURM_CONF_FILE="$S/slurm.conf"
    MUNGE_SOCKET="$S/munge.sock"
    MYSQL_SOCKET="$S/mysql.sock"
}

alive() { # PID: exists and is no zombie (a daemon's dead child waits for init to reap it)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ $stat != Z* ]]
}

pid_of() { # DAEMON (or slurmd-<node>) -> pid if it runs from this state dir, else nothing
    local name=${1%%-*} pidfile="$S/$1.pid" pid
    [[ -r $pidfile ]] || return 1
    pid=$(head -n1 "$pidfile" 2>/dev/null | tr -dc 0-9)
    [[ -n $pid ]] || return 1
    # A pid file can outlive its process and the pid be reused: the name must match too.
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] && alive "$pid" || return 1
    echo "$pid"
}

running() { pid_of "$1" >/dev/null; }

# Clients need only slurm.conf: it names the ports and munged's socket (AuthInfo).
print_env() {
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
}

log_tail() {
    local f
    for f in "$@"; do
        [[ -s $S/$f ]] || continue
        echo "--- $S/$f" >&2
        tail -n 20 "$S/$f" >&2
    done
}

fail_start() {
    note "$1"
    log_tail munged.log mariadbd.log slurmdbd.log slurmctld.log "${SLURMDS[@]/%/.log}"
    die "start failed; state kept in $S (slurm/cluster.sh stop $S cleans up)"
}

wait_for() { # SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || fail_start "timed out waiting for $what"
        sleep 0.2
    done
}

# --- ports ---------------------------------------------------------------------------------------

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Four consecutive free ports in 16817-17816, away from SLURM's defaults (6817-6819) so a system
# SLURM can run too.  The search starts at a place derived from STATE_DIR, so that clusters started
# side by side (parallel test runs) do not race for the same ports.
pick_ports() {
    local start base i
    start=$(($(printf '%s' "$S" | cksum | cut -d' ' -f1) % 100))
    for ((i = 0; i < 100; i++)); do
        base=$((16817 + 10 * ((start + i) % 100)))
        port_busy $base || port_busy $((base + 1)) || port_busy $((base + 2)) || port_busy $((base + 3)) || {
            CTLD_PORT=$base SLURMD_PORT=$((base + 1)) DBD_PORT=$((base + 2)) SLURMD_PORT_2=$((base + 3))
            return 0
        }
    done
    die "no four free ports in 16817-17816"
}

# --- start ---------------------------------------------------------------------------------------

write_configs() {
    local user host node_line
    user=$(id -un)
    host=$(hostname -s 2>/dev/null || uname -n)
    host=${host%%.*}
    # The host's real CPUs, sockets and memory, as slurmd itself will report them at registration
    # (each node has them all: a node's CPUs are what its jobs may be given).
    node_line=$(SLURM_CONF=/dev/null slurmd -C 2>/dev/null | sed -n "s/^NodeName=[^ ]* //p")
    [[ -n $node_line ]] || die "slurmd -C printed no node line"

    cat >"$S/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=$user
PidFile=$S/slurmdbd.pid
LogFile=$S/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$user
StorageLoc=slurm_acct_db
EOF
    # slurmdbd refuses a config others can read (it may hold the database password).
    chmod 600 "$S/slurmdbd.conf"

    cat >"$S/slurm.conf" <<EOF
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
# cred_expire also delays a requeued job's restart (default 120 s)
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
CredType=cred/munge
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd-%n.pid
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups needed: plain /proc process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# CPUs are the only consumable, so jobs need no --mem and several fit side by side.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Accounting: sacct must report the final state of every job, also of those killed hard.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# Messages to slurmdbd take their munge socket from here, not from AuthInfo.
AccountingStoragePass=$MUNGE_SOCKET
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
# Schedule a job when it is submitted, not up to 3 s later.
SchedulerParameters=batch_sched_delay=0
# A node that was down comes back by itself; finished jobs leave squeue quickly (sacct keeps them).
ReturnToService=2
MinJobAge=10
KillWait=5
SlurmdTimeout=60
InactiveLimit=0
MailProg=/bin/true
# both daemons on this host (NodeHostname), each at its own port
NodeName=${NODES[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$SLURMD_PORT $node_line State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$SLURMD_PORT_2 $node_line State=UNKNOWN
PartitionName=$PARTITION Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munged() {
    [[ -s $S/munge.key ]] || mungekey --create --keyfile="$S/munge.key" >&2
    # munged refuses a key that others can read.
    chmod 400 "$S/munge.key"
    munged --socket="$MUNGE_SOCKET" --key-file="$S/munge.key" --pid-file="$S/munged.pid" \
        --log-file="$S/munged.log" --seed-file="$S/munged.seed" >&2 \
        || fail_start "munged did not start"
    wait_for 10 "munged's socket" test -S "$MUNGE_SOCKET"
}

start_mariadbd() {
    local opts=(--no-defaults --datadir="$S/db" --socket="$MYSQL_SOCKET" --pid-file="$S/mariadbd.pid"
        --log-error="$S/mariadbd.log" --user="$(id -un)" --skip-networking --skip-name-resolve
        # slurmdbd's recommended InnoDB sizes; a throw-away database, so no fsync per commit.
        --innodb-buffer-pool-size=256M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900
        --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0)
    if [[ ! -d $S/db/mysql ]]; then
        # The OS user connects through the socket with no password (unix_socket authentication).
        mariadb-install-db "${opts[@]}" --auth-root-authentication-method=socket --skip-test-db \
            >"$S/mariadb-install-db.log" 2>&1 || {
            log_tail mariadb-install-db.log
            fail_start "mariadb-install-db failed"
        }
    fi
    mariadbd "${opts[@]}" </dev/null >/dev/null 2>&1 &
    disown
    wait_for 30 "mariadbd's socket" test -S "$MYSQL_SOCKET"
}

start_slurmdbd() {
    # slurmdbd reads slurmdbd.conf next to $SLURM_CONF, and has no option for MariaDB's socket: the
    # client library takes it from MYSQL_UNIX_PORT.
    MYSQL_UNIX_PORT="$MYSQL_SOCKET" slurmdbd >&2 || fail_start "slurmdbd did not start"
    wait_for 30 "slurmdbd" timeout 5 sacctmgr -n list cluster
}

register_accounts() {
    local user
    # Registering the cluster before slurmctld starts lets it connect to slurmdbd at once.  Limits are
    # not enforced, so the account only gives every job a default one to be recorded under.
    sacctmgr_add cluster "$CLUSTER_NAME"
    sacctmgr_add account "$ACCOUNT" Cluster="$CLUSTER_NAME" Description=local Organization=local
    sacctmgr_add user "$(id -un)" DefaultAccount="$ACCOUNT" Cluster="$CLUSTER_NAME"
    if [[ -n ${SUDO_USER:-} && $SUDO_USER != "$(id -un)" ]]; then
        sacctmgr_add user "$SUDO_USER" DefaultAccount="$ACCOUNT" Cluster="$CLUSTER_NAME"
    fi
}

sacctmgr_add() {
    timeout 10 sacctmgr -i -Q add "$@" >/dev/null || fail_start "sacctmgr add $* failed"
}

nodes_idle() {
    local states
    states=$(timeout 5 sinfo -h -N -o %T 2>/dev/null) || return 1
    [[ $(grep -cx idle <<<"$states") -eq ${#NODES[@]} ]]
}

cluster_up() {
    local d
    for d in "${DAEMONS[@]}"; do running "$d" || return 1; done
}

cmd_start() {
    set_state_dir "${1:-}"
    export SLURM_CONF="$SLURM_CONF_FILE"
    if [[ -e $S/.memo-slurm ]]; then
        if cluster_up; then
            note "cluster already up in $S"
            print_env
            return 0
        fi
        note "partial cluster in $S; restarting it"
        cmd_stop "$S"
    fi
    [[ $EUID -eq 0 ]] || die "start needs root (slurmd runs jobs as their users)"
    # stop removes STATE_DIR: never adopt a directory that holds anything else.
    [[ ! -e $S || -z $(ls -A "$S") ]] || die "$S exists and is not empty; pick another state dir"
    local cmd
    for cmd in munged mungekey mariadbd mariadb-install-db slurmdbd slurmctld slurmd sacctmgr sinfo pgrep; do
        command -v "$cmd" >/dev/null || die "$cmd not found; run: slurm/cluster.sh install"
    done

    mkdir -p "$S/ctld" "${NODES[@]/#/$S/spool/}"
    # Every user's clients read slurm.conf and talk to munged's socket in here.
    chmod 755 "$S"
    touch "$S/.memo-slurm"
    pick_ports
    write_configs

    start_munged
    start_mariadbd
    start_slurmdbd
    register_accounts
    # Daemons print nothing on stdout: it carries only the export lines.
    slurmctld -f "$SLURM_CONF_FILE" >&2 || fail_start "slurmctld did not start"
    local node
    for node in "${NODES[@]}"; do
        slurmd -f "$SLURM_CONF_FILE" -N "$node" >&2 || fail_start "slurmd of $node did not start"
    done
    wait_for "$START_TIMEOUT_S" "nodes ${NODES[*]} to be idle" nodes_idle
    wait_for 10 "sacct" timeout 5 sacct -n -X
    note "cluster up in $S (slurmctld :$CTLD_PORT, slurmd :$SLURMD_PORT and :$SLURMD_PORT_2, slurmdbd :$DBD_PORT)"
    print_env
}

# --- stop ----------------------------------------------------------------------------------------

stop_daemons() { # NAME...: SIGTERM together, SIGKILL whatever still runs 10 s later
    local name pid pids=() i left
    for name in "$@"; do
        pid=$(pid_of "$name") && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    for ((i = 0; i < 100; i++)); do
        left=()
        for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
        [[ ${#left[@]} -gt 0 ]] || return 0
        sleep 0.1
    done
    note "killing $* (SIGTERM ignored for 10 s)"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

descendants() { # PID -> its children, their children, ...
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child"
        descendants "$child"
    done
}

# Job steps whose slurmd is gone (it was killed) live on: find their slurmstepd by this cluster's
# SLURM_CONF in its environment, and kill it with the job's processes.
kill_stray_steps() {
    local pid
    for pid in $(pgrep -x slurmstepd || true); do
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF_FILE" || continue
        # shellcheck disable=SC2046
        kill -KILL "$pid" $(descendants "$pid") 2>/dev/null || true
    done
}

cmd_stop() {
    set_state_dir "${1:-}"
    [[ -e $S ]] || { note "no cluster in $S"; return 0; }
    [[ -e $S/.memo-slurm ]] || die "$S is not a cluster state dir; not touching it"
    export SLURM_CONF="$SLURM_CONF_FILE"
    if running slurmctld && running "${SLURMDS[0]}"; then
        local jobs i
        jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs 2>/dev/null || true
            # slurmd kills the jobs' processes; give it a moment before it goes.
            for ((i = 0; i < 50; i++)); do
                [[ -z $(timeout 5 squeue -h -t running,completing -o %A 2>/dev/null) ]] && break
                sleep 0.2
            done
        fi
    fi
    # The SLURM daemons still talk to slurmdbd, MariaDB and munged while they shut down.
    stop_daemons "${SLURMDS[@]}" slurmctld slurmdbd
    stop_daemons mariadbd munged
    kill_stray_steps
    rm -rf "$S"
    note "stopped; removed $S"
}

# --- status, env ---------------------------------------------------------------------------------

cmd_status() {
    set_state_dir "${1:-}"
    [[ -e $S/.memo-slurm ]] || die "no cluster in $S"
    export SLURM_CONF="$SLURM_CONF_FILE"
    local d pid up=1
    for d in "${DAEMONS[@]}"; do
        if pid=$(pid_of "$d"); then
            printf '%-10s running (pid %s)\n' "$d" "$pid"
        else
            printf '%-10s not running\n' "$d"
            up=0
        fi
    done
    if running slurmctld; then timeout 10 sinfo || up=0; fi
    [[ $up -eq 1 ]]
}

cmd_env() {
    set_state_dir "${1:-}"
    [[ -e $S/slurm.conf ]] || die "no cluster in $S"
    print_env
}

main() {
    local cmd=${1:-}
    [[ $# -gt 0 ]] && shift
    case $cmd in
        install) [[ $# -eq 0 ]] || die "usage: cluster.sh install"; cmd_install ;;
        start | stop | status | env)
            [[ $# -le 1 ]] || die "usage: cluster.sh $cmd [STATE_DIR]"
            "cmd_$cmd" "$@"
            ;;
        *) die "usage: cluster.sh install | start|stop|status|env [STATE_DIR]" ;;
    esac
}

main "$@"
