#!/usr/bin/env bash
# A Slurm cluster of N nodes on one Linux machine, to try the multi-node templates before a real cluster.
#
#   sudo bash tools/cluster.sh up [N]          # N nodes (default 2): node1 .. nodeN
#   sbatch --nodes=2 ... launch/slurm/pretrain.sbatch ...   # from the same machine (see docs/scaling.md)
#   bash tools/cluster.sh status               # nodes, daemons, jobs
#   bash tools/cluster.sh exec node2 CMD ...    # run CMD on node2 (its network, hostname and /etc/hosts)
#   bash tools/cluster.sh partition node2      # node2's network link down (its processes keep running)
#   bash tools/cluster.sh heal node2           # and up again
#   bash tools/cluster.sh down                 # stop and remove everything up made
#
# Each node is a network namespace (mtk-nodeI) with its own hostname (a UTS namespace) and the address
# 10.213.47.(10+I) on a private bridge (mtkbr0, 10.213.47.1: this machine's own side, from which the
# client commands run); the controller is one more namespace, mtk-head (hostname head, 10.213.47.2). No
# traffic leaves the machine. The filesystem is the machine's, shared by every node as on a cluster with
# a shared filesystem. Daemons: one munged (a UNIX socket every node reaches); on head, slurmctld and its
# accounting (slurmdbd over a MariaDB of its own, so that sacct works); on every node a slurmd and an sshd
# (root logs in with a key made here, for DeepSpeed's pdsh/ssh path). The node names resolve inside the
# hosts (each has a mount namespace whose /etc/hosts names the hosts, and whose /etc/ssh/ssh_config
# knows them: the machine's own ssh settings are not touched). Slurm's client commands read
# /etc/slurm/slurm.conf, which up writes when there is none (else it prints the `export SLURM_CONF=...` to
# use). State and logs: $MEGATOK_CLUSTER_DIR (default /run/megatok-cluster), which up makes (it refuses a
# directory that is there and not its own) and marks; the subnet: $MEGATOK_CLUSTER_NET (default
# 10.213.47), refused when a route of the machine overlaps it.
#
# Needs root and network namespaces; installs slurmctld, slurmd, slurmdbd, slurm-client, munge,
# mariadb-server, openssh-server and pdsh with apt-get when missing (no package starts its service). Every
# daemon runs in the foreground of a process whose id and start time are kept in the state directory,
# and every namespace, link, mount and file up makes outside it is listed there ($STATE/made); down ends
# those daemons (a pid now held by another process is left alone) and every process in the namespaces
# it made (jobs), and undoes what the list names, nothing else. up after a crash cleans up first.
set -euo pipefail

STATE=${MEGATOK_CLUSTER_DIR:-/run/megatok-cluster}
NET=${MEGATOK_CLUSTER_NET:-10.213.47}
BRIDGE=mtkbr0
MARK="# written by megatok tools/cluster.sh"
OWN=.megatok-cluster                              # in $STATE: the mark of a directory up made
SSH_CONF=/etc/ssh/ssh_config.d/megatok-cluster.conf  # written by versions before 2026-12-07: down removes it
SLURM_ETC=/etc/slurm/slurm.conf
KILL_WAIT=${MEGATOK_CLUSTER_KILL_WAIT:-10}       # Slurm's KillWait: SIGTERM to SIGKILL, seconds
SLURMD_TIMEOUT=${MEGATOK_CLUSTER_SLURMD_TIMEOUT:-60}

die() { echo "cluster: error: $*" >&2; exit 1; }
say() { echo "cluster: $*"; }

nodes() { [[ -f $STATE/nodes ]] && cat "$STATE/nodes" || true; }      # node1 node2 ...
addr() { [[ $1 == head ]] && echo "$NET.2" || echo "$NET.$((10 + ${1#node}))"; }
ns() { echo "mtk-$1"; }                                                 # the network namespace of a host
veth() { echo "mtkv-$1"; }                                              # its link's end on the bridge

# Run a command on a host (head or nodeI), in the current directory: its network namespace, its hostname
# and its mount namespace (the machine's mounts, and /etc/hosts naming the cluster's hosts).
on() {
    local host=$1; shift
    nsenter --net="/run/netns/$(ns "$host")" --uts="$STATE/ns/$host.uts" --mount="$STATE/ns/$host.mnt" \
        --wd="$PWD" -- "$@"
}

