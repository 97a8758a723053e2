"""Moved to gdswriter/format/assembly.py (the manifest of a multi-rank step is format logic);
these names stay importable from here until the DCP plug-in imports them from there."""

from ..format.assembly import build_manifest, record_from_json, record_json, remap_tree, tree_for_rank

__all__ = ["build_manifest", "record_from_json", "record_json", "remap_tree", "tree_for_rank"]
