"""Deployment assets under mount/: the container image (mount/Dockerfile).

``test_dockerfile_structure`` is static and runs everywhere. ``test_container_image`` (``slow``, root) touches the
real system: it debootstraps a bookworm base image (cached in podman as localhost/liquidfs-base), builds
mount/Dockerfile with podman, runs prepare in it without capabilities, runs it privileged with /dev/fuse and a
mount point shared back to the host (both with a read-only root, as the manifests' readOnlyRootFilesystem), reads
through the mount, stops it with SIGTERM. It may apt-get install podman, debootstrap and runc only when CI or
LIQUIDFS_TEST_CONTAINER=1 is set.

With CI set, the container test fails instead of skipping when it cannot run (it says the exact step and reason);
elsewhere it skips with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from deployhelpers import (IN_CI, MOUNT_DIR, MOUNTPOINT_IN_POD, REPO, assert_same_dataset, force_unmount,
                           is_fuse_mounted, make_source_tree, run, skip_or_fail, wait_until)

DOCKERFILE = MOUNT_DIR / "Dockerfile"
DOCKERIGNORE = MOUNT_DIR / "Dockerfile.dockerignore"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure():
    import json

    ins = _dockerfile_instructions()
    assert ins[0] == ("ARG", "BASE=python:3.11-slim-bookworm")
    froms = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    assert len(froms) == 2, "multi-stage: builder + final"
    assert ins[froms[0]][1] == "${BASE} AS builder" and ins[froms[1]][1] == "${BASE}"
    builder, final = ins[froms[0]:froms[1]], ins[froms[1]:]
    builder_runs = " ".join(rest for w, rest in builder if w == "RUN")
    final_runs = " ".join(rest for w, rest in final if w == "RUN")
    for pkg in ("libfuse3-dev", "pkg-config", "gcc"):
        assert pkg in builder_runs
        assert pkg not in final_runs, f"{pkg} must not be in the final image"
    assert re.search(r"\bfuse3\b", final_runs) and re.search(r"\btini\b", final_runs)
    assert any(w == "COPY" and rest.startswith("--from=builder") for w, rest in final)
    final_dict = {w: rest for w, rest in final}
    assert final_dict["STOPSIGNAL"] == "SIGTERM"
    entry = json.loads(final_dict["ENTRYPOINT"])  # exec form
    assert entry[0].endswith("tini") and entry[entry.index("--") + 1:] == ["liquidfs", "mount", "--foreground"]
    assert isinstance(json.loads(final_dict["CMD"]), list)
    assert final_dict.get("USER", "root") == "root"
    ignore = DOCKERIGNORE.read_text().split()
    assert "**" in ignore and "!liquidfs/" in ignore and "!pyproject.toml" in ignore


# ------------------------------------------------------------------------------------------------------
# Container image: debootstrap base -> podman build -> podman run --privileged -> SIGTERM
# ------------------------------------------------------------------------------------------------------

BASE_IMAGE = "localhost/liquidfs-base"
TEST_IMAGE = "localhost/liquidfs:test"
CONTAINER_TOOLS = {"podman": "podman", "debootstrap": "debootstrap"}


def _report(step: str, seconds: float, capsys) -> None:
    with capsys.disabled():
        print(f"\n[test_deploy_container] {step}: {seconds:.1f} s", flush=True)


def _debian_mirror() -> str:
    """The Debian mirror apt is configured with (bookworm main), for debootstrap."""
    sources = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            sources.append(path.read_text())
    for text in sources:
        for stanza in re.split(r"\n\s*\n", text):           # deb822 .sources
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.MULTILINE))
            if "bookworm" in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                for uri in fields.get("URIs", "").split():
                    if "security" not in uri:
                        return uri
        for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", text, re.MULTILINE):   # one-line style
            if "security" not in m.group(1):
                return m.group(1)
    return "http://deb.debian.org/debian"


def _ensure_container_tools() -> None:
    missing = [pkg for tool, pkg in CONTAINER_TOOLS.items() if shutil.which(tool) is None]
    if missing:
        if not (IN_CI or os.environ.get("LIQUIDFS_TEST_CONTAINER") == "1"):
            pytest.skip(f"step 'tools': {', '.join(missing)} not installed; set LIQUIDFS_TEST_CONTAINER=1 "
                        "(or CI) to let this test apt-get install them")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update"], env=env, timeout=600, check=True)
        # with recommends (netavark, buildah, ...), as verified; runc because crun refuses hybrid cgroups
        run(["apt-get", "install", "-y", "podman", "debootstrap", "runc"], env=env, timeout=900, check=True)


def _ensure_base_image(tmp_path: Path, capsys) -> None:
    if run(["podman", "image", "exists", BASE_IMAGE]).returncode == 0:
        return
    root = tmp_path / "rootfs"
    t0 = time.monotonic()
    proc = run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                "bookworm", str(root), _debian_mirror()], timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"step 'debootstrap' failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    _report("debootstrap", time.monotonic() - t0, capsys)
    # Trust the same extra CAs as this host (e.g. an egress proxy's) so pip in the build reaches PyPI.
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra:
        for crt in extra:
            shutil.copy(crt, root / "usr/local/share/ca-certificates" / crt.name)
        run(["chroot", str(root), "update-ca-certificates"], check=True)
    run(["chroot", str(root), "apt-get", "clean"], check=True)
    t0 = time.monotonic()
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        imp = subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, timeout=600,
                             capture_output=True, text=True, check=False)
    finally:
        tar.stdout.close()
        tar.wait()
    if imp.returncode != 0 or tar.returncode != 0:
        pytest.fail(f"step 'podman import' failed: {imp.stderr}")
    _report("podman import", time.monotonic() - t0, capsys)


def _podman_run_options(image: str) -> list[str]:
    """podman run options that work on this host, found by trying; skips with every error if none does.

    Known host quirks: crun refuses hybrid cgroup v1/v2 hosts ("cgroups in hybrid mode not supported"),
    where runc works; without CAP_SYS_RESOURCE, podman's default rlimits (nofile/nproc above the
    current hard limits) cannot be applied, so pass the current ones explicitly.
    """
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 32768 if nproc in (resource.RLIM_INFINITY, -1) else min(nproc, 32768)
    ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]
    runtimes: list[list[str]] = [[]]
    if shutil.which("runc"):
        runtimes.append(["--runtime", "runc"])
    errors = []
    for rt in runtimes:
        for ul in ([], ulimits):
            opts = rt + ul
            proc = run(["podman", "run", "--rm", "--network", "none", *opts, "--entrypoint", "liquidfs",
                        image, "--help"], timeout=120)
            if proc.returncode == 0:
                assert "mount" in proc.stdout
                return opts
            errors.append(f"podman run {' '.join(opts) or '(defaults)'}: {proc.stderr.strip()[-300:]}")
    skip_or_fail("step 'podman run': this host cannot run containers:\n" + "\n".join(errors))


@contextlib.contextmanager
def _shared_mountpoint(path: Path):
    """``path`` as a shared mount (needed for -v path:...:rshared); undone afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        run(["mount", "--make-shared", str(path)], check=True)
        yield path
    finally:
        force_unmount(path)
        run(["umount", "-l", str(path)])


