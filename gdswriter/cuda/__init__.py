"""CUDA-specific pieces, kept small and behind narrow interfaces (streams.py: events, side
streams, stream-ordered waits, pinned registration). Importing this package makes no CUDA
call: a job whose state holds no CUDA tensor never initialises CUDA through gdswriter."""