# Start a daemon in the foreground on a host, detached, its pid kept in $STATE/pids/NAME and its start
# time in $STATE/starts/NAME.
start() {
    local name=$1 host=$2; shift 2
    # one simple command, each program exec'ing the next: $! is the daemon's own pid
    nsenter --net="/run/netns/$(ns "$host")" --uts="$STATE/ns/$host.uts" --mount="$STATE/ns/$host.mnt" \
        --wd=/ -- setsid "$@" > "$STATE/log/$name.out" 2>&1 < /dev/null &
    echo $! > "$STATE/pids/$name"
    started_at $! > "$STATE/starts/$name" || true
}

# A process's start time (field 22 of /proc/PID/stat, after the command name in parentheses), or fail.
started_at() {
    local stat
    stat=$(cat "/proc/$1/stat" 2> /dev/null) || return 1
    stat=${stat##*) }
    set -- $stat
    echo "${20}"
}

# Record something up made outside $STATE (KIND NAME): down undoes exactly these, last first.
made() { echo "$*" >> "$STATE/made"; }
made_list() { [[ -f $STATE/made ]] && tac "$STATE/made" | awk -v k="$1" '$1 == k {print $2}' || true; }

need_root() {
    [[ $(id -u) == 0 ]] || die "must run as root (network namespaces, daemons)"
    ip netns list > /dev/null 2>&1 || die "network namespaces are not available (ip netns list failed)"
}

install_packages() {
    local missing=()
    command -v slurmctld > /dev/null || missing+=(slurmctld)
    command -v slurmd > /dev/null || missing+=(slurmd)
    command -v slurmdbd > /dev/null || [[ -x /usr/sbin/slurmdbd ]] || missing+=(slurmdbd)
    command -v mariadbd > /dev/null || [[ -x /usr/sbin/mariadbd ]] || missing+=(mariadb-server)
    command -v sbatch > /dev/null || missing+=(slurm-client)
    command -v munged > /dev/null || missing+=(munge)
    command -v sshd > /dev/null || [[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
    command -v ssh > /dev/null || missing+=(openssh-client)
    command -v pdsh > /dev/null || missing+=(pdsh)
    command -v nsenter > /dev/null || missing+=(util-linux)
    command -v ip > /dev/null || missing+=(iproute2)
    if (( ${#missing[@]} )); then
        say "installing ${missing[*]} (apt-get)"
        command -v apt-get > /dev/null || die "missing ${missing[*]} and no apt-get to install them"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        # no package starts its service here (as in a container): this script starts what it needs
        local policy=/usr/sbin/policy-rc.d made_policy=""
        if [[ ! -e $policy ]]; then
            # removed however this ends (a failed install, Ctrl-C, a kill): the machine as it was
            trap 'rm -f /usr/sbin/policy-rc.d' EXIT
            trap 'rm -f /usr/sbin/policy-rc.d; exit 130' INT TERM HUP
            printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; made_policy=1
        fi
        local rc=0
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null || rc=$?
        if [[ -n $made_policy ]]; then rm -f "$policy"; trap - EXIT INT TERM HUP; fi
        (( rc == 0 )) || die "apt-get install ${missing[*]} failed (exit $rc)"
    fi
}

# Whether a process runs (a zombie does not: the daemons' parent is init, which reaps when it can).
alive() { [[ $(ps -o stat= -p "$1" 2> /dev/null) =~ ^[^Z] ]]; }

# Ends processes and waits for them: SIGTERM, then SIGKILL to those left after 5 s.
stop_pids() {
    local pid i left
    (( $# )) || return 0
    kill -TERM "$@" 2> /dev/null || true
    for i in $(seq 50); do
        left=()
        for pid; do alive "$pid" && left+=("$pid"); done
        (( ${#left[@]} )) || return 0
        sleep 0.1
    done
    kill -KILL "${left[@]}" 2> /dev/null || true
    for pid in "${left[@]}"; do while alive "$pid"; do sleep 0.05; done; done
}

# Whether $STATE is a directory up made (its mark), and not something else of the same name.
ours() { [[ -d $STATE && -f $STATE/$OWN && ! -L $STATE ]]; }

cmd_down() {
    [[ -e $STATE ]] || return 0
    ours || die "$STATE was not made by tools/cluster.sh up (no $OWN in it): not touching it"
    need_root
    local f name pid host pids want
    # the daemons first, by the ids recorded when they started, if those ids still hold the same processes
    local daemons=()
    for f in "$STATE"/pids/*; do
        [[ -f $f ]] || continue
        pid=$(cat "$f"); name=$(basename "$f")
        want=$(cat "$STATE/starts/$name" 2> /dev/null || true)
        if [[ -n $want && $(started_at "$pid" 2> /dev/null) == "$want" ]]; then daemons+=("$pid")
        elif alive "$pid"; then say "not ending pid $pid ($name): it is another process now"; fi
    done
    stop_pids "${daemons[@]}"
    rm -rf "$STATE/pids" "$STATE/starts"
    # whatever is left on the hosts (jobs, their ssh sessions): the processes in the namespaces up made
    for name in $(made_list netns); do
        ip netns list | awk '{print $1}' | grep -qx "$name" || continue
        pids=$(ip netns pids "$name" 2> /dev/null || true)
        for pid in $pids; do kill -KILL "$pid" 2> /dev/null || true; done
        for pid in $pids; do while alive "$pid"; do sleep 0.05; done; done
        ip netns del "$name"
    done
    for name in $(made_list link); do ip link del "$name" 2> /dev/null || true; done
    if [[ -d $STATE/ns ]]; then
        for f in "$STATE"/ns/*; do [[ -e $f ]] && { umount "$f" 2> /dev/null || true; }; done
        umount "$STATE/ns" 2> /dev/null || true
    fi
    for f in $(made_list file); do [[ -f $f ]] && grep -q "^$MARK" "$f" && rm -f "$f"; done
    [[ -f $SSH_CONF ]] && grep -q "^$MARK" "$SSH_CONF" && rm -f "$SSH_CONF"  # an older version's
    for f in $(made_list dir); do rmdir "$f" 2> /dev/null || true; done
    rm -rf "$STATE"
    return 0
}

# The routes of this machine that overlap $NET.0/24 (none: the cluster's subnet is free).
overlapping_routes() {
    { ip -4 route show root "$NET.0/24"; ip -4 route show match "$NET.1" | grep -v '^default'; } 2> /dev/null \
        | sort -u
}

write_slurm_conf() {
    local n=$1 cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / n ))
    cat > "$STATE/slurm.conf" << EOF
$MARK: an N-node cluster on one machine (bash tools/cluster.sh down removes it)
ClusterName=megatok
SlurmctldHost=head($(addr head))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$(addr head)
AccountingStoragePass=$STATE/munge/munge.socket
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
KillWait=$KILL_WAIT
MinJobAge=600
InactiveLimit=0
NodeName=node[1-$n] NodeAddr=$NET.[11-$((10 + n))] CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cluster Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# Slurm's accounting on head: a MariaDB of its own (its data in $STATE/mysql, listening on head's own
# loopback) and slurmdbd, which slurmctld reports every job to; sacct reads it.
start_accounting() {
    local i
    mariadb-install-db --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=normal \
        --skip-test-db > "$STATE/log/mariadb-install.out" 2>&1 || die "mariadb-install-db failed: $STATE/log"
    start mariadbd head mariadbd --user=root --datadir="$STATE/mysql" --socket="$STATE/run/mysqld.sock" \
        --bind-address=127.0.0.1 --port=3306 --pid-file="$STATE/run/mysqld.pid" --log-error="$STATE/log/mariadb.log"
    for i in $(seq 300); do [[ -S $STATE/run/mysqld.sock ]] && break; sleep 0.1; done
    [[ -S $STATE/run/mysqld.sock ]] || die "MariaDB did not start: $(tail -3 "$STATE/log/mariadb.log")"
    mariadb --socket="$STATE/run/mysqld.sock" -e "CREATE USER 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    cat > "$STATE/slurmdbd.conf" << EOF
$MARK
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
DbdHost=head
DbdAddr=$(addr head)
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
    chmod 600 "$STATE/slurmdbd.conf"
    start slurmdbd head slurmdbd -D  # its slurmdbd.conf: next to $SLURM_CONF
    for i in $(seq 300); do sacctmgr -i -n list cluster > /dev/null 2>&1 && break; sleep 0.1; done
    sacctmgr -i -n list cluster > /dev/null 2>&1 || die "slurmdbd did not start: $(tail -3 "$STATE/log/slurmdbd.log")"
    sacctmgr -i add cluster megatok > /dev/null
}

# ssh's settings on the cluster's hosts (bound over their /etc/ssh/ssh_config): root to the nodes with the
# key made here, then the machine's own settings.
write_ssh_config() {
    local host
    mkdir -p "$STATE/ssh"
    {
        echo "$MARK"
        for host in $(nodes); do
            printf 'Host %s\n    HostName %s\n' "$host" "$(addr "$host")"
        done
        printf 'Host %s\n' "$(nodes)"
        echo "    User root"
        echo "    IdentityFile $STATE/ssh/id_ed25519"
        echo "    IdentitiesOnly yes"
        echo "    UserKnownHostsFile $STATE/ssh/known_hosts"
        echo "    StrictHostKeyChecking yes"
        echo "    BatchMode yes"
        echo "Host *"
        cat /etc/ssh/ssh_config
    } > "$STATE/ssh/ssh_config"
}

cmd_up() {
    local n=${1:-2} host i
    [[ $n =~ ^[1-9]$ ]] || die "up N: N from 1 to 9, not '$n'"
    [[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "MEGATOK_CLUSTER_NET: three octets such as 10.213.47, not '$NET'"
    need_root
    if [[ -e $STATE ]]; then
        ours || die "$STATE is there and was not made by tools/cluster.sh up: choose another MEGATOK_CLUSTER_DIR"
        say "cleaning up what an earlier up left"
        cmd_down
    fi
    [[ -z $(overlapping_routes) ]] || die "the subnet $NET.0/24 overlaps this machine's routes ($(overlapping_routes \
        | tr '\n' ';')): set MEGATOK_CLUSTER_NET to a free one"
    local taken=""
    for host in head $(for ((i = 1; i <= n; i++)); do echo "node$i"; done); do
        if ip netns list | awk '{print $1}' | grep -qx "$(ns "$host")"; then taken+=" $(ns "$host")"; fi
    done
    if ip link show "$BRIDGE" > /dev/null 2>&1; then taken+=" $BRIDGE"; fi
    [[ -z $taken ]] || die "network namespaces or links of these names are there and not this cluster's:$taken"
    install_packages
    mkdir -p "$STATE"
    chmod 700 "$STATE"
    touch "$STATE/$OWN"
    mkdir -p "$STATE"/{pids,starts,log,run,munge,slurmctld,slurmd,ssh,ns,mysql}
    echo $(for ((i = 1; i <= n; i++)); do echo "node$i"; done) > "$STATE/nodes"
    # a hostname and a mount namespace per host, each kept by a bind mount of its file (on a private
    # mount, as ip netns keeps its own)
    mount --bind "$STATE/ns" "$STATE/ns"
    mount --make-private "$STATE/ns"
    ip link add "$BRIDGE" type bridge && made link "$BRIDGE"
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # the hosts by name, also as the IPv4-mapped IPv6 addresses a dual-stack socket sees (torch's store); no
    # DNS server on this network (a name not listed fails at once, asking nothing outside the machine)
    { echo "127.0.0.1 localhost"
      for host in head $(nodes); do echo "$(addr "$host") $host"; echo "::ffff:$(addr "$host") $host"; done
    } > "$STATE/hosts"
    echo "nameserver 127.0.0.1" > "$STATE/resolv.conf"
    [[ -f /etc/ssh/ssh_config ]] || die "no /etc/ssh/ssh_config (openssh-client) to extend on the hosts"
    write_ssh_config
    for host in head $(nodes); do
        ip netns add "$(ns "$host")" && made netns "$(ns "$host")"
        ip link add "$(veth "$host")" type veth peer name eth0 netns "$(ns "$host")" && made link "$(veth "$host")"
        ip link set "$(veth "$host")" master "$BRIDGE" up
        ip -n "$(ns "$host")" addr add "$(addr "$host")/24" dev eth0
        ip -n "$(ns "$host")" link set eth0 up
        ip -n "$(ns "$host")" link set lo up
        touch "$STATE/ns/$host.uts" "$STATE/ns/$host.mnt"
        unshare --uts="$STATE/ns/$host.uts" hostname "$host"
        # the machine's mounts as they change (a slave), but /etc/hosts and ssh's settings of its own
        unshare --mount="$STATE/ns/$host.mnt" --propagation slave \
            sh -c "mount --bind $STATE/hosts /etc/hosts && mount --bind $STATE/resolv.conf /etc/resolv.conf \
                   && mount --bind $STATE/ssh/ssh_config /etc/ssh/ssh_config"
    done

    # munge: one daemon, one key; every node reaches its socket through the shared filesystem
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$STATE/munge/munge.key"
    chmod 700 "$STATE/munge"
    start munged head munged --foreground --force --key-file="$STATE/munge/munge.key" \
        --socket="$STATE/munge/munge.socket" --pid-file="$STATE/run/munged.pid" \
        --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"
    for i in $(seq 100); do [[ -S $STATE/munge/munge.socket ]] && break; sleep 0.1; done
    [[ -S $STATE/munge/munge.socket ]] || die "munged did not start: $(tail -3 "$STATE/log/munged.out")"

    write_slurm_conf "$n"
    export SLURM_CONF=$STATE/slurm.conf
    start_accounting
    start slurmctld head slurmctld -D -i -f "$SLURM_CONF"
    for host in $(nodes); do
        mkdir -p "$STATE/slurmd/$host"
        start "slurmd-$host" "$host" slurmd -D -N "$host" -f "$SLURM_CONF"
    done

    # ssh between nodes as root, with a key made here; host keys known in advance
    ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/id_ed25519" -C megatok-cluster
    ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/host_ed25519_key" -C megatok-cluster-host
    cp "$STATE/ssh/id_ed25519.pub" "$STATE/ssh/authorized_keys"
    : > "$STATE/ssh/known_hosts"
    for host in $(nodes); do
        echo "$host,$(addr "$host") $(cat "$STATE/ssh/host_ed25519_key.pub")" >> "$STATE/ssh/known_hosts"
    done
    cat > "$STATE/ssh/sshd_config" << EOF
HostKey $STATE/ssh/host_ed25519_key
AuthorizedKeysFile $STATE/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
AcceptEnv LANG LC_*
EOF
    if [[ ! -d /run/sshd ]]; then mkdir -p /run/sshd; made dir /run/sshd; fi
    for host in $(nodes); do
        start "sshd-$host" "$host" /usr/sbin/sshd -D -e -f "$STATE/ssh/sshd_config" \
            -o "ListenAddress=$(addr "$host")" -o "PidFile=$STATE/run/sshd-$host.pid"
    done
    if [[ ! -e $SLURM_ETC ]] || grep -q "^$MARK" "$SLURM_ETC"; then
        mkdir -p "$(dirname "$SLURM_ETC")"
        cp "$SLURM_CONF" "$SLURM_ETC"
        made file "$SLURM_ETC"
    fi

    # ready: every node idle in Slurm, every sshd answering
    local state=""
    for i in $(seq 300); do
        state=$(sinfo -h -N -o '%N %T' 2> /dev/null | sort -u | tr '\n' ' ' || true)
        [[ $(sinfo -h -N -o '%T' 2> /dev/null | grep -c '^idle$' || true) == "$n" ]] && break
        sleep 0.1
    done
    [[ $(sinfo -h -N -o '%T' 2> /dev/null | grep -c '^idle$' || true) == "$n" ]] \
        || die "the nodes did not come up in Slurm (${state:-no answer from slurmctld}); logs in $STATE/log"
    for host in $(nodes); do
        for i in $(seq 100); do on node1 ssh "$host" true 2> /dev/null && break; sleep 0.1; done
        on node1 ssh "$host" true || die "ssh from node1 to $host does not work; logs in $STATE/log"
    done
    say "up: $n node(s) ($(nodes)), controller head ($(addr head)), state in $STATE"
    if grep -q "^$MARK" "$SLURM_ETC" 2> /dev/null; then
        say "Slurm's commands (sbatch, squeue, sacct, scontrol, scancel) read $SLURM_ETC"
    else
        say "$SLURM_ETC is not this cluster's: export SLURM_CONF=$SLURM_CONF"
    fi
}

cmd_status() {
    [[ -f $STATE/nodes ]] || { say "down"; return 3; }
    local f name host
    export SLURM_CONF=$STATE/slurm.conf
    for f in "$STATE"/pids/*; do
        name=$(basename "$f")
        if alive "$(cat "$f")"; then echo "$name: running (pid $(cat "$f"))"; else echo "$name: dead"; fi
    done
    for host in $(nodes); do
        echo "$host: $(addr "$host"), link $(cat "/sys/class/net/$(veth "$host")/operstate" 2> /dev/null || echo missing)"
    done
    sinfo -N -o '%N %T %C' || true
    squeue || true
}

# A node's link on the bridge down (partition) or up (heal): its processes run on, cut off.
cmd_link() {
    local what=$1 host=${2:-}
    [[ -n $host ]] && grep -qw "$host" <(nodes) || die "$what NODE: NODE is one of: $(nodes)"
    need_root
    ip link set "$(veth "$host")" "$([[ $what == partition ]] && echo down || echo up)"
    say "$host: link $([[ $what == partition ]] && echo down || echo up)"
}

cmd_exec() {
    local host=${1:-}
    [[ -n $host ]] && { [[ $host == head ]] || grep -qw "$host" <(nodes); } || die "exec NODE CMD: NODE is one of: $(nodes)"
    shift
    (( $# )) || die "exec $host CMD: no command"
    need_root
    on "$host" "$@"
}

case ${1:-} in
    up) shift; cmd_up "$@";;
    down) cmd_down; say "down";;
    status) cmd_status;;
    partition|heal) cmd_link "$@";;
    exec) shift; cmd_exec "$@";;
    *) echo "usage: $0 up [N] | down | status | partition NODE | heal NODE | exec NODE CMD..." >&2; exit 2;;
esac
