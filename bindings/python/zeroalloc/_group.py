"""The process's group of ranks (the C ABI's zeroalloc_group_*): joined once from
torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the library's own
bootstrap at MASTER_PORT+1), then collectives on memory the library can reach: NCCL on GPUs,
TCP through rank 0 on the simulated device. A failure raises ZeroallocError with the
library's message, which names the rank and the cause."""

from __future__ import annotations

import os

from zeroalloc._library import ZeroallocError, last_error, library

_joined: "str | None" = None  # the agreement this process joined with


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ZeroallocError(f"{what} failed: {last_error()}")


def join(agreement: str, timeout_s: float = 300.0) -> None:
    """Joins the job's group; every rank must pass the same `agreement` (the settings that
    must match: a rank with other settings ends every rank's join with both named). A second
    call with the same agreement does nothing; with another, it raises."""
    global _joined
    if _joined is not None:
        if _joined != agreement:
            raise ZeroallocError(f"this process joined its group with {_joined!r}; it cannot "
                                 f"join again with {agreement!r}")
        return
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ZeroallocError("a group needs torchrun's RANK and WORLD_SIZE (and MASTER_ADDR, "
                             "MASTER_PORT): start the script with torchrun")
    _check(library().zeroalloc_group_join(agreement.encode(), int(timeout_s * 1000)),
           "joining the group")
    _joined = agreement


def joined() -> bool:
    return _joined is not None


def rank() -> int:
    return int(library().zeroalloc_group_rank())


def size() -> int:
    return int(library().zeroalloc_group_size())


def broadcast(pointer: int, nbytes: int, root: int, stream: "int | None" = None) -> None:
    """`nbytes` at `pointer` become rank `root`'s on every rank, ordered on `stream`."""
    _check(library().zeroalloc_group_broadcast(pointer, nbytes, root, stream or None),
           f"broadcasting {nbytes} bytes from rank {root}")


def all_gather(send: int, receive: int, nbytes: int, stream: "int | None" = None) -> None:
    """Every rank's `nbytes` at `send` into every rank's `receive` (size() x `nbytes`, in
    rank order), ordered on `stream`."""
    _check(library().zeroalloc_group_all_gather(send, receive, nbytes, stream or None),
           f"gathering {nbytes} bytes from every rank")


def reduce(send: int, receive: int, count: int, bfloat16: bool, root: int,
           stream: "int | None" = None) -> None:
    """The sum over ranks of `count` float32 (or bfloat16) elements at `send` into rank
    `root`'s `receive` (which may be `send`), ordered on `stream`."""
    _check(library().zeroalloc_group_reduce(send, receive, count, int(bfloat16), root,
                                            stream or None),
           f"reducing {count} {'bfloat16' if bfloat16 else 'float32'} elements to rank {root}")


def abort(why: str) -> None:
    """Ends every rank's collectives with `why` (a rank that failed on its own)."""
    library().zeroalloc_group_abort(why.encode())
