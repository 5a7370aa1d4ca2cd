"""``liquidfs profile``: measure this machine and choose the share of images to serve raw.

Two estimates of the best mix, both from measurements on a sample of the real dataset (only the sample is
expanded, into a scratch directory inside the store, on the store's device):

* **model**: per-image costs measured per representation (bytes/s of storage for whole-file random reads with the
  page cache bypassed, as many readers at once as the loader has (``--readers``, by default its ``--threads``),
  decode images/s with the user's decoder and thread count, and the CPU that reading costs)
  give, for a raw share ``r``, load time ``L(r)`` and CPU time ``D(r)`` per image, both linear in ``r``. The
  pipeline runs at ``1 / max(L, D)``: the best ``r`` is where the two lines cross, or an end.
* **search**: the published method: a binary search over the 11 mixes 0:10 ... 10:0 that measures load and
  decode throughput of a sample mixed at the midpoint and discards the half on the side of the slower stage.
* **measured** (decides, where it can run): the loader itself timed through a temporary mount of a sample of the
  dataset, kept in the dataset's layout, at each share a binary search over the 11 asks for (``measured``). The
  loader is the command given with ``--run`` (``{mount}`` replaced by the mount point), else a built-in DALI or
  Pillow pipeline that decodes, crops, flips and normalises as training does (``liquidfs.profile.loaders``). Its rate
  is the mount's own count of opens per second. The model's choice is the search's first guess, and the answer
  where the search cannot run (an S3 store, no FUSE, ``--model-only``, a GPU-decoded format).

The cache (``--cache-size``) serves a constant share of every epoch from memory, so only ``1 - c`` of the bytes
reach storage: the load line is scaled by it.

With ``--formats png,bmp,j2k`` the raw images may also be lossless JPEG 2000, decoded on the GPU (nvJPEG2000) by
DALI's ``mixed`` decoder for a DALI loader, or by NVIDIA nvImageCodec for any other (the loader hands the J2K
objects to it): a third stage, the GPU, and the host's CPU pays only the feeding. It is weighed only where that
GPU decoder decodes a J2K here (on a CPU, J2K decodes slower than PNG), by the model alone, and chosen where its
best share is predicted faster than BMP's by a margin. The GPU's time per image is the training's share plus the
decoding: ``G(r) = 1 / T + r / g``, with ``g`` the decoder's images/s measured alone on the GPU and ``T`` the
images/s training alone runs at on it (``--gpu-train-rate``, e.g. the model's rate on synthetic data). J2K pays
where storage binds and the GPU has time to spare; the output says which kind of node this is: "storage binds",
"decode binds", or "GPU has no time to spare" (training alone is as slow as the data path at BMP's best share).
Without ``--gpu-train-rate`` training's GPU time is not counted and the J2K prediction is an upper bound;
``scripts/bench/bench_train.py`` measures the whole.
"""

from __future__ import annotations

import io
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..expand.rawformats import BMP, RAW_FORMATS, RawFormat
from ..stores import Store
from ..stores.sample import FILES_PER_READER, ProfileError
from ..sysio.cgroups import usable_cores
from ..sysio.safefiles import replace_file
from . import decoders as decoderates
from . import measured as runprofile
from .decoders import GpuDecoder, dali_available, measure_decode
from .model import Costs, choose_for_target, model_choice, model_or_search, node_kind, paper_search, per_second

__all__ = ["Profile", "ProfileError", "profile_store", "render", "to_json"]

log = logging.getLogger(__name__)

RATIOS = [i / 10 for i in range(11)]
#: A format decoded on a GPU (J2K) is chosen over BMP only when predicted this much faster: its GPU decode rate
#: is measured on an idle GPU, and decoding beside training costs more than the sum of the two alone.
GPU_MARGIN = 1.1
#: The sample, where ``--sample`` does not set it: this many images, fewer where their raw expansions reach
#: ``SAMPLE_BYTES`` first, but never fewer than ``sample.FILES_PER_READER`` a reader unless the memory they may hold
#: runs out first (``sample.Sample.full``).
SAMPLE_IMAGES, QUICK_SAMPLE_IMAGES = 64, 16
SAMPLE_BYTES, QUICK_SAMPLE_BYTES = 512 << 20, 128 << 20


