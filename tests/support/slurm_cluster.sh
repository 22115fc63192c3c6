#!/usr/bin/env bash
# A real, throw-away Slurm cluster on this machine (loopback), for integration
# tests and CI. Debian 12 packages (Slurm 22.05, munge 0.5.15), run as root,
# no systemd needed: every daemon is started by hand and tracked by pid.
#
#   bash tests/support/slurm_cluster.sh install      # apt-get the packages if missing
#   bash tests/support/slurm_cluster.sh up DIR       # start munged, slurmctld, 4 slurmd
#   bash tests/support/slurm_cluster.sh down DIR     # stop everything `up` started
#   bash tests/support/slurm_cluster.sh status DIR   # sinfo/squeue of that cluster
#
# `up` prints progress on stderr and exactly one line on stdout:
#   export SLURM_CONF=DIR/slurm.conf
# so `eval "$(bash tests/support/slurm_cluster.sh up /tmp/rs)"` works. Every client
# command (sbatch, squeue, scontrol, ...) needs SLURM_CONF; jobs inherit it.
#
# DIR must be short (Unix socket paths live under it). The ports are fixed
# (slurmctld 6817, slurmd 17001-17004): one such cluster per machine at a time.
# `up` on a DIR that still has a cluster stops that one first; `up` fails if
# some other process already listens on those ports.
#
# Nodes: n[1-4], each claiming all `nproc` CPUs; partition `main` (default).
# Daemon logs: DIR/slurmctld.log, DIR/slurmd-nX.log, DIR/munge/munged.log,
# job completions: DIR/jobcomp.log (read with `sacct -c`).

set -u
set +m # no job control: `setsid cmd &` must exec cmd itself, so $! is its pid

NODES=(n1 n2 n3 n4)
NODE_PORT0=17001
CTLD_PORT=6817
UP_TIMEOUT=${SLURM_UP_TIMEOUT:-60}
PKGS=(slurmctld slurmd slurm-client munge)

say() { printf 'slurm_cluster.sh: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

# ---------------------------------------------------------------- install

cmd_install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        say "slurm and munge already installed ($(slurmctld -V 2>/dev/null))"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "install needs root"
    local created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        # Keep the packages' maintainer scripts from starting services.
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    say "apt-get update"
    apt-get update -qq || rc=$?
    if [ "$rc" = 0 ]; then
        say "apt-get install --no-install-recommends ${PKGS[*]}"
        apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >&2 || rc=$?
    fi
    if [ "$created_policy" = 1 ]; then
        rm -f /usr/sbin/policy-rc.d
    fi
    [ "$rc" = 0 ] || die "package install failed (exit $rc)"
    command -v slurmctld >/dev/null || die "slurmctld still missing after install"
    say "installed $(slurmctld -V 2>/dev/null)"
}

# ---------------------------------------------------------------- helpers

