"""What the filesystem is and how full (``volume/fsinfo.py``): the mount
table as /proc/self/mounts escapes it, the mount a path is on, statvfs usage."""

from __future__ import annotations

import os

from llmkv_fs.volume import fsinfo
from llmkv_fs.volume.fsinfo import Mount, VolumeUsage, mount_of, parse_mounts

# As /proc/self/mounts writes them: a space is \040, a backslash \134, a tab \011.
MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /mnt/kv\\040cache tmpfs rw,size=1g 0 0
server:/vol\\040a /mnt/kv\\040cache/deep fuse.glusterfs rw,user_id=0 0 0
/dev/sdb /mnt/back\\134slash\\011tab xfs rw 0 0
/dev/sdc /mnt/kv\\040cache/deep nfs4 rw 0 0
truncated-line
"""


def test_mount_table_fields_are_unescaped():
    mounts = parse_mounts(MOUNTS)
    assert mounts[1] == Mount("tmpfs", "/mnt/kv cache", "tmpfs")
    assert mounts[2] == Mount("server:/vol a", "/mnt/kv cache/deep", "fuse.glusterfs")
    assert mounts[3].mount_point == "/mnt/back\\slash\ttab"
    assert len(mounts) == 5  # the line without three fields is skipped


def test_mount_of_takes_the_longest_and_then_the_latest_mount_point():
    mounts = parse_mounts(MOUNTS)
    assert mount_of("/mnt/kv cache/m_0123456789ab_r0", mounts).fstype == "tmpfs"
    assert mount_of("/mnt/kv cache", mounts).fstype == "tmpfs"
    assert mount_of("/mnt/kv cachex/y", mounts).fstype == "ext4"
    # Mounted twice on one point: the later mount shadows the earlier one.
    assert mount_of("/mnt/kv cache/deep/x", mounts).fstype == "nfs4"
    assert mount_of("/mnt/back\\slash\ttab/z", mounts).fstype == "xfs"
    assert mount_of("/anything", []) is None


def test_filesystem_type_of_real_mounts(tmp_path):
    assert fsinfo.filesystem_type("/proc/self") == "proc"
    assert fsinfo.filesystem_type(str(tmp_path)) == mount_of(str(tmp_path)).fstype != ""


def test_volume_usage_fields():
    usage = VolumeUsage(1000, 250, 250, inodes=10, inodes_free=4)
    assert usage.usable_bytes == 500
    assert usage.used_percent == 50.0
    real = fsinfo.volume_usage("/proc")  # a filesystem whose numbers never move
    st = os.statvfs("/proc")
    assert (real.total_bytes, real.inodes, real.inodes_free) == (
        st.f_blocks * st.f_frsize,
        st.f_files,
        st.f_ffree,
    )