@dataclass
class Profile:
    costs: Costs  # of the chosen raw format
    table: list[dict[str, float]]
    model_ratio: float
    model_reason: str
    search_ratio: float  # the published search runs over PNG:BMP mixes
    search_steps: list[dict[str, float]]
    chosen: float
    chosen_by: str
    target_rate: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    raw_format: str = BMP.name  # what the chosen share is stored as
    weighed: list[dict[str, object]] = field(default_factory=list)  # per raw format weighed: its best share
    timed: str | None = None  # what the measured search timed, in words (None: no measured search)
    measured: list[dict[str, object]] = field(default_factory=list)  # per share measured: its runs' rates
    within_noise: list[float] = field(default_factory=list)  # shares measured within noise of the chosen one
    node: str = ""  # which kind of node this is at BMP's best share: STORAGE_BINDS, DECODE_BINDS or GPU_BUSY
    node_detail: str = ""  # the stages' rates there, and the GPU's time to spare
    gpu_decoder: str | None = None  # the GPU decoder weighed for a format decoded there (None: none weighed)


def profile_store(store: Store, *, decoder: str | None = None, threads: int | None = None, cache_share: float = 0.0,
                  sample: int | None = None, quick: bool = False, target_rate: float | None = None,
                  seconds: float | None = None, formats: Sequence[str] = (BMP.name,),
                  readers: int | None = None, gpu_train_rate: float | None = None,
                  find_gpu: Callable[[str], tuple[GpuDecoder | None, str]] | None = None,
                  run: str | None = None, measured: bool = True, run_images: int | None = None,
                  repeats: int = 3, run_timeout: float = 600.0,
                  progress: Callable[[str], None] = lambda s: None) -> Profile:
    """Measure, and choose the raw share, and with ``formats`` naming BMP and others, which of them the
    raw images are stored as. A format decoded on a GPU (J2K) is weighed only where a GPU decodes it for the
    loader (DALI 'mixed' for DALI, nvImageCodec for others; found by ``find_gpu(decoder)``, by default
    ``decoders.find_gpu_decoder``), its GPU time added to training's (``gpu_train_rate`` images/s alone).

    Storage is timed with ``readers`` reading at once (default: ``threads``, as a loader's workers each read).

    ``measured``: then time the loader (``run``, a command with ``{mount}``, else the built-in pipeline of
    ``decoder``) through a mount of a sample of ``run_images`` images at the shares a binary search asks for, and
    choose by what the mount counted (``measured``). Where that cannot run, the model's choice stands with a
    note; with ``run`` given, that is an error instead, said before anything is measured where it can be."""
    if run is not None and measured:
        runprofile.command_for(run, Path("/mnt"))  # a command without {mount}
        why_not = _why_no_search(store, target_rate)
        if why_not is not None:  # (said after minutes of measuring, before: only the chosen format waits)
            raise ProfileError(f"--run: {why_not}")
    started = time.monotonic()
    # The cores this process may use (its affinity, a container's CPU limit), not the host's: the sample, the
    # readers and the CPU's share of the costs are sized by it (os.cpu_count() in a pod limited to 4 of 64
    # cores timed storage at 64 readers and spread decoding over 64 cores: a choice with too much raw).
    threads = threads or usable_cores()
    decoder = decoder or ("dali" if dali_available() else "pil")
    readers = readers or threads
    step = seconds if seconds is not None else (0.6 if quick else 2.5)
    count = sample or max(QUICK_SAMPLE_IMAGES if quick else SAMPLE_IMAGES, FILES_PER_READER * readers)
    # --sample N is N images; the default stops at its bytes too: a sample of 100 Mpx images is not 64 of them
    max_bytes = None if sample else (QUICK_SAMPLE_BYTES if quick else SAMPLE_BYTES)
    gpu_train = 1 / gpu_train_rate if gpu_train_rate else 0.0
    notes: list[str] = []
    find_gpu = find_gpu or decoderates.find_gpu_decoder  # looked up at the call: tests put a fake GPU there
    # Each listed format decoded on a GPU, and what decodes it there (or None, and why it cannot be weighed).
    on_gpu = {f: _gpu_decoder(store, f, decoder, find_gpu)
              for f in map(RAW_FORMATS.__getitem__, formats) if f.gpu_decoder}
    if BMP.name not in formats and all(measure is None for measure, _ in on_gpu.values()):
        raise ProfileError("; ".join(f"{f.label} cannot be weighed: {where}" for f, (_, where) in on_gpu.items())
                           + f"; add {BMP.name} to --formats (or give prepare a --ratio)")
    # The BMP sample always: it measures the originals (and the published search runs over PNG:BMP mixes).
    costs, search_r, steps = _measure_bmp(store, count, max_bytes, decoder, threads, readers, step, cache_share,
                                          gpu_train, progress, search=BMP.name in formats)
    options: dict[str, tuple[Costs, float, str]] = {}
    if BMP.name in formats:
        options[BMP.name] = (costs, *model_or_search(costs, search_r))
    failed: list[ProfileError] = []
    for fmt, (measure_gpu, gpu_where) in on_gpu.items():
        if measure_gpu is None:
            notes.append(f"{fmt.label} not weighed: {gpu_where}")
            continue
        try:
            gpu_costs = _measure_on_gpu(store, fmt, costs, count, max_bytes, step, measure_gpu, gpu_where,
                                        progress)
        except ProfileError as exc:
            failed.append(exc)
            notes.append(f"{fmt.label} not weighed: {exc}")
        else:
            r, reason = model_choice(gpu_costs)
            options[fmt.name] = (gpu_costs, round(r, 2),
                                 f"model, {fmt.label} decoded on the GPU ({gpu_where}): {reason}")
    if not options:
        raise failed[0]  # nothing else was weighed: as the only measurement, its failure is the profile's

    def predicted(f: str) -> float:
        rate = options[f][0].throughput(options[f][1])
        # The GPU's rate was measured alone and training shares the GPU: a format decoded there must win by a
        # margin.
        return rate / GPU_MARGIN if RAW_FORMATS[f].gpu_decoder and BMP.name in options else rate

    raw_format = max(options, key=lambda f: (predicted(f), f == BMP.name))  # BMP on a tie
    if RAW_FORMATS[raw_format].gpu_decoder:
        label = RAW_FORMATS[raw_format].label
        by = ("DALI's 'mixed' decoder" if decoder == "dali"
              else f"nvImageCodec (its {label} objects handed to nvidia.nvimgcodec, the rest to {decoder})")
        notes.append(f"{label} chosen for a loader that decodes with {by} on this GPU; a loader that decodes on "
                     f"the CPU would run several times slower on a {label} store")
    if not gpu_train and any(measure is not None for measure, _ in on_gpu.values()):
        notes.append("training's GPU time not counted (give --gpu-train-rate): the GPU decoder's rate is its rate "
                     "alone, an upper bound")
    node, node_detail = node_kind(costs)
    gpu_decoder = next((where for measure, where in on_gpu.values() if measure is not None), None)
    chosen_costs, chosen, chosen_by = options[raw_format]
    weighed: list[dict[str, object]] = [
        {"raw_format": f, "ratio": r, "predicted_images_per_s": c.throughput(r), "raw_bytes": c.raw_bytes}
        for f, (c, r, _) in options.items()]
    if target_rate is not None:
        smallest = choose_for_target(chosen_costs, target_rate)
        if smallest is None:
            best = max(chosen_costs.throughput(i / 100) for i in range(101))
            notes.append(f"no mix reaches {target_rate:g} img/s (best predicted {best:.1f}); keeping {chosen:.2f}")
        else:
            chosen, chosen_by = smallest, f"smallest raw share predicted to reach {target_rate:g} img/s"
    timed: str | None = None
    search_result: runprofile.SearchResult | None = None
    runs: list[runprofile.RunRate] = []
    if measured and (target_rate is None or run is not None):
        why_not = _why_not_measured(store, raw_format, target_rate)
        if why_not is not None:
            if run is not None:
                raise ProfileError(f"--run: {why_not}")
            notes.append(f"measured search not run: {why_not}; the model's choice stands")
        else:
            images = run_images or (64 if quick else 256)
            # With a cache, the second epoch, which hits the cache's share, is the one timed (the built-in
            # pipeline reads two).
            timed_epoch = 2 if cache_share else 1
            # The built-in pipeline's shuffle buffer is of the images the sample holds (a dataset of 40 had
            # one of 32 for 256 asked: nearly the epoch, reading and decoding no longer overlapping).
            command_of: Callable[[int], str] = (
                (lambda copied: run) if run is not None else
                (lambda copied: runprofile.builtin_command(decoder, threads, copied, epochs=timed_epoch)))
            try:
                timed, search_result, runs = _measured_search(
                    store, command_of, first=chosen, images=images, repeats=repeats, timeout=run_timeout,
                    cache_share=cache_share, timed_epoch=timed_epoch, progress=progress,
                    max_bytes=None if run_images else runprofile.COPY_BYTES)  # (--run-images N: N images)
            except ProfileError as exc:
                if run is not None:
                    raise
                notes.append(f"measured search not run: {exc}; the model's choice stands")
    if cache_share and any(r.from_epoch < 2 for r in runs):
        notes.append("the command read one epoch in a run: the cache's hits are not in its rate (its first epoch "
                     "has none); give it two epochs to time the second")
    if search_result is not None:
        best = search_result.median(search_result.chosen)
        model_guess = chosen
        chosen = search_result.chosen
        if model_guess == chosen:
            guess = "the model's guess too"
        elif model_guess in search_result.rates:
            guess = f"{search_result.median(model_guess):.1f} img/s at the model's {model_guess:.2f}"
        else:
            guess = f"the model guessed {model_guess:.2f}"
        chosen_by = f"measured search: {best:.1f} img/s through the mount ({guess})"
    model_r, reason = model_choice(chosen_costs)
    table = [{"ratio": r, "load_images_per_s": per_second(chosen_costs.load_time(r)),
              "decode_images_per_s": per_second(chosen_costs.cpu_time(r)),
              **({"gpu_images_per_s": per_second(chosen_costs.gpu_time(r))} if "GPU" in chosen_costs.stage_times(r)
                 else {}),
              "predicted_images_per_s": chosen_costs.throughput(r)}
             for r in RATIOS]
    return Profile(costs=chosen_costs, table=table, model_ratio=round(model_r, 2), model_reason=reason,
                   search_ratio=search_r, search_steps=steps, chosen=chosen, chosen_by=chosen_by,
                   target_rate=target_rate, seconds=time.monotonic() - started, notes=notes, raw_format=raw_format,
                   weighed=weighed, timed=timed,
                   measured=_measured_rows(search_result, runs) if search_result else [],
                   within_noise=search_result.within_noise if search_result else [],
                   node=node, node_detail=node_detail, gpu_decoder=gpu_decoder)



