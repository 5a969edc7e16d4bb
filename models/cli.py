"""``fogline models {zoo,profile,split}``: thin shell over the pure models package.

Heavy imports (onnx, numpy) happen inside handlers so ``fogline --help`` is fast.
Bad input prints one ``error: ...`` line on stderr and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn ModelError / OSError into exit 2, and profiler warnings into stderr lines."""

    def handler(args: argparse.Namespace) -> int:
        from models.errors import ModelError, ProfileWarning

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ProfileWarning)
            try:
                code = fn(args)
            except ModelError as exc:
                code = _fail(str(exc))
            except BrokenPipeError:  # output piped into head(1): not an error
                code = 0
            except OSError as exc:
                code = _fail(f"{exc.filename or ''}: {exc.strerror or exc}")
        for w in caught:
            if issubclass(w.category, ProfileWarning):
                print(f"warning: {w.message}", file=sys.stderr)
        return code

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


def _dims(values: list[str] | None) -> dict[str, int]:
    from models.errors import ModelError

    out: dict[str, int] = {}
    for item in values or []:
        name, _, val = item.partition("=")
        try:
            out[name] = int(val)
        except ValueError:
            raise ModelError(f"--dim expects NAME=INT, got {item!r}") from None
        if not name:
            raise ModelError(f"--dim expects NAME=INT, got {item!r}")
    return out


@_guard
def _zoo(args: argparse.Namespace) -> int:
    """Write the reference models as NAME.onnx files."""
    from models import zoo
    from models.errors import ModelError

    names = args.names.split(",") if args.names else list(zoo.NAMES)
    unknown = [n for n in names if n not in zoo.NAMES]
    if unknown:
        raise ModelError(f"unknown zoo model(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(zoo.NAMES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = out / f"{name}.onnx"
        data = zoo.build(name, seed=args.seed).SerializeToString()
        path.write_bytes(data)
        print(f"{path}\t{len(data)} bytes")
    return 0


def _table(prof: Any) -> str:
    rows = [f"{'#':>4}  {'op':<20} {'name':<28} {'MFLOPs':>10} {'params B':>10} "
            f"{'out B':>10} {'live B':>10}"]
    for n in prof.nodes:
        rows.append(f"{n.index:>4}  {n.op_type[:20]:<20} {n.name[:28]:<28} "
                    f"{n.flops / 1e6:>10.3f} {n.param_bytes:>10} {n.output_bytes:>10} "
                    f"{n.live_bytes:>10}")
    rows.append(f"total: {prof.flops / 1e6:.3f} MFLOPs ({prof.macs / 1e6:.3f} MMACs), "
                f"{prof.param_bytes} param bytes, peak activations "
                f"{prof.peak_activation_bytes} bytes, {len(prof.nodes)} nodes")
    return "\n".join(rows)


@_guard
def _profile(args: argparse.Namespace) -> int:
    """Print the chain profile JSON (and, without --json, a per-node table first)."""
    from models.cuts import chain_profile
    from models.graph import analyze
    from models.profile import profile_model

    ga = analyze(args.model, dims=_dims(args.dim))
    cp = chain_profile(ga, args.segments, strategy=args.strategy)
    if not args.json:
        print(_table(profile_model(ga)))
        print()
    print(json.dumps(cp.to_dict(with_cuts=args.with_cuts), indent=None if args.json else 2))
    return 0


@_guard
def _split(args: argparse.Namespace) -> int:
    """Write part-<i>.onnx files and manifest.json for a cut list or a segment count."""
    from models.cuts import chain_profile
    from models.errors import ModelError
    from models.partition import Partitioner

    p = Partitioner(analyze_args(args))
    if args.cuts is not None:
        try:
            cuts = [int(c) for c in args.cuts.split(",") if c.strip()]
        except ValueError:
            raise ModelError(f"--cuts expects comma-separated node positions, "
                             f"got {args.cuts!r}") from None
    else:
        if args.partitions < 1:
            raise ModelError(f"--partitions must be >= 1, got {args.partitions}")
        cuts = [c.index for c in chain_profile(p.ga, args.partitions,
                                               strategy=args.strategy).cuts]
    signer = None
    if args.sign_as:
        from runtime.security import Identity

        signer = Identity.generate(args.sign_as)
    parts = p.split(cuts, signer=signer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for part in parts:
        name = f"part-{part.index}.onnx"
        (out / name).write_bytes(part.onnx_bytes)
        entries.append({"file": name, **part.manifest()})
    manifest: dict[str, Any] = {
        "model": p.ga.name,
        "source": str(args.model),
        "cuts": list(cuts),
        "partitions": entries,
    }
    if signer is not None:
        manifest["signer_public_key"] = signer.public_key_bytes.hex()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for e in entries:
        print(f"{out / e['file']}\t{e['size_bytes']} bytes\t{e['flops'] / 1e6:.3f} MFLOPs\t"
              f"memory {e['memory_bytes']} B\tin {','.join(t['name'] for t in e['inputs'])}")
    print(out / "manifest.json")
    return 0


def analyze_args(args: argparse.Namespace) -> Any:
    from models.graph import analyze

    return analyze(args.model, dims=_dims(args.dim))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``fogline models`` with its ``zoo``, ``profile`` and ``split`` subcommands."""
    models = subparsers.add_parser("models", help="ONNX tooling: reference models, profiles, "
                                                  "cuts and partitions")
    sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    models.set_defaults(func=lambda _args: (models.print_help(), 2)[1])

    zoo = sub.add_parser("zoo", help="write the reference models (NAME.onnx) to a directory")
    zoo.add_argument("--out", required=True, help="output directory")
    zoo.add_argument("--names", help="comma-separated subset (default: all)")
    zoo.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    zoo.set_defaults(func=_zoo)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="ONNX file")
        p.add_argument("--dim", action="append", metavar="NAME=INT",
                       help="pin a symbolic input dimension (repeatable), e.g. --dim N=1")
        p.add_argument("--strategy", choices=("cheapest", "balanced"), default="cheapest",
                       help="how to keep cuts: fewest bytes (default) or even FLOPs")

    prof = sub.add_parser("profile", help="print the chain profile (JSON) and a per-node table")
    common(prof)
    prof.add_argument("--segments", type=int, default=16, metavar="K",
                      help="at most K segments (default 16)")
    prof.add_argument("--json", action="store_true", help="only the chain profile JSON")
    prof.add_argument("--with-cuts", action="store_true",
                      help="add the cut tensors (an extension of the COST_MODEL.md format)")
    prof.set_defaults(func=_profile)

    split = sub.add_parser("split", help="write partitions part-<i>.onnx and manifest.json")
    common(split)
    how = split.add_mutually_exclusive_group(required=True)
    how.add_argument("--cuts", metavar="I,J,...", help="cut positions (after the first I nodes)")
    how.add_argument("--partitions", type=int, metavar="K",
                     help="K partitions at the chain profile's cuts")
    split.add_argument("--out", required=True, help="output directory")
    split.add_argument("--sign-as", metavar="NAME",
                       help="sign partitions with a fresh Ed25519 identity NAME")
    split.set_defaults(func=_split)
