"""``liquidfs profile``: measure this machine and choose the share of images to serve raw; the measured
search's flags, which ``prepare --ratio auto`` takes too."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from ..expand.rawformats import DEFAULT, DEFAULT_FORMATS, RAW_FORMATS
from . import options
from .options import CommandParser, argument

#: ``--formats``'s metavar: png, the default raw format, and the others optional.
FORMATS_METAVAR = ",".join(["png", DEFAULT.name]) + "".join(f"[,{n}]" for n in sorted(RAW_FORMATS) if n != DEFAULT.name)


def add_run_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The measured search's flags, shared by ``profile`` and ``prepare --ratio auto``."""
    p.add_argument("--run", metavar="CMD",
                   help=prefix + "time this loader command through a temporary mount of a sample at each share a "
                   "binary search asks for; {mount} in CMD is replaced by the mount point, e.g. --run 'python "
                   "train.py --data {mount} --steps 40' (run without a shell; its rate is the opens/s the mount "
                   "counts). Default: a built-in DALI or Pillow pipeline (decode, random resized crop, flip, "
                   "normalise)")
    p.add_argument("--run-images", type=argument(options.positive_int), metavar="N",
                   help=prefix + "images in the mounted sample (default 256, --quick 64)")
    # (defaults given by ``run_options``: None here tells a flag given from one left out, ``search_flags``)
    p.add_argument("--repeats", type=argument(options.positive_int), metavar="N",
                   help=prefix + f"runs per share at most, where two shares' rates are within noise (default "
                   f"{REPEATS})")
    p.add_argument("--run-timeout", type=argument(options.positive_float), metavar="SECONDS",
                   help=prefix + f"the longest one run of the command may take (default {RUN_TIMEOUT:g})")
    p.add_argument("--model-only", action="store_true",
                   help=prefix + "no measured search: choose by the cost model alone (no mount; seconds)")
    p.add_argument("--cache-size", type=argument(options.cache_share), default=0.0, metavar="PERCENT",
                   help=prefix + "the --cache-size the dataset will be mounted with, as a percentage (default 0%%): "
                   "its hits take that share of the bytes off storage, which moves the balance towards raw; the "
                   "measured runs have it and are timed from their second epoch")


#: ``--repeats`` and ``--run-timeout`` where not given.
REPEATS = 3
RUN_TIMEOUT = 600.0


def run_options(args: argparse.Namespace) -> dict[str, object]:
    return {"run": args.run, "measured": not args.model_only, "run_images": args.run_images,
            "repeats": REPEATS if args.repeats is None else args.repeats,
            "run_timeout": RUN_TIMEOUT if args.run_timeout is None else args.run_timeout,
            "cache_share": args.cache_size}


def search_flags(args: argparse.Namespace) -> list[str]:
    """The measured search's flags given (``--run``, ``--run-images``, ``--repeats``, ``--run-timeout``)."""
    return [flag for flag, given in (("--run", args.run is not None), ("--run-images", args.run_images is not None),
                                     ("--repeats", args.repeats is not None),
                                     ("--run-timeout", args.run_timeout is not None)) if given]


