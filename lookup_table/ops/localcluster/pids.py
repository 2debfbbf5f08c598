"""What this machine tells of a process: whether a pid runs, and which process listens on
a port (from /proc; None where it cannot tell)."""

from __future__ import annotations

import os

__all__ = ["holds_port", "listener_pid", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie does not: it has exited and waits for its parent
    to reap it, which for the processes `up` started (their parent has exited) is init,
    and init may take seconds to do it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone meanwhile, or no /proc (not Linux): kill() said alive
        return not os.path.isdir("/proc/self")
    return state not in ("Z", "X")


def _listening_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on `port` (any local address), from /proc/net/tcp{,6};
    None without them (not Linux)."""
    inodes: set[str] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; st 0A is LISTEN; field 9 is the inode
            if len(fields) > 9 and fields[3] == "0A":
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes if found else None


def holds_port(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the listening socket of `port`; None when this machine
    cannot tell (no /proc, or the process is another user's)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def listener_pid(port: int) -> int | None:
    """The pid of the process (of this user) listening on `port`, from /proc; None when
    none is found or this machine cannot tell."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            links = {
                os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")
            }
        except OSError:  # another user's, or gone
            continue
        if links & wanted:
            return int(entry)
    return None
