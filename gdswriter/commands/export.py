"""`gdswriter export`: a step as one torch or safetensors file."""

from __future__ import annotations

from ..format.commit import CommitProtocol
from ..units import human
from ._common import EXIT_OK, add_roots_argument, check_roots, load_manifest, open_roots, out


def register(sub) -> None:
    sp = sub.add_parser("export", help="write a step as one torch or safetensors file",
                        description="Write a step as a single file other tools read. --to torch: a torch.save "
                                    "file of a flat {name: tensor} dict (names are the tensors' key paths, e.g. "
                                    "'model/0.weight'), readable with torch.load(OUT, weights_only=True); shared "
                                    "storage and views are kept. --to safetensors: a flat {name: tensor} "
                                    "safetensors file; safetensors cannot hold shared or non-contiguous tensors, "
                                    "so each tensor is written as its own contiguous copy, and non-tensor state is "
                                    "dropped (the step and the checkpoint metadata go to __metadata__). The output "
                                    "is written to a temporary file, fsynced and renamed into place.")
    add_roots_argument(sp)
    sp.add_argument("--step", type=int, metavar="N", help="step to export (default: the latest)")
    sp.add_argument("--to", required=True, choices=("torch", "safetensors"), help="output format")
    sp.add_argument("out", metavar="OUT", help="output file")
    sp.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    sp.add_argument("--nested", action="store_true",
                    help="torch only: save the whole nested state (model, optimizer, ...) instead of the flat "
                         "dict; refused unless torch.load(weights_only=True) reads it back")
    sp.add_argument("--no-verify", action="store_true", help="skip the crc32c check while reading")
    sp.set_defaults(func=run)


def run(args) -> int:
    from ..export import export_step

    roots = open_roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    step, m, _ = load_manifest(protocol, args.step)
    check_roots(protocol, step, m)  # a usage error (--secondary), not a damaged checkpoint
    res = export_step(roots, step, args.to, args.out, overwrite=args.force, verify=not args.no_verify,
                      nested=args.nested)
    what = "nested state" if args.nested else "{name: tensor} dict"
    out(f"exported step {res.step} of {roots[0]} to {res.path}: {args.to} file, {res.tensors} tensors "
         f"({what}), {human(res.bytes)}")
    for old, new in res.renamed.items():
        out(f"note: tensor name {old!r} occurs twice; the second is exported as {new!r}")
    return EXIT_OK