def model_only_refusal(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot be taken, for ``profile`` and ``prepare --ratio auto``: the search's flags beside
    ``--model-only``, which has no search (they were dropped without a word)."""
    given = search_flags(args) if args.model_only else []
    return f"{', '.join(given)}: the measured search's, which --model-only skips" if given else None


def add_loader_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """What the profile's model knows of the loader and the GPU beyond its decoder, for ``profile`` and
    ``prepare --ratio auto``."""
    p.add_argument("--readers", type=argument(options.workers), metavar="N",
                   help=prefix + "files the loader reads at once, as its workers do (default: --threads, "
                   "one per decoder thread): storage is timed with as many readers")
    p.add_argument("--gpu-train-rate", type=argument(options.positive_float), metavar="IMG_PER_S",
                   help=prefix + "images/s training alone runs at on this GPU (its data already in memory, e.g. "
                   "synthetic): the GPU time it leaves a GPU decoder of J2K. Default: not counted, and J2K's "
                   "prediction is an upper bound")


def loader_options(args: argparse.Namespace) -> dict[str, object]:
    return {"readers": args.readers, "gpu_train_rate": args.gpu_train_rate}


def _description() -> str:
    from ..profile import choose

    return choose.__doc__ or ""


def add_arguments(sub: argparse._SubParsersAction[CommandParser],
                  add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "profile", help="measure this machine and choose the share of images to serve raw",
        describe=_description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("--store", required=True, help="the store (the sample is expanded on its device)")
    p.add_argument("--decoder", choices=["dali", "pil"], help="the loader's decoder (default: dali if installed)")
    p.add_argument("--threads", type=argument(options.workers), metavar="N",
                   help="decoder threads (default: the cores this process may use: its CPU affinity, or fewer "
                   "where a container's CPU limit allows less)")
    p.add_argument("--sample", type=argument(options.positive_int), metavar="N",
                   help="images in the sample (default 64 or 512 MiB of BMPs, --quick 16 or 128 MiB, whichever "
                   "comes first, but at least 4 a reader)")
    p.add_argument("--quick", action="store_true",
                   help="a smaller sample and shorter measurements: the model in < 30 s, the measured search over "
                   "64 images")
    on_gpu = [f for f in RAW_FORMATS.values() if f.gpu_decoder]
    p.add_argument("--formats", type=argument(options.formats), default=DEFAULT_FORMATS, metavar=FORMATS_METAVAR,
                   help=f"the raw formats to weigh (as prepare's --formats): {DEFAULT.name} (default), or also "
                   + ", ".join(f"{f.name} ({f.about})" for f in on_gpu)
                   + f"; {'/'.join(f.label for f in on_gpu)} weighed only where a GPU decoder decodes it here "
                   "(DALI's 'mixed' for --decoder dali, nvImageCodec for pil), and chosen where predicted faster")
    p.add_argument("--target-rate", type=argument(options.positive_float), metavar="IMG_PER_S",
                   help="choose the smallest raw share that reaches this rate (saves disk space)")
    add_run_arguments(p)
    add_loader_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of the curves")
    add_common(p)
    p.set_defaults(func=cmd_profile)


def _checked_before(args: argparse.Namespace) -> None:
    """What can be refused before minutes of measuring: a decoder that is not installed (DALI's import failed
    with a traceback once the sample was expanded and storage timed), and a --json or --plot path that cannot be
    written (said at the end, naming a temporary file of its own)."""
    from ..profile.decoders import dali_available
    from ..stores.sample import ProfileError

    refused = model_only_refusal(args)
    if refused is not None:
        raise ProfileError(refused)
    if args.decoder == "dali" and not dali_available():
        raise ProfileError("--decoder dali: DALI is not installed here (pip install nvidia-dali-cuda120); "
                           "--decoder pil measures Pillow")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        target = Path(path)
        if target.is_dir():
            raise ProfileError(f"{flag} {path}: a directory (give a file's path)")
        if not target.parent.is_dir():
            raise ProfileError(f"{flag} {path}: no directory {target.parent} to write it in")


def cmd_profile(args: argparse.Namespace) -> int:
    from ..profile.choose import plot, profile_store, render, to_json
    from ..stores import open_store
    from ..sysio.safefiles import replace_file

    _checked_before(args)
    profile = profile_store(open_store(args.source, args.store), decoder=args.decoder, threads=args.threads,
                            sample=args.sample, quick=args.quick,
                            target_rate=args.target_rate, formats=args.formats,
                            **run_options(args), **loader_options(args),  # type: ignore[arg-type]
                            progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    if args.json:
        # a path in a directory others may write (/tmp): replaced whole, never written through a link
        replace_file(args.json, json.dumps(to_json(profile), indent=1).encode())
    if args.plot:
        plot(profile, args.plot)
    return 0
