"""Tools for testing code that uses gdswriter, and gdswriter itself: a fault-injecting engine
(faults.py), a simulated coordinator (simcoord.py), and ``log_once_forgotten`` (one-time
messages said again within a block).

The package's own test seams, which tests wrap (monkeypatch) to delay a step or inject a fault at
exactly that point, are public names of the modules that use them, each documented there:
save/pool.py (``copy_all``, ``copy_in``, ``allocate``, ``new_region``, ``Piece``),
engines/staged.py (``copy_bytes``, ``crc_extend``), engines/uring.py (``Ring.enter_syscall``),
distributed/crossmem.py (``process_vm_readv``), session.py (``LocalSession.new_plan``).
"""

from .._log import log_once_forgotten

__all__ = ["log_once_forgotten"]
