"""`gdswriter export`: a step as one torch or safetensors file, or a Hugging Face directory."""

from __future__ import annotations

from ..format.commit import CommitProtocol
from ..units import human
from ._common import EXIT_OK, add_roots_argument, check_roots, load_manifest, open_roots, out


def register(sub) -> None:
    sp = sub.add_parser("export", help="write a step as a torch or safetensors file, or a from_pretrained directory",
                        description="Write a step as files other tools read. --to torch: a torch.save "
                                    "file of a flat {name: tensor} dict (names are the tensors' key paths, e.g. "
                                    "'model/0.weight'), readable with torch.load(OUT, weights_only=True); shared "
                                    "storage and views are kept. --to safetensors: a flat {name: tensor} "
                                    "safetensors file; safetensors cannot hold shared or non-contiguous tensors, "
                                    "so each tensor is written as its own contiguous copy, and non-tensor state is "
                                    "dropped (the step and the checkpoint metadata go to __metadata__). "
                                    "--model-only: just the model's weights under the model's own keys "
                                    "('0.weight'), for model.load_state_dict(); tied weights are stored once in "
                                    "safetensors (load with safetensors.torch.load_model). --to hf: a directory "
                                    "for transformers' from_pretrained (config.json + model.safetensors, model "
                                    "only). Outputs are written under temporary names, fsynced and renamed into "
                                    "place. A progress bar shows on a terminal.")
    add_roots_argument(sp)
    sp.add_argument("--step", type=int, metavar="N", help="step to export (default: the latest)")
    sp.add_argument("--to", required=True, choices=("torch", "safetensors", "hf"), help="output format")
    sp.add_argument("out", metavar="OUT", help="output file (a directory for --to hf)")
    sp.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    sp.add_argument("--model-only", action="store_true",
                    help="only the model's state_dict, under its own keys (no 'model/' prefix)")
    sp.add_argument("--config", metavar="PATH",
                    help="--to hf: the model's config.json, or a directory whose files (config, tokenizer; not "
                         "weights) are copied; default: the config recorded by gdswriter.integrations.transformers")
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
                      nested=args.nested, model_only=args.model_only, config=args.config)
    what = ("nested state" if args.nested else "the model's state_dict" if args.model_only or args.to == "hf"
            else "{name: tensor} dict")
    kind = "from_pretrained directory" if args.to == "hf" else f"{args.to} file"
    out(f"exported step {res.step} of {roots[0]} to {res.path}: {kind}, {res.tensors} tensors ({what}), "
        f"{human(res.bytes)}")
    for old, new in res.renamed.items():
        out(f"note: tensor name {old!r} occurs twice; the second is exported as {new!r}")
    for alias, kept in res.tied.items():
        out(f"note: {alias!r} is tied to {kept!r} and stored once, as {kept!r}")
    if res.skipped:
        out(f"note: model keys without a tensor are not exported: {', '.join(res.skipped)}")
    return EXIT_OK