def _why_not_measured(store: Store, raw_format: str, target_rate: float | None) -> str | None:
    """Why the measured search cannot run here, or None."""
    why_not = _why_no_search(store, target_rate)
    if why_not is None and raw_format != BMP.name:
        return f"{RAW_FORMATS[raw_format].label} decoded on the GPU is weighed by the model alone"
    return why_not


def _why_no_search(store: Store, target_rate: float | None) -> str | None:
    """Why the measured search cannot run here whatever format is chosen, or None: known before measuring."""
    if store.local_dirs() is None:
        return f"it mounts a sample of a local dataset; {store.label} is not a local store"
    if target_rate is not None:
        return "--target-rate chooses by the model"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse cannot be opened here"
    return None


def _measured_search(store: Store, command_of: Callable[[int], str], *, first: float, images: int, repeats: int,
                     timeout: float, cache_share: float, timed_epoch: int, progress: Callable[[str], None],
                     max_bytes: int | None = runprofile.COPY_BYTES
                     ) -> tuple[str, runprofile.SearchResult, list[runprofile.RunRate]]:
    """The binary search over the shares, each run timed through a mount of a scratch sample of ``images``
    images at most (fewer past ``max_bytes`` of originals); ``command_of``: the command, given how many the
    sample holds."""
    runprofile.command_for(command_of(images), Path("/mnt"))  # a command without {mount}: before any copying
    dirs = store.local_dirs()
    assert dirs is not None  # _why_not_measured said so
    source, parent = dirs
    mount_args = ["--cache-size", f"{cache_share * 100:g}%"] if cache_share else []
    runs: list[runprofile.RunRate] = []
    with runprofile.ScratchMounts(source, parent, images, mount_args=mount_args, progress=progress,
                                  timed_from_epoch=timed_epoch, max_bytes=max_bytes) as scratch:
        command = command_of(scratch.images)

        def measure(share: float) -> float:
            rate = scratch.measure(share, command, timeout=timeout)
            runs.append(rate)
            progress(f"share {share:.1f}: {rate.images_per_s:.1f} img/s, {rate.bytes_per_s / 1e6:.0f} MB/s "
                     f"({rate.opens} opens in {rate.seconds:.1f} s)")
            return rate.images_per_s

        progress(f"measured search: timing `{command}` through a mount of the sample")
        result = runprofile.search(measure, first=first, repeats=repeats)
        start = ("first open of its second epoch, the cache's share hit" if timed_epoch == 2 else "first open")
        timed = (f"`{command}` through a temporary mount of {scratch.images} sampled images in the dataset's "
                 f"layout{f' with a {cache_share:.0%} cache' if cache_share else ''}, their page cache dropped "
                 f"before each run; its rate: the mount's opens/s from each run's {start} to when it was done "
                 "with the mount (no file open after its last open, else its exit)")
    return timed, result, runs


