#!/usr/bin/env bash
# Real Linux NFS on one machine: the kernel NFS server (knfsd) and two kernel NFS client mounts with separate caches.
# This VM's own kernel (6.18 Firecracker build, CONFIG_MODULES=n) has no nfs/nfsd at all, and /dev/kvm is PVM (it only
# runs PVM-built guests), so this boots Debian's stock kernel (linux-image-amd64, apt-get download, never installed)
# under QEMU TCG with the host's / shared read-only over 9p: host binaries and venvs run unchanged in the guest.
# Mount A is a plain client; mount B is a second client in its own network namespace and client identity (another
# NFSv4 client ID, like a second node). Both mount points exist only INSIDE the guest: run code there with `exec`.
#   up:   nfs-loopback.sh up   [NAME]             prints "/mnt/NAME-a /mnt/NAME-b" (guest paths)
#   exec: nfs-loopback.sh exec [NAME] -- CMD...   runs CMD in the guest (same cwd, exported env), streams output, returns rc
#   run:  nfs-loopback.sh run  [NAME] -- CMD...   up + exec + down, returns CMD's rc
#   down: nfs-loopback.sh down [NAME]
# Env (read by up): NFS_VERS (4.2|4.1|4.0|3, default 4.2), NFS_OPTS_A / NFS_OPTS_B (extra mount options, e.g. actimeo=0),
#   NFS_LOOPBACK_RW (host dirs shared read-write, default "/tmp" plus $PWD unless it is /), NFS_LOOPBACK_MEM (MiB, 4096),
#   NFS_EXPORT_SIZE (tmpfs export size, 2g), NFS_LOOPBACK_STATE (/run/nfs-loopback), NFS_LOOPBACK_CACHE
#   (/var/cache/nfs-loopback). Inside the guest the server is 127.0.0.1 for A and 169.254.209.1 for B (netns nfsb);
#   more mounts: exec -- mount -t nfs -o vers=3 127.0.0.1:/srv/nfs-export /mnt/x (v4 path: 127.0.0.1:/).
# Verified on Debian 12 (2 cores, 24 GiB, root, no /lib/modules): up ~25-40 s (first one also fetches the 70 MB kernel
# package and builds a busybox initrd: +10 s, 284 MB in the cache), down ~3-5 s. Everything in the guest runs under
# emulation: ~5-10x slower CPU, NFS I/O ~20-40 MiB/s. Good for semantics and functional tests, not for benchmarks.
set -euo pipefail
cmd=${1:-up}; shift || true
name=kvtest
if [ "$cmd" != __guest ] && [ $# -gt 0 ] && [ "$1" != "--" ]; then name=$1; shift; fi
[ "${1:-}" = "--" ] && shift
state_root=${NFS_LOOPBACK_STATE:-/run/llmkv-fs-nfs}; st=$state_root/$name
cache=${NFS_LOOPBACK_CACHE:-/var/cache/llmkv-fs-nfs}
self=$(readlink -f "${BASH_SOURCE[0]}")
ma=/mnt/$name-a; mb=/mnt/$name-b
log() { echo "nfs-loopback: $*" >&2; }

running() {  # pid $1 exists, is not a zombie, and is our qemu (pids get reused)
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] && [ "$(sed -n 's/.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null)" != Z ] &&
    { tr '\0' ' ' < "/proc/$1/cmdline"; } 2>/dev/null | grep -qF -- "$st/qemu.pid"
}
alive() { running "$(cat "$st/qemu.pid" 2>/dev/null)"; }

