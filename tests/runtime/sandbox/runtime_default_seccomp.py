"""The namespace rules of the container runtimes' RuntimeDefault seccomp profile, as a real seccomp filter.

A test fixture emulating the platform a reward pod runs on (the operator sets `seccompProfile: RuntimeDefault`
and drops every capability), not product code. For a process without CAP_SYS_ADMIN, moby's
profiles/seccomp/default.json and containerd's contrib/seccomp/seccomp_default.go:

- leave `unshare`, `setns` and `mount` out of the allow list: the default action refuses them with EPERM;
- allow `clone` only when its flags (argument 0; argument 1 on s390) hold none of CLONE_NEWNS, NEWCGROUP,
  NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (SCMP_CMP_MASKED_EQ 0x7E020000 == 0): otherwise EPERM;
- answer `clone3` with ENOSYS (errnoRet 38): its flags sit behind a pointer seccomp cannot read, and ENOSYS
  makes the C library fall back to `clone`.

Everything else is allowed here (the profile's other rules do not concern namespaces). A second rule set,
`mount-refused`, emulates a platform whose namespaces can be made but not set up. The filter is a
classic BPF program installed with prctl(PR_SET_NO_NEW_PRIVS) + prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) on
the calling thread; children inherit it and it can never be removed, so install it in a process made for it.
"""

from __future__ import annotations

import ctypes
import errno
import platform

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

NAMESPACE_CLONE_FLAGS = 0x7E020000
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: the profile's mask, 2114060288."""

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian here)
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0_LOW = 0, 4, 16

# classic BPF opcodes
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K

SYSCALLS = {
    # machine: (AUDIT_ARCH_*, {name: number})
    "x86_64": (0xC000003E, {"clone": 56, "mount": 165, "unshare": 272, "setns": 308, "clone3": 435}),
    "aarch64": (0xC00000B7, {"mount": 40, "unshare": 97, "clone": 220, "setns": 268, "clone3": 435}),
}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def supported() -> bool:
    return platform.machine() in SYSCALLS


def syscall_numbers() -> dict[str, int]:
    return SYSCALLS[platform.machine()][1]


def program() -> list[tuple[int, int, int, int]]:
    """(code, jump if true, jump if false, k) instructions; jumps count instructions skipped."""
    arch, nr = SYSCALLS[platform.machine()]
    allow, eperm, enosys = (
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),
    )
    # Layout: 0 load arch, 1 other arch -> allow, 2 load nr, 3-5 unshare/setns/mount -> EPERM,
    # 6 clone3 -> ENOSYS, 7 not clone -> allow, 8 load flags, 9 namespace flag -> EPERM, 10 allow,
    # 11 EPERM, 12 ENOSYS.
    head = [
        (BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
        (BPF_JEQ_K, 0, 8, arch),  # -> 10 (allow): another ABI is no concern of this fixture
        (BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        (BPF_JEQ_K, 7, 0, nr["unshare"]),  # -> 11
        (BPF_JEQ_K, 6, 0, nr["setns"]),  # -> 11
        (BPF_JEQ_K, 5, 0, nr["mount"]),  # -> 11
        (BPF_JEQ_K, 5, 0, nr["clone3"]),  # -> 12
        (BPF_JEQ_K, 0, 2, nr["clone"]),  # -> 10 when not clone
        (BPF_LD_W_ABS, 0, 0, OFFSET_ARG0_LOW),  # the flags; the mask lies in their low 32 bits
        (BPF_JSET_K, 1, 0, NAMESPACE_CLONE_FLAGS),  # -> 11
    ]
    return [*head, allow, eperm, enosys]


def mount_refused_program() -> list[tuple[int, int, int, int]]:
    """Namespaces allowed, `mount` refused (EPERM): a platform where `unshare` succeeds but the namespaces
    cannot be set up, like Ubuntu's AppArmor restriction of unprivileged user namespaces (the new namespace
    holds no capabilities)."""
    arch, nr = SYSCALLS[platform.machine()]
    return [
        (BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
        (BPF_JEQ_K, 0, 2, arch),  # -> 4 (allow)
        (BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        (BPF_JEQ_K, 1, 0, nr["mount"]),  # -> 5
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
    ]


PROGRAMS = {"runtime-default": program, "mount-refused": mount_refused_program}


def install(rules: str = "runtime-default") -> None:
    """Confine the calling thread (and every process it starts) to `rules` (a key of PROGRAMS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    instructions = PROGRAMS[rules]()
    filters = (SockFilter * len(instructions))(*[SockFilter(*i) for i in instructions])
    fprog = SockFprog(len(instructions), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