def _measured_rows(result: runprofile.SearchResult, runs: list[runprofile.RunRate]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for share in sorted(result.rates):
        mine = [r for r in runs if r.share == share]
        rows.append({"ratio": share, "images_per_s": result.median(share),
                     "runs": [round(r, 2) for r in result.rates[share]],
                     "mb_per_s": statistics.median(r.bytes_per_s for r in mine) / 1e6 if mine else None,
                     "opens": [r.opens for r in mine],
                     "from_epoch": [r.from_epoch for r in mine],
                     # what the command said of itself (its last output line, where it is JSON), beside the mount's
                     "loader_said": [r.said for r in mine]})
    return rows



def _measure_bmp(store: Store, count: int, max_bytes: int | None, decoder: str, threads: int, readers: int,
                 step: float, cache_share: float, gpu_train: float, progress: Callable[[str], None],
                 search: bool = True) -> tuple[Costs, float, list[dict[str, float]]]:
    """Costs of originals and their BMPs, and (``search``) the published binary search over PNG:BMP mixes."""
    progress("expanding a sample")
    smp = store.profile_sample(count, jobs=readers, max_bytes=max_bytes)
    try:
        originals = smp.original_data
        raws = smp.raw_data
        progress(f"measuring storage with {readers} readers over {len(raws)} images")
        load_o, cpu_o = smp.load(smp.originals, step)
        load_r, cpu_r = smp.load(smp.raws, step)
        progress(f"measuring {decoder} decoding on {threads} threads")
        dec_o = measure_decode(originals, decoder, threads, step)
        dec_r = measure_decode(raws, decoder, threads, step)
        costs = Costs(
            images=len(raws), original_bytes=statistics.fmean(map(len, originals)),
            raw_bytes=statistics.fmean(map(len, raws)), load_original=load_o, load_raw=load_r,
            decode_original=dec_o, decode_raw=dec_r,
            read_cpu_per_byte=(cpu_o + cpu_r) / 2, threads=threads, decoder=decoder, cache_share=cache_share,
            readers=readers, gpu_train=gpu_train,
        )

        def measure_mix(r: float) -> tuple[float, float]:
            k = round(r * len(raws))
            paths = smp.raws[:k] + smp.originals[k:]
            data = raws[:k] + originals[k:]
            bps, _ = smp.load(paths, step / 2)
            mean = statistics.fmean(map(len, data))
            load_rate = bps / mean / max(1e-9, 1 - cache_share)
            return load_rate, measure_decode(data, decoder, threads, step / 2)

        search_r, steps = 0.0, list[dict[str, float]]()
        if search:
            progress("binary search over the 11 mixes")
            search_r, steps = paper_search(measure_mix)
    finally:
        smp.cleanup()
    return costs, search_r, steps



def _gpu_decoder(store: Store, fmt: RawFormat, decoder: str,
                 find_gpu: Callable[[str], tuple[GpuDecoder | None, str]]) -> tuple[GpuDecoder | None, str]:
    """What decodes ``fmt`` (a format decoded on a GPU) for the loader on a GPU and a description of it; or None
    and why it cannot be weighed."""
    if fmt.name not in store.raw_formats:
        return None, f"{store.label} holds only {', '.join(store.raw_formats)} objects"
    measure_gpu, where = find_gpu(decoder)
    if measure_gpu is None:
        return None, f"no GPU to decode it ({where}); on the CPU {fmt.label} decodes slower than PNG"
    return measure_gpu, where


def _measure_on_gpu(store: Store, fmt: RawFormat, base: Costs, count: int, max_bytes: int | None, step: float,
                    measure_gpu: GpuDecoder, where: str, progress: Callable[[str], None]) -> Costs:
    """``base`` with the raw images as ``fmt`` (lossless J2K), decoded on the GPU."""
    threads = base.threads
    progress(f"expanding the sample to {fmt.label}")
    smp = store.profile_sample(count, jobs=base.readers, raw_format=fmt.name, max_bytes=max_bytes)
    try:
        progress(f"measuring storage ({fmt.label}, {base.readers} readers)")
        load_raw, _ = smp.load(smp.raws, step)
        progress(f"measuring {fmt.label} decoding on the GPU ({where})")
        rate = measure_gpu(smp.raw_data, threads, step)
        mean = statistics.fmean(map(len, smp.raw_data))
    finally:
        smp.cleanup()
    # The host's CPU seconds per GPU-decoded image, spread on the threads like the CPU decoders' work.
    host = threads / max(rate.host_cpu_per_image, 1e-9)
    return replace(base, raw_format=fmt.name, raw_bytes=mean, load_raw=load_raw, decode_raw=host,
                   gpu_decode_raw=rate.images_per_s)


# -- output ---------------------------------------------------------------------------------------------


def render(profile: Profile) -> str:
    c = profile.costs
    raw = c.raw_format.upper()
    gpu = c.gpu_decode_raw is not None
    gpu_column = "gpu_images_per_s" in profile.table[0]  # a GPU stage: J2K decoded there, or training's time
    decode_raw = (f"{raw} {c.gpu_decode_raw:.1f} img/s on the GPU (host {c.decode_raw:.0f} img/s)" if gpu
                  else f"raw {c.decode_raw:.1f} img/s")
    lines = [
        f"sample: {c.images} images, original {c.original_bytes / 1e6:.2f} MB, {raw} {c.raw_bytes / 1e6:.2f} MB; "
        f"decoder {c.decoder} x{c.threads} threads; cache share {c.cache_share:.0%}",
        f"storage ({c.readers} readers): originals {c.load_original / 1e6:.0f} MB/s, {raw} {c.load_raw / 1e6:.0f} "
        f"MB/s (page cache bypassed); decode: originals {c.decode_original:.1f} img/s, {decode_raw}",
        "",
        "ratio  load img/s  decode img/s" + ("  GPU img/s" if gpu_column else "") + "  predicted img/s",
    ]
    for row in profile.table:
        mark = "  <- chosen" if abs(row["ratio"] - profile.chosen) < 0.05 else ""
        lines.append(f"{row['ratio']:5.1f}  {row['load_images_per_s']:10.1f}  {row['decode_images_per_s']:12.1f}"
                     + (f"  {row['gpu_images_per_s']:9.1f}" if gpu_column else "")
                     + f"  {row['predicted_images_per_s']:15.1f}{mark}")
    lines.append("")
    if profile.search_steps:
        lines.append("binary search over PNG:BMP (measured): " + ", ".join(
            f"{s['ratio']:.1f}: load {s['load_images_per_s']:.0f} / decode {s['decode_images_per_s']:.0f}"
            for s in profile.search_steps) + f" -> {profile.search_ratio:.1f}")
    lines.append(f"model: {profile.model_ratio:.2f} ({profile.model_reason})")
    if profile.timed:
        lines.append(f"measured: {profile.timed}")
        for m in profile.measured:
            runs = ", ".join(f"{r:.1f}" for r in m["runs"])  # type: ignore[attr-defined]
            mark = ("  <- chosen" if m["ratio"] == profile.chosen
                    else "  (within noise)" if m["ratio"] in profile.within_noise else "")
            lines.append(f"  share {m['ratio']:.1f}: {m['images_per_s']:7.1f} img/s  (runs {runs}){mark}")
    if profile.gpu_decoder:
        lines.append(f"GPU decoder weighed: {profile.gpu_decoder}"
                     + (f"; training {1 / c.gpu_train:.1f} img/s alone on the GPU" if c.gpu_train else ""))
    if profile.node:
        lines.append(f"node: {profile.node} ({profile.node_detail})")
    if len(profile.weighed) > 1:
        lines.append("weighed: " + "; ".join(
            f"{str(w['raw_format']).upper()} at {w['ratio']:.2f}: {w['predicted_images_per_s']:.1f} img/s"
            for w in profile.weighed))
    lines += [
        f"chosen ratio {profile.chosen:.2f} (raw images as {raw}) by the {profile.chosen_by}",
        *profile.notes,
        f"({profile.seconds:.1f} s)",
    ]
    return "\n".join(lines)


def to_json(profile: Profile) -> dict[str, object]:
    """The profile as strict JSON: a rate without a bound (no GPU work at share 0) is null, not Infinity."""
    out = asdict(profile)
    out["costs"] = asdict(profile.costs)
    out["table"] = [{k: v if math.isfinite(v) else None for k, v in row.items()} for row in profile.table]
    return out


def plot(profile: Profile, path: str | os.PathLike[str], width: int = 720, height: int = 420) -> None:
    """A PNG of the load and decode curves (images/s against raw share) with the chosen point."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 60, width - 20, 30, height - 50
    keys = [k for k in ("load_images_per_s", "decode_images_per_s", "gpu_images_per_s") if k in profile.table[0]]
    ymax = max([r[k] for r in profile.table for k in keys if math.isfinite(r[k])] or [1.0]) * 1.1

    def x(r: float) -> float:
        return left + r * (right - left)

    def y(v: float) -> float:
        return bottom - min(v, ymax) / ymax * (bottom - top)

    draw.rectangle((left, top, right, bottom), outline="black")
    for i in range(11):
        draw.line((x(i / 10), bottom, x(i / 10), bottom + 5), fill="black")
        draw.text((x(i / 10) - 8, bottom + 8), f"{i / 10:.1f}", fill="black")
    for k in range(5):
        v = ymax * k / 4
        draw.text((5, y(v) - 6), f"{v:.0f}", fill="black")
    for key, colour in (("load_images_per_s", "blue"), ("decode_images_per_s", "red"),
                        ("gpu_images_per_s", "orange"), ("predicted_images_per_s", "green")):
        pts = [(x(r["ratio"]), y(r[key])) for r in profile.table if key in r and math.isfinite(r[key])]
        if len(pts) < 2:
            continue
        draw.line(pts, fill=colour, width=3 if key == "predicted_images_per_s" else 2)
    cx, cy = x(profile.chosen), y(profile.costs.throughput(profile.chosen))
    draw.ellipse((cx - 6, cy - 6, cx + 6, cy + 6), outline="black", width=3)
    gpu = ", GPU decode (orange)" if "gpu_images_per_s" in keys else ""
    draw.text((left + 5, 5), f"images/s vs {profile.raw_format.upper()} share: load (blue), decode (red){gpu}, "
              "predicted (green), chosen (o)", fill="black")
    draw.text((left + (right - left) // 2 - 40, height - 22), "raw share", fill="black")
    encoded = io.BytesIO()
    img.save(encoded, format="PNG")
    replace_file(path, encoded.getvalue())  # a path in a directory others write (/tmp): never through a link