abs_dir() {
    local d=$1
    case $d in
        /*) ;;
        *) d="$PWD/$d" ;;
    esac
    # strip trailing slashes (but keep "/")
    while [ "${#d}" -gt 1 ] && [ "${d%/}" != "$d" ]; do d=${d%/}; done
    printf '%s' "$d"
}

# Alive = exists and is not a zombie (this machine's PID 1 reaps slowly, so
# a stopped daemon can linger as state Z).
pid_alive() {
    local pid=$1 stat state
    [ -r "/proc/$pid/stat" ] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    state=${stat##*) }
    state=${state%% *}
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# Is pid one of ours (its command line names DIR)? Guards against pid reuse.
pid_ours() {
    local pid=$1 dir=$2 cmd
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    case $cmd in
        *"$dir/"*) return 0 ;;
    esac
    return 1
}

# Listening TCP ports from /proc/net/tcp{,6} (no dependency on ss/netstat).
port_listening() {
    local port hex f
    port=$1
    hex=$(printf '%04X' "$port")
    for f in /proc/net/tcp /proc/net/tcp6; do
        [ -r "$f" ] || continue
        # field 2 = local addr:port, field 4 = state (0A = LISTEN)
        if awk -v p=":$hex" 'NR>1 && $4=="0A" && substr($2, length($2)-4)==p {found=1} END {exit !found}' "$f"; then
            return 0
        fi
    done
    return 1
}

# Pids of daemons of this cluster that are not (or no longer) in DIR/pids, and
# everything below them: slurmstepd double-forks away from slurmd and wipes
# its environment, but keeps DIR/slurmd-nX.log open; a slurmd restarted by a
# test keeps its log open too. Their descendants are the jobs' processes.
# wait_gone DIR TRIES PID...: true once none of the PIDs (of this cluster) is alive,
# false if some still are after TRIES x 0.1 s.
wait_gone() {
    local dir=$1 tries=$2 pid
    shift 2
    for _ in $(seq 1 "$tries"); do
        local alive=0
        for pid in "$@"; do
            if pid_alive "$pid" && pid_ours "$pid" "$dir"; then alive=1; fi
        done
        [ "$alive" = 0 ] && return 0
        sleep 0.1
    done
    return 1
}

stray_pids() {
    local dir=$1 p comm f roots=""
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
        case $comm in
            slurmstepd | slurmd | slurmctld | slurmscriptd | munged) ;;
            *) continue ;;
        esac
        pid_alive "$p" || continue
        for f in /proc/"$p"/fd/*; do
            case $(readlink "$f" 2>/dev/null) in
                "$dir"/*)
                    roots="$roots $p"
                    break
                    ;;
            esac
        done
    done
    [ -n "$roots" ] || return 0
    # add all descendants (pid -> ppid from /proc/*/stat)
    for p in /proc/[0-9]*/stat; do
        { cat "$p"; } 2>/dev/null
    done | awk -v roots="$roots" '
        { s = $0; sub(/^.*\) /, "", s); split(s, f, " ");
          pid = $1; ppid[pid] = f[2]; st[pid] = f[1] }
        END {
          n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
          do { changed = 0
               for (q in ppid) if (!(q in keep) && (ppid[q] in keep)) { keep[q] = 1; changed = 1 }
          } while (changed)
          for (q in keep) if ((q in st) && st[q] != "Z") print q
        }'
}

# ---------------------------------------------------------------- down

cmd_down() {
    local dir pids=() pid waited
    dir=$(abs_dir "$1")
    if [ ! -f "$dir/pids" ]; then
        say "nothing to stop in $dir (no $dir/pids)"
        return 0
    fi
    while read -r pid; do
        case $pid in '' | *[!0-9]*) continue ;; esac
        pids+=("$pid")
    done <"$dir/pids"

    # Cancel jobs first while the controller still runs, so job steps end
    # cleanly instead of being orphaned when their slurmd goes away.
    local ctld_alive=0
    for pid in "${pids[@]}"; do
        if pid_alive "$pid" && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = slurmctld ] \
            && pid_ours "$pid" "$dir"; then
            ctld_alive=1
        fi
    done
    if [ -f "$dir/slurm.conf" ] && [ "$ctld_alive" = 1 ]; then
        local jobs
        jobs=$(SLURM_CONF="$dir/slurm.conf" timeout 5 squeue -h -o %i 2>/dev/null | sort -u)
        if [ -n "$jobs" ]; then
            say "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            SLURM_CONF="$dir/slurm.conf" timeout 5 scancel $jobs 2>/dev/null || true
            for waited in $(seq 1 20); do
                [ -z "$(SLURM_CONF="$dir/slurm.conf" timeout 5 squeue -h -o %i -t R,CG 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi

    # TERM in reverse start order: slurmd's, slurmctld, munged last.
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        pid=${pids[$i]}
        if pid_alive "$pid" && pid_ours "$pid" "$dir"; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    wait_gone "$dir" 50 "${pids[@]}" || true # up to ~5 s
    for pid in "${pids[@]}"; do
        if pid_alive "$pid" && pid_ours "$pid" "$dir"; then
            say "pid $pid ignored TERM; sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    # Leftover step daemons and job processes of this cluster.
    local strays
    strays=$(stray_pids "$dir")
    if [ -n "$strays" ]; then
        say "killing leftover step daemons / job processes: $(echo $strays)"
        # shellcheck disable=SC2086
        kill -KILL $strays 2>/dev/null || true
    fi
    wait_gone "$dir" 30 "${pids[@]}" || die "some processes of $dir did not stop: ${pids[*]}"
    rm -f "$dir/pids"
    say "stopped cluster in $dir"
}

