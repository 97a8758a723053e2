"""Build of the optional compiled copier (gdswriter._gather); everything else is in pyproject.toml.

The extension is optional: where no C compiler or Python headers are found, the build goes on
without it and gdswriter copies with its pure-Python path (gdswriter/crc.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gdswriter._gather", ["gdswriter/_gather.c"], optional=True)])
