"""A power-loss simulating FUSE file system for the test suite (not part of gdswriter).

model.py   the durability model: live and durable state per object, what fsync, fdatasync and
           directory fsync make durable, the disk images a power cut may leave
fs.py      the model served over FUSE in its own process (python -m powerloss.fs), with a
           control socket to cut the power now or after N syncs/operations and to read the log
harness.py starting, controlling and always unmounting it; the fork server that runs the
           application
app.py     the application: real gdswriter saves, re-saves, retention and exports on the mount

docs/powerloss.md says what is simulated and what is not; tests/test_powerloss.py uses it.
"""