# ---------------------------------------------------------------- up

write_conf() {
    local dir=$1 ncpu=$2
    cat >"$dir/slurm.conf" <<EOF
# Generated by tests/support/slurm_cluster.sh -- a throw-away test cluster.
ClusterName=testcluster
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/msock/munge.sock,cred_expire=5

StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.log
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true

SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core

JobRequeue=1
ReturnToService=2
# slurmctld pings nodes every SlurmdTimeout/3 s. An idle node set DOWN comes
# back (ReturnToService=2) when it answers a ping: 13-17 s here, ~95 s with
# the default 300. (A node set DOWN while running a job answers the kill
# request and is back within ~20 ms; use state=drain to keep it out.)
# A slurmd killed with SIGKILL is marked DOWN after ~37 s.
SlurmdTimeout=30
MinJobAge=300
KillWait=5

NodeName=n[1-4] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$((NODE_PORT0 + ${#NODES[@]} - 1))] CPUs=$ncpu State=UNKNOWN
PartitionName=main Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP
EOF
}

declare -A DAEMON_NAME=()

# Start "$@" detached (own session, no terminal, output to a file), record pid.
start_daemon() {
    local dir=$1 name=$2 out=$3
    shift 3
    setsid "$@" </dev/null >>"$out" 2>&1 &
    local pid=$!
    echo "$pid" >>"$dir/pids"
    DAEMON_NAME[$pid]=$name
    say "started $name (pid $pid)"
}

fail_up() {
    local dir=$1
    shift
    say "ERROR: $*"
    local f
    for f in "$dir/munge/munged.log" "$dir/slurmctld.out" "$dir/slurmctld.log" \
        "$dir"/slurmd-n*.out "$dir"/slurmd-n1.log; do
        [ -s "$f" ] || continue
        say "---- last lines of $f"
        tail -n 15 "$f" >&2
    done
    say "stopping what was started"
    cmd_down "$dir" || true
    exit 1
}

cmd_up() {
    local dir
    dir=$(abs_dir "$1")
    [ "$(id -u)" = 0 ] || die "up needs root (SlurmUser=root, slurmd as root)"
    local exe
    for exe in munged slurmctld slurmd sinfo; do
        command -v "$exe" >/dev/null || die "$exe not found; run: bash $0 install"
    done
    # Longest Unix socket: DIR/spool/nX/nX_<jobid>.<stepid> (limit 108 bytes).
    if [ "${#dir}" -gt 60 ]; then
        die "DIR '$dir' is too long (${#dir} chars); use a short path such as /tmp/rs"
    fi

    # A previous cluster from the same DIR: stop it.
    if [ -f "$dir/pids" ]; then
        say "stopping previous cluster in $dir"
        cmd_down "$dir" || die "could not stop the previous cluster in $dir"
    fi
    # Somebody else's cluster on the fixed ports: refuse.
    local port busy=()
    for port in $CTLD_PORT $(seq $NODE_PORT0 $((NODE_PORT0 + ${#NODES[@]} - 1))); do
        port_listening "$port" && busy+=("$port")
    done
    if [ "${#busy[@]}" -gt 0 ]; then
        die "TCP port(s) ${busy[*]} already in use (another Slurm cluster on this machine?); stop it first (slurm_cluster.sh down <its DIR>)"
    fi

    # Fresh runtime files (only the names this script owns). Refuse a DIR
    # that has other content, so that a typo such as /tmp loses nothing.
    if [ -d "$dir" ] && [ ! -e "$dir/.cluster-sh" ] \
        && ! head -n 1 "$dir/slurm.conf" 2>/dev/null | grep -q 'cluster.sh -- a throw-away test cluster' \
        && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
        die "DIR $dir exists, is not empty and was not made by slurm_cluster.sh; use a new or empty folder"
    fi
    mkdir -p "$dir" || die "cannot create $dir"
    : >"$dir/.cluster-sh"
    chmod 0755 "$dir"
    rm -rf "$dir/munge" "$dir/msock" "$dir/state" "$dir/spool"
    rm -f "$dir"/slurm.conf "$dir"/pids "$dir"/*.log "$dir"/*.out "$dir"/*.pid
    mkdir -p "$dir/munge" "$dir/msock" "$dir/state"
    chmod 0700 "$dir/munge"  # key folder: private
    chmod 0755 "$dir/msock"  # socket folder: everyone may enter
    local n
    for n in "${NODES[@]}"; do mkdir -p "$dir/spool/$n"; done
    : >"$dir/pids"

    local t0=$EPOCHREALTIME
    # ---- munge
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none \
        || die "cannot write munge key"
    chmod 0400 "$dir/munge/munge.key"
    # In the foreground (-F) munged logs to stderr, not to --log-file.
    start_daemon "$dir" munged "$dir/munge/munged.log" \
        munged -F --key-file="$dir/munge/munge.key" --socket="$dir/msock/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    local i
    for i in $(seq 1 100); do
        [ -S "$dir/msock/munge.sock" ] && break
        pid_alive "$(tail -n 1 "$dir/pids")" || fail_up "$dir" "munged exited at start"
        sleep 0.1
    done
    [ -S "$dir/msock/munge.sock" ] || fail_up "$dir" "munged socket $dir/msock/munge.sock did not appear"

    # ---- slurm
    write_conf "$dir" "$(nproc)"
    export SLURM_CONF="$dir/slurm.conf"
    start_daemon "$dir" slurmctld "$dir/slurmctld.out" slurmctld -D -c -f "$dir/slurm.conf"
    for n in "${NODES[@]}"; do
        start_daemon "$dir" "slurmd $n" "$dir/slurmd-$n.out" slurmd -D -N "$n" -f "$dir/slurm.conf"
    done

    # ---- wait until all nodes are idle
    local deadline=$((SECONDS + UP_TIMEOUT)) states idle pid
    while :; do
        while read -r pid; do
            pid_alive "$pid" || fail_up "$dir" "${DAEMON_NAME[$pid]:-daemon} (pid $pid) exited during start"
        done <"$dir/pids"
        states=$(timeout 5 sinfo -h -N -p main -o '%N %t' 2>/dev/null)
        idle=$(printf '%s\n' "$states" | awk '$2=="idle"' | sort -u | wc -l)
        [ "$idle" -ge "${#NODES[@]}" ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            fail_up "$dir" "nodes not all idle after ${UP_TIMEOUT}s; sinfo says: $(echo $states)"
        fi
        sleep 0.2
    done
    say "cluster up in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}') s: $(echo $states)"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

cmd_status() {
    local dir
    dir=$(abs_dir "$1")
    export SLURM_CONF="$dir/slurm.conf"
    sinfo -N -o '%N %t %C %E'
    squeue
}

# ---------------------------------------------------------------- main

[ $# -ge 1 ] || usage
case $1 in
    install) cmd_install ;;
    up)     [ $# -eq 2 ] || usage; cmd_up "$2" ;;
    down)   [ $# -eq 2 ] || usage; cmd_down "$2" ;;
    status) [ $# -eq 2 ] || usage; cmd_status "$2" ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
