"""Loading a committed step: reader.py (manifest and bytes into fresh tensors; load_state),
verify.py (re-hash a step in bounded memory), apply.py (match a saved tree to the live objects
and apply it; no I/O), policy.py (restore_into and the fallback to the newest intact step).

Imports go one way: policy -> reader, verify, apply; verify -> reader. Nothing here imports
gdswriter.save, and gdswriter.save imports nothing from here (what both need is in
gdswriter/tensors.py and gdswriter/threads.py). This file imports nothing.
"""
