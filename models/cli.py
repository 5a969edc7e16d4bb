"""``fogline models {zoo,profile,split,bench-segments}``: thin shell over the models package.

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

__all__ = ["parse_input_shapes", "register"]


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


def _named(values: list[str] | None, flag: str, form: str,
           convert: Callable[[str], Any]) -> dict[str, Any]:
    """Repeated ``NAME=VALUE`` options; ``form`` shows the expected shape in the error."""
    from models.errors import ModelError

    out: dict[str, Any] = {}
    for item in values or []:
        name, sep, text = item.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            value = convert(text.strip())
        except ValueError:
            raise ModelError(f"{flag} expects {form}, got {item!r}") from None
        if name in out:
            raise ModelError(f"{flag} given twice for input '{name}'")
        out[name] = value
    return out


def _dims(values: list[str] | None) -> dict[str, int]:
    return _named(values, "--dim", "NAME=INT", int)


def _shape(text: str) -> list[int]:
    text = text.replace("x", ",")  # 1x3x224x224, as trtexec takes it
    return [int(d) for d in text.split(",")] if text else []


def parse_input_shapes(values: list[str] | None) -> dict[str, list[int]]:
    """``--input-shape NAME=D0,D1,...`` (``x`` also separates dims, as in trtexec)."""
    return _named(values, "--input-shape", "NAME=D0,D1,... (e.g. x=1,3,224,224)", _shape)


def _number(v: str) -> int | float:
    low = v.strip().lower()
    return float(v) if any(c in low for c in ".e") or low in ("nan", "inf", "-inf") else int(v)


def _numbers(text: str) -> Any:
    if not text:
        raise ValueError
    nums = [_number(v) for v in text.split(",")]
    return nums[0] if len(nums) == 1 else nums


def _input_values(values: list[str] | None) -> dict[str, Any]:
    """``--input-value NAME=V0,V1,...``: the data a run uses for an input (e.g. sr=16000)."""
    return _named(values, "--input-value", "NAME=V0,V1,... (e.g. sr=16000)", _numbers)


def _cut_list(text: str) -> list[int]:
    from models.errors import ModelError

    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ModelError(f"--cuts expects comma-separated node positions, got {text!r}") from None


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
    from models.profile import profile_model

    ga = analyze_args(args)
    cp = chain_profile(ga, args.segments, strategy=args.strategy)
    if not args.json:
        print(_table(profile_model(ga)))
        print("shapes: " + ("one onnxruntime run" if ga.shape_source == "run"
                            else "static shape inference"))
        print()
    print(json.dumps(cp.to_dict(with_cuts=args.with_cuts), indent=None if args.json else 2))
    return 0


@_guard
def _split(args: argparse.Namespace) -> int:
    """Write part-<i>.onnx files and manifest.json for a cut list or a segment count."""
    from models.errors import ModelError
    from models.partition import Partitioner

    p = Partitioner(analyze_args(args))
    if args.cuts is not None:
        cuts = _cut_list(args.cuts)
    else:
        if args.partitions < 1:
            raise ModelError(f"--partitions must be >= 1, got {args.partitions}")
    signer = None
    if args.sign_as:
        from runtime.security import Identity

        signer = Identity.generate(args.sign_as)
    if args.cuts is None:
        cuts = [c.index for c in p.cuts_into(args.partitions, strategy=args.strategy)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    # One partition in memory at a time: a model with weights in side files is never
    # read whole.
    for part in p.iter_split(cuts, signer=signer):
        name = f"part-{part.index}.onnx"
        (out / name).write_bytes(part.onnx_bytes)
        entries.append({"file": name, **part.manifest()})
        del part
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


@_guard
def _bench_segments(args: argparse.Namespace) -> int:
    """Time every segment of the chain in onnxruntime; JSON (or a table) on stdout."""
    from models.cuts import chain_profile
    from models.errors import ModelError
    from models.timing import time_segments

    ga = analyze_args(args)
    cuts: Any
    if args.cuts is not None:
        cuts = _cut_list(args.cuts)
    else:
        if args.segments < 1:
            raise ModelError(f"--segments must be >= 1, got {args.segments}")
        cuts = chain_profile(ga, args.segments, strategy=args.strategy)
    if args.repeats < 1 or args.threads < 1:
        raise ModelError("--repeats and --threads must be >= 1")
    providers = [p for p in (args.providers or "CPUExecutionProvider").split(",") if p]
    t = time_segments(ga, cuts, providers=providers, threads=args.threads,
                      repeats=args.repeats,
                      input_values=_input_values(getattr(args, "input_value", None)))
    d = t.to_dict()
    if args.device_class:
        d["segment_times_s"] = {args.device_class: list(t.calibrated)}
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"{'#':>3}  {'nodes':>11}  {'MFLOPs':>10}  {'median ms':>10}  {'calibrated ms':>13}")
    for i, ((a, b), sec, cal) in enumerate(zip(t.segments, t.seconds, t.calibrated)):
        fl = t.flops[i] / 1e6 if t.flops else 0.0
        print(f"{i:>3}  {f'{a}:{b}':>11}  {fl:>10.3f}  {sec * 1e3:>10.3f}  {cal * 1e3:>13.3f}")
    print(f"whole model {t.whole_s * 1e3:.3f} ms, chain of {len(t.seconds)} sessions "
          f"{t.chain_s * 1e3:.3f} ms, sum of segments {t.total_s * 1e3:.3f} ms "
          f"({','.join(t.providers)}, {t.threads} thread(s), median of {t.repeats})")
    return 0


def analyze_args(args: argparse.Namespace) -> Any:
    """The GraphAnalysis of ``args.model`` with ``--dim``, ``--input-shape``, ``--input-value``."""
    from models.probe import analyze

    return analyze(args.model, dims=_dims(args.dim),
                   input_shapes=parse_input_shapes(getattr(args, "input_shape", None)),
                   input_values=_input_values(getattr(args, "input_value", None)))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fogline models`` with ``zoo``, ``profile``, ``split`` and ``bench-segments``."""
    from runtime import cliargs as ca

    models = subparsers.add_parser("models", help="ONNX tooling: reference models, profiles, "
                                                  "cuts and partitions")
    sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    models.set_defaults(func=lambda _args: (models.print_help(), 2)[1])

    zoo = sub.add_parser("zoo", help="write the reference models (NAME.onnx) to a directory")
    zoo.add_argument("--out", required=True, type=ca.writable_dir, help="output directory")
    zoo.add_argument("--names", help="comma-separated subset (default: all)")
    zoo.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    zoo.set_defaults(func=_zoo)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", type=ca.existing_file, help="ONNX file")
        p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                       help="fix a whole input shape (repeatable), e.g. --input-shape "
                            "x=1,3,48,320; anonymous '?' dims included")
        p.add_argument("--dim", action="append", metavar="NAME=INT",
                       help="pin a named symbolic input dimension (repeatable), e.g. --dim N=1")
        p.add_argument("--input-value", action="append", metavar="NAME=V0,V1,...",
                       help="data for an input in the sizing run (repeatable), for inputs "
                            "that pick a mode, e.g. --input-value sr=16000; others are random")
        p.add_argument("--strategy", choices=("cheapest", "balanced"), default="cheapest",
                       help="how to keep cuts: fewest bytes (default) or even FLOPs")

    prof = sub.add_parser("profile", help="print the chain profile (JSON) and a per-node table")
    common(prof)
    prof.add_argument("--segments", type=ca.int_range(1, 4096), default=16, metavar="K",
                      help="at most K segments (default 16)")
    prof.add_argument("--json", action="store_true", help="only the chain profile JSON")
    prof.add_argument("--with-cuts", action="store_true",
                      help="add the cut tensors (an extension of the chain profile format, "
                           "docs/formats.md)")
    prof.set_defaults(func=_profile)

    split = sub.add_parser("split", help="write partitions part-<i>.onnx and manifest.json")
    common(split)
    how = split.add_mutually_exclusive_group(required=True)
    how.add_argument("--cuts", metavar="I,J,...", help="cut positions (after the first I nodes)")
    how.add_argument("--partitions", type=ca.int_range(1, 4096), metavar="K",
                     help="K partitions at the chain profile's cuts")
    split.add_argument("--out", required=True, type=ca.writable_dir, help="output directory")
    split.add_argument("--sign-as", metavar="NAME",
                       help="sign partitions with a fresh Ed25519 identity NAME")
    split.set_defaults(func=_split)

    bench = sub.add_parser("bench-segments",
                           help="time every segment of the chain profile in onnxruntime")
    common(bench)
    how = bench.add_mutually_exclusive_group()
    how.add_argument("--cuts", metavar="I,J,...", help="cut positions (after the first I nodes)")
    how.add_argument("--segments", type=ca.int_range(1, 4096), default=16, metavar="K",
                     help="the chain profile's K segments, as placed (default 16)")
    bench.add_argument("--providers", metavar="P1,P2",
                       help="execution providers, best first (default CPUExecutionProvider)")
    bench.add_argument("--threads", type=ca.int_range(1, 1024), default=1, help="intra-op threads (default 1)")
    bench.add_argument("--repeats", type=ca.int_range(1, 100_000), default=20, help="timed runs each (default 20)")
    bench.add_argument("--device-class", metavar="NAME",
                       help="also print segment_times_s {NAME: calibrated seconds} for a "
                            "workload or profile")
    bench.add_argument("--json", action="store_true", help="JSON only")
    bench.set_defaults(func=_bench_segments, strategy="balanced")
