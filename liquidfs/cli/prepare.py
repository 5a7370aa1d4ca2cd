"""``liquidfs prepare`` and ``liquidfs verify``: a seeded share of the images expanded to raw objects in a
store (with ``--ratio auto``, the share ``profile`` chooses), and every raw object checked against its source."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..expand.rawformats import DEFAULT, DEFAULT_FORMATS, RAW_FORMATS
from . import options
from .options import CommandParser, argument
from .profile import (FORMATS_METAVAR, add_loader_arguments, add_run_arguments, loader_options, model_only_refusal,
                      run_options, search_flags)

if TYPE_CHECKING:
    from ..stores import Store


def _formats_help() -> str:
    """What prepare's ``--formats`` help says of each raw format, from the registry."""
    each = ", ".join(f"{f.name} ({'default: ' if f is DEFAULT else ''}{f.about})"
                     for f in sorted(RAW_FORMATS.values(), key=lambda f: f.name))
    several = "both" if len(RAW_FORMATS) == 2 else "several"
    order = ", ".join(f.label for f in RAW_FORMATS.values())
    return (f"what the expanded images are stored as: {each}, or {several} (each image as the first of {order} "
            "that holds it exactly). Every object is checked to decode to the source's pixels under Pillow")


def add_arguments(sub: argparse._SubParsersAction[CommandParser],
                  add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "prepare", help="expand a share of the images to raw BMP in a store",
        description="Choose a seeded random share (--ratio) of the PNG/JPEG images under SOURCE, expand each to "
        "a BMP that decodes to exactly the same pixels (checked before it is accepted), and record the choice "
        "in the store's catalog. Resumable and idempotent; changing --ratio reuses existing expansions. The "
        "source is never written.")
    p.add_argument("source", help="the dataset directory, or s3://BUCKET/PREFIX")
    p.add_argument("--store", required=True,
                   help="directory for the catalog and the raw objects; s3://BUCKET/PREFIX for an s3:// source "
                   "(the catalog is uploaded there at the end, for every node's mounts)")
    p.add_argument("--ratio", type=argument(options.ratio), required=True,
                   help="share of eligible images served raw: 0..1, a percentage, or 'auto' (profile first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--formats", type=argument(options.formats), default=DEFAULT_FORMATS, metavar=FORMATS_METAVAR,
                   help=_formats_help())
    p.add_argument("--jobs", "-j", type=argument(options.workers),
                   help="worker processes (default: the cores this process may use, fewer where memory is short: "
                   "each worker gets room for the largest image expanded, 100 Mpx, about 2.5 GB). A larger "
                   "value is lowered to what fits in the memory left (cgroup limit, MemAvailable), with a warning")
    p.add_argument("--quick", action="store_true",
                   help="with --ratio auto: a quick profile (a smaller sample, shorter measurements)")
    add_run_arguments(p, prefix="with --ratio auto: ")
    add_loader_arguments(p, prefix="with --ratio auto: ")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, a line every 30 s on a log)")
    add_common(p)
    p.set_defaults(func=cmd_prepare)

    v = sub.add_parser(
        "verify", help="check every raw object against its source",
        description="Re-decode every raw object of the store and its source and compare pixels and checksums. "
        "Exit status 0 only when all hold.")
    v.add_argument("--store", required=True, help="the store directory, or the s3:// store prepare wrote to")
    v.add_argument("--sample", type=argument(options.positive_int), metavar="N",
                   help="check only N random objects (at least one)")
    v.add_argument("--jobs", "-j", type=argument(options.workers),
                   help="worker processes (default: the cores, fewer where memory is short; lowered to what fits)")
    v.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    add_common(v)
    v.set_defaults(func=cmd_verify)