@pytest.mark.slow
def test_container_image(tmp_path: Path, capsys):
    if os.geteuid() != 0:
        skip_or_fail("step 'preconditions': needs root (debootstrap, podman with --privileged)")
    if not os.path.exists("/dev/fuse"):
        skip_or_fail("step 'preconditions': /dev/fuse is missing on this host")
    _ensure_container_tools()
    _ensure_base_image(tmp_path, capsys)

    t0 = time.monotonic()
    proc = run(["podman", "build", "--isolation=chroot", "--build-arg", f"BASE={BASE_IMAGE}",
                "-f", str(DOCKERFILE), "--ignorefile", str(DOCKERIGNORE), "-t", TEST_IMAGE, str(REPO)],
               timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"step 'podman build' failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    _report("podman build", time.monotonic() - t0, capsys)

    # the final image carries no build tools
    opts = _podman_run_options(TEST_IMAGE)
    proc = run(["podman", "run", "--rm", "--network", "none", *opts, "--entrypoint", "sh", TEST_IMAGE, "-c",
                "! command -v gcc cc pkg-config && test -x /usr/bin/fusermount3 && test -x /usr/bin/tini"],
               timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", f"compilers in the final image or fuse3/tini missing: {proc}"

    src, store, prepared = tmp_path / "src", tmp_path / "store", tmp_path / "prepared"
    for d in (src, store, prepared):
        d.mkdir()
    files = make_source_tree(src)
    # As the manifests run the image (readOnlyRootFilesystem): nothing writable but the volumes and /tmp.
    read_only = ["--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp"]

    # prepare as their init containers run it, also root without capabilities or privilege escalation
    proc = run(["podman", "run", "--rm", "--network", "none", *opts, *read_only, "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "-v", f"{src}:/data:ro", "-v", f"{prepared}:/store",
                "--entrypoint", "liquidfs", TEST_IMAGE, "prepare", "/data", "--store", "/store", "--ratio", "1",
                "--no-progress"], timeout=300)
    assert proc.returncode == 0, f"prepare in a read-only image failed:\n{proc.stdout}{proc.stderr}"
    assert (prepared / "catalog.sqlite").is_file(), proc.stdout
    assert any(f.is_file() for f in (prepared / "objects").rglob("*")), f"nothing expanded:\n{proc.stdout}"

    name = f"liquidfs-test-{uuid.uuid4().hex[:8]}"
    with _shared_mountpoint(tmp_path / "shared") as mnt:
        try:
            t0 = time.monotonic()
            # the unprepared store: every file is served as its source bytes
            proc = run(["podman", "run", "-d", "--name", name, "--privileged", "--device", "/dev/fuse",
                        "--network", "none", *opts, *read_only,
                        "-v", f"{src}:/data:ro", "-v", f"{store}:/store", "-v", f"{mnt}:{MOUNTPOINT_IN_POD}:rshared",
                        TEST_IMAGE, "/data", MOUNTPOINT_IN_POD, "--store", "/store"], timeout=120)
            assert proc.returncode == 0, f"podman run failed: {proc.stderr}"

            def running() -> bool:
                state = run(["podman", "inspect", "--format", "{{.State.Running}}", name]).stdout.strip()
                return state == "true"

            appeared = wait_until(lambda: is_fuse_mounted(mnt) or not running(), timeout=120)
            def logs() -> str:
                proc = run(["podman", "logs", name])
                return proc.stdout + proc.stderr

            assert appeared and is_fuse_mounted(mnt), f"the mount did not propagate to the host:\n{logs()}"
            _report("container start to mount visible on the host", time.monotonic() - t0, capsys)

            assert_same_dataset(mnt, files)  # read on the host, through the propagated mount
            proc = run(["podman", "exec", name, "sha256sum", f"{MOUNTPOINT_IN_POD}/train/blob.bin"], check=True)
            import hashlib
            assert proc.stdout.split()[0] == hashlib.sha256(files["train/blob.bin"]).hexdigest()
            proc = run(["podman", "exec", name, "liquidfs", "stats", "--probe", MOUNTPOINT_IN_POD])
            assert proc.returncode == 0, f"liquidfs stats --probe failed: {proc.stdout}{proc.stderr}"

            t0 = time.monotonic()
            run(["podman", "stop", "-t", "30", name], timeout=90, check=True)   # SIGTERM (STOPSIGNAL)
            _report("podman stop", time.monotonic() - t0, capsys)
            code = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
            assert code == "0", f"exit code {code} after SIGTERM:\n{logs()}"
            assert wait_until(lambda: not is_fuse_mounted(mnt), timeout=10), "mount left behind after stop"
        finally:
            run(["podman", "rm", "-f", name], timeout=120)