ensure_kernel() {  # sets kdir, kver, initrd
  local pkgs=() p
  command -v qemu-system-x86_64 >/dev/null || pkgs+=(qemu-system-x86)
  dpkg -s busybox-static >/dev/null 2>&1 || pkgs+=(busybox-static)
  command -v rpc.nfsd >/dev/null || pkgs+=(nfs-kernel-server)
  command -v mount.nfs >/dev/null || pkgs+=(nfs-common)
  command -v rpcbind >/dev/null || pkgs+=(rpcbind)
  command -v ip >/dev/null || pkgs+=(iproute2)
  command -v depmod >/dev/null || pkgs+=(kmod)
  command -v python3 >/dev/null || pkgs+=(python3)
  if [ ${#pkgs[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=300 "${pkgs[@]}" >/dev/null
  fi
  kpkg=${NFS_LOOPBACK_KPKG:-$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')}
  if [ -z "$kpkg" ]; then apt-get update -qq; kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); fi
  kver=${kpkg#linux-image-}; kdir=$cache/$kpkg; initrd=$kdir/initrd.gz
  if [ ! -s "$kdir/.ok" ]; then
    log "fetching $kpkg (Debian's stock kernel, ~70 MB) into $kdir"
    rm -rf "$kdir" "$kdir.tmp"; mkdir -p "$kdir.tmp/deb"
    (cd "$kdir.tmp/deb" && apt-get download -q "$kpkg" >/dev/null 2>&1) ||
      { apt-get update -qq; (cd "$kdir.tmp/deb" && apt-get download -q "$kpkg" >/dev/null); }
    dpkg -x "$kdir.tmp"/deb/*.deb "$kdir.tmp"; rm -rf "$kdir.tmp/deb"
    depmod -b "$kdir.tmp" "$kver"
    local ir=$kdir.tmp/ir i=0 f
    mkdir -p "$ir"/{bin,mod,proc,sys,dev,newroot}; cp /bin/busybox "$ir/bin/busybox"
    for f in $(for m in virtio_pci 9pnet_virtio 9p; do modprobe -d "$kdir.tmp" -S "$kver" --show-depends $m; done |
               awk '$1=="insmod"{print $2}' | awk '!s[$0]++'); do
      i=$((i+1)); cp "$f" "$ir/mod/$(printf %02d $i)-$(basename "$f")"
    done
    cat > "$ir/init" <<'EOF'
#!/bin/busybox sh
b=/bin/busybox
$b mount -t proc proc /proc; $b mount -t sysfs sys /sys; $b mount -t devtmpfs dev /dev
for m in /mod/*.ko; do $b insmod $m || echo "initrd: insmod $m failed"; done
$b mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot || { echo "initrd: no root"; $b poweroff -f; }
arg() { $b sed -n "s/.*nfslb\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
script=$(arg script); state=$(arg state)
$b umount /proc /sys; $b mount --move /dev /newroot/dev
exec $b switch_root /newroot /bin/bash "$script" __guest "$state"
EOF
    chmod +x "$ir/init"
    (cd "$ir" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$kdir.tmp/initrd.gz"; rm -rf "$ir"
    rm -rf "$kdir.tmp/usr/share" "$kdir.tmp/lib/modules/$kver/kernel/drivers/"{gpu,media,net/wireless,infiniband,staging} || true
    echo "$kver" > "$kdir.tmp/.ok"; mv "$kdir.tmp" "$kdir"
  fi
}

down() {
  local p
  for p in /proc/[0-9]*; do                                                 # a VM whose state dir is gone
    { tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null | grep -qF -- "nfslb.state=$st " || continue
    [ "${p#/proc/}" = "$(cat "$st/qemu.pid" 2>/dev/null)" ] || kill "${p#/proc/}" 2>/dev/null || true
  done
  [ -d "$st" ] || return 0
  if alive; then
    local pid; pid=$(cat "$st/qemu.pid")
    touch "$st/poweroff"
    for _ in $(seq 300); do running "$pid" || break; sleep 0.1; done        # clean guest shutdown, 30 s max
    if running "$pid"; then kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do running "$pid" || break; sleep 0.1; done
      running "$pid" && kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -rf "$st"
}

up() {
  if alive && [ -e "$st/ready" ]; then echo "$ma $mb"; return 0; fi
  down                                                                      # leftovers of a dead or half-started VM
  ensure_kernel
  mkdir -p "$st/jobs"
  local rw=${NFS_LOOPBACK_RW:-/tmp $([ "$PWD" != / ] && echo "$PWD")} d i=0 share=()
  : > "$st/config"
  for d in $(for d in $rw; do readlink -f "$d"; done | sort -u); do
    [ -d "$d" ] || continue
    share+=(-fsdev "local,id=rw$i,path=$d,security_model=passthrough,multidevs=remap" -device "virtio-9p-pci,fsdev=rw$i,mount_tag=rw$i")
    echo "rw$i=$(printf %q "$d")" >> "$st/config"; i=$((i+1))
  done
  cat >> "$st/config" <<EOF
nrw=$i; kdir=$(printf %q "$kdir"); name=$name; ma=$ma; mb=$mb
vers=${NFS_VERS:-4.2}; opts_a=${NFS_OPTS_A:-}; opts_b=${NFS_OPTS_B:-}; export_size=${NFS_EXPORT_SIZE:-2g}
EOF
  qemu-system-x86_64 -nodefaults -no-user-config -machine pc -accel tcg,thread=multi -cpu max -smp "$(nproc)" \
    -m "${NFS_LOOPBACK_MEM:-4096}" -display none -no-reboot -daemonize -pidfile "$st/qemu.pid" \
    -serial "file:$st/console.log" -kernel "$kdir/boot/vmlinuz-$kver" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 loglevel=4 nfslb.script=$self nfslb.state=$st" \
    -fsdev "local,id=root,path=/,security_model=passthrough,readonly=on,multidevs=remap" \
    -device virtio-9p-pci,fsdev=root,mount_tag=hostroot \
    -fsdev "local,id=ctl,path=$st,security_model=passthrough" -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl "${share[@]}"
  local deadline=$((SECONDS + ${NFS_LOOPBACK_BOOT_TIMEOUT:-300}))
  until [ -e "$st/ready" ] || [ -e "$st/failed" ]; do
    if ! alive || [ $SECONDS -ge $deadline ]; then break; fi
    sleep 0.2
  done
  if [ ! -e "$st/ready" ]; then
    cat "$st/console.log" "$st/guest.log" > "/tmp/nfs-loopback-$name.log" 2>/dev/null || true
    log "guest did not come up; full log in /tmp/nfs-loopback-$name.log, tail:"; tail -n 15 "/tmp/nfs-loopback-$name.log" >&2 || true
    down; return 1
  fi
  echo "$ma $mb"
}

xexec() {
  alive && [ -e "$st/ready" ] || { log "$name is not up (run: $0 up $name)"; return 255; }
  [ $# -gt 0 ] || { log "exec needs a command"; return 2; }
  local id v; id=$(date +%s%N)-$$
  {
    for v in $(compgen -e); do
      case $v in PWD|OLDPWD|SHLVL|_|HOSTNAME|BASH_*|PPID|UID|EUID) continue;; esac
      printf 'export %s=%q\n' "$v" "${!v}"
    done
    printf 'cd %q || exit 97\n' "$PWD"; printf '%q ' "$@"; echo
  } > "$st/jobs/$id.tmp"
  mv "$st/jobs/$id.tmp" "$st/jobs/$id.sh"
  python3 - "$st" "$id" <<'EOF'
import os, sys, time
st, jid = sys.argv[1], sys.argv[2]
out, rc, pidf = f"{st}/jobs/{jid}.out", f"{st}/jobs/{jid}.rc", f"{st}/qemu.pid"
def alive():
    try: return open(f"/proc/{int(open(pidf).read())}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except Exception: return False
f = None
while True:
    done = os.path.exists(rc)
    if f is None and os.path.exists(out): f = open(out, "rb")
    if f is not None:
        while chunk := f.read(1 << 16): sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    if done:
        code = int(open(rc).read().strip() or 255)
        for p in (out, rc): os.unlink(p)
        sys.exit(code)
    if not alive(): print("nfs-loopback: the guest died", file=sys.stderr); sys.exit(255)
    time.sleep(0.05)
EOF
}

guest() {  # PID 1 inside the VM; $1 = state dir (9p share "ctl" mounted at the same path)
  set +eu +o pipefail                                                        # PID 1 must never exit
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
  local st=$1 p9="trans=virtio,version=9p2000.L,msize=512000"
  mount -t proc proc /proc; mount -t sysfs sys /sys; mountpoint -q /dev || mount -t devtmpfs dev /dev
  mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
  for d in /run /var/lib/nfs /mnt /srv /var/tmp; do mount -t tmpfs -o mode=755 tmpfs $d; done
  mkdir -p "$st"; mount -t 9p -o "$p9" ctl "$st"
  exec > "$st/guest.log" 2>&1
  set -x
  . "$st/config"
  local i d
  for i in $(seq 0 $((nrw-1))); do d=rw$i; mount -t 9p -o "$p9,cache=mmap" "rw$i" "${!d}"; done
  ip link set lo up; hostname nfs-a
  ok() {
    for m in nfsd nfs nfsv3 nfsv4 veth; do modprobe -d "$kdir" $m; done
    mount -t nfsd nfsd /proc/fs/nfsd
    mkdir -p /run/rpc_pipefs /var/lib/nfs/v4recovery /var/lib/nfs/sm /var/lib/nfs/sm.bak /srv/nfs-export
    touch /var/lib/nfs/etab /var/lib/nfs/rmtab /var/lib/nfs/state
    chown statd /var/lib/nfs/sm /var/lib/nfs/sm.bak /var/lib/nfs/state 2>/dev/null || true
    mount -t rpc_pipefs sunrpc /run/rpc_pipefs
    mount -t tmpfs -o "size=$export_size,mode=1777" tmpfs /srv/nfs-export
    # second client B: own network namespace + NFSv4 client identity, reaching the server over a veth pair
    ip netns add nfsb
    ip link add nfsb0 type veth peer name nfsb1; ip link set nfsb1 netns nfsb
    ip addr add 169.254.209.1/30 dev nfsb0; ip link set nfsb0 up
    ip -n nfsb addr add 169.254.209.2/30 dev nfsb1; ip -n nfsb link set nfsb1 up; ip -n nfsb link set lo up
    rpcbind -w
    exportfs -o rw,no_root_squash,sync,no_subtree_check,fsid=0,insecure 127.0.0.1:/srv/nfs-export
    exportfs -o rw,no_root_squash,sync,no_subtree_check,fsid=0,insecure 169.254.209.2:/srv/nfs-export
    rpc.mountd --no-udp; rpc.statd --no-notify
    echo 10 > /proc/fs/nfsd/nfsv4gracetime                                  # the minimum; default 90 s blocks opens
    rpc.nfsd -H 127.0.0.1 -H 169.254.209.1 -U 8
    local path=/srv/nfs-export; case $vers in 4*) path=/;; esac
    mkdir -p "$ma" "$mb"
    mount -t nfs -o "vers=$vers,nosharecache${opts_a:+,$opts_a}" "127.0.0.1:$path" "$ma"
    if [ "$vers" = 3 ]; then   # NLM/statd would need their own rpcbind+statd in the netns: B is a 2nd superblock here
      mount -t nfs -o "vers=$vers,nosharecache${opts_b:+,$opts_b}" "127.0.0.1:$path" "$mb"
    else
      ip netns exec nfsb sh -c 'echo nfs-loopback-b-$(cat /proc/sys/kernel/random/uuid) > /sys/fs/nfs/net/nfs_client/identifier'
      unshare --uts sh -c "hostname nfs-b; nsenter --net=/run/netns/nfsb mount -t nfs -o 'vers=$vers,nosharecache${opts_b:+,$opts_b}' 169.254.209.1:$path $mb"
    fi
    grep " nfs" /proc/mounts > "$st/ready.tmp"; mv "$st/ready.tmp" "$st/ready"
  }
  ( set -e; ok ) || touch "$st/failed"
  set +x
  mkdir -p "$st/jobs"
  local j
  until [ -e "$st/poweroff" ]; do                                            # job spool: host writes jobs/ID.sh
    for j in "$st"/jobs/*.sh; do
      [ -e "$j" ] && mv "$j" "${j%.sh}.run" 2>/dev/null || continue
      ( bash "${j%.sh}.run" > "${j%.sh}.out" 2>&1 < /dev/null; echo $? > "${j%.sh}.rc.tmp"
        rm -f "${j%.sh}.run"; mv "${j%.sh}.rc.tmp" "${j%.sh}.rc" ) &
    done
    sleep 0.1
  done
  set -x
  umount -f -l "$mb" "$ma" 2>/dev/null || true
  rpc.nfsd 0; exportfs -ua; sync
  echo o > /proc/sysrq-trigger
  sleep 60
}

case "$cmd" in
  up) up;;
  down) down;;
  exec) xexec "$@";;
  run) up >/dev/null; rc=0; xexec "$@" || rc=$?; down; exit $rc;;
  __guest) guest "$@";;
  *) echo "usage: $0 up|down|exec|run [NAME] [-- CMD...]" >&2; exit 2;;
esac