def cmd_prepare(args: argparse.Namespace) -> int:
    ratio, raw_formats = args.ratio, args.formats
    from ..prepare import PrepareError, prepare_store
    from ..stores import open_store

    store = open_store(args.source, args.store)
    if ratio != "auto" and args.run is not None:
        print("liquidfs prepare: --run times a loader for --ratio auto; with a given ratio there is nothing to "
              "measure", file=sys.stderr)
        return 2
    if ratio != "auto" and args.cache_size:
        print("liquidfs prepare: --cache-size weighs the mount's cache for --ratio auto; give it to mount",
              file=sys.stderr)
        return 2
    profiled = [flag for flag, given in (("--quick", args.quick), ("--model-only", args.model_only),
                                         ("--readers", args.readers is not None),
                                         ("--gpu-train-rate", args.gpu_train_rate is not None)) if given]
    profiled += search_flags(args)  # (--run, with a given ratio, is said above)
    if ratio != "auto" and profiled:
        print(f"liquidfs prepare: {', '.join(profiled)} shape the profile of --ratio auto; with a given ratio "
              "there is no profile", file=sys.stderr)
        return 2
    refused = model_only_refusal(args) if ratio == "auto" else None
    if refused is not None:
        print(f"liquidfs prepare: {refused}", file=sys.stderr)
        return 2
    if ratio == "auto":
        ratio, chosen_format = _auto_ratio(store, quick=args.quick, formats=raw_formats,
                                           run_options={**run_options(args), **loader_options(args)})
        # The chosen format, and those tried after it for the images it cannot hold (J2K chosen: BMP, if listed;
        # BMP chosen: BMP alone).
        raw_formats = raw_formats[raw_formats.index(chosen_format):]
        print(f"profile chose ratio {ratio:.2f} (raw images as {chosen_format.upper()})")
    try:
        report = prepare_store(store, ratio, seed=args.seed, jobs=args.jobs, progress=not args.no_progress,
                               raw_formats=raw_formats)
    except PrepareError as exc:
        print(f"liquidfs prepare: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    written = [RAW_FORMATS[f] for f in raw_formats]
    for fmt in written:
        # (a JPEG's pixels are its decoder's: the object holds Pillow's, which DALI's or OpenCV's decode of the
        # original may differ from by a level, docs/guarantees.md)
        print(f"{fmt.name} objects decode to the source's pixels under: {', '.join(fmt.exact_for)} (those of JPEG "
              "sources: Pillow's decode)")
    for fmt in written:
        if fmt.gpu_decoder is not None and fmt.gpu_decoder not in fmt.exact_for:
            print(f"liquidfs prepare: {fmt.label} objects are for DALI's 'mixed' decoder (nvJPEG2000), which this "
                  "project has not yet shown exact on a GPU: check it on yours with "
                  "`python scripts/bench/bench_j2k.py` before training", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..catalog.schema import CatalogError
    from ..prepare import PrepareError, verify
    from ..sysio.safefiles import escape_controls

    try:
        failures = verify(args.store, sample=args.sample, jobs=args.jobs, progress=not args.no_progress)
    except (CatalogError, PrepareError) as exc:
        print(f"liquidfs verify: {exc}", file=sys.stderr)
        return 2
    for path, problem in failures:
        print(f"FAIL {escape_controls(path)}: {escape_controls(problem)}")  # names the dataset's writer chose
    print("verify: " + ("all raw objects sound" if not failures else f"{len(failures)} problems"))
    return 1 if failures else 0


def _auto_ratio(store: Store, *, quick: bool = False, formats: tuple[str, ...] = DEFAULT_FORMATS,
                run_options: dict[str, object] | None = None) -> tuple[float, str]:
    """``prepare --ratio auto``: profile (weighing the raw ``formats``), and keep the result in the store
    (``mount --mix adaptive`` starts at its choice). The share, and the raw format it is for."""
    from ..profile.choose import profile_store, render, to_json

    run_options = run_options or {}
    profile = profile_store(store, quick=quick, formats=formats, **run_options,  # type: ignore[arg-type]
                            progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    try:
        store.keep_profile(json.dumps(to_json(profile), indent=1))
    except OSError as exc:
        print(f"profile: cannot keep the result in {store.label}: {exc.strerror}", file=sys.stderr)
    return profile.chosen, profile.raw_format
