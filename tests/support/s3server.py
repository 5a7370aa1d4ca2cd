"""A real S3-compatible object store for the tests: OpenStack Swift with its s3api middleware, on 127.0.0.1.

Everything lives under one temporary directory: swift.conf, the four server configs, the three rings, the data
(``srv/d1``) and one log file per server (``logs/*.log``). ``SwiftS3Server.start()`` writes the configs, builds
the rings, starts the proxy, account, container and object servers as child processes (one process each, no
forked workers) and waits until an authenticated S3 ListBuckets succeeds; ``stop()`` terminates them and removes
the directory. Authentication is tempauth (no keystone): the S3 access key is tempauth's ``account:user``.

Swift 2.30 (Debian bookworm) quirks handled here:

* the servers read ``/etc/swift/swift.conf`` whatever ``swift_dir`` says (only the rings and the other files
  follow ``swift_dir``), so each server is run by a small launcher (``launch.py``, written next to the configs)
  that points Swift at this directory's swift.conf (random hash prefix/suffix) before loading the server;
* tempauth refuses every request without a ``swift.cache`` in the WSGI environment ("Memcache required"), and
  memcached is neither installed nor wanted (a host-wide memcached would be shared between test servers), so the
  launcher also provides a per-process, dict-backed cache filter with memcache's semantics (JSON copies, expiry);
* each swift-ring-builder run costs ~1 s of imports (nine runs for three rings were most of the startup time),
  so the launcher also builds the rings, with the RingBuilder class that swift-ring-builder drives;
* without ``/dev/log`` Swift's syslog handler sends to UDP localhost:514, i.e. nowhere; the servers run with
  ``--verbose`` so that every log line also goes to stderr, which is redirected to ``logs/<server>.log``.

S3 clients need path-style addressing (no ``storage_domain`` is configured for virtual-hosted buckets): boto3 picks
it by itself for an IP-address endpoint, ``client()`` asks for it explicitly, s3fs and rclone are told below.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from fusehelpers import FUSERMOUNT, is_mounted, wait_for
from ports import free_port

# Command probed -> Debian package that provides it (scripts/test.sh installs the same ones).
SWIFT_COMMANDS = {
    "swift-proxy-server": "swift-proxy",
    "swift-account-server": "swift-account",
    "swift-container-server": "swift-container",
    "swift-object-server": "swift-object",
    "swift-ring-builder": "swift",
}
SERVERS = ("account", "container", "object", "proxy")  # start order: storage first, then the proxy
STARTUP_TIMEOUT = 60.0
LOG_TAIL_LINES = 40

# Run one Swift server against the swift.conf beside this file. Importable as module "launch" too (sys.path[0] is
# its directory when run as a script), which is how the proxy's paste pipeline finds ``cache_filter_factory``.
_LAUNCHER = '''\
"""Run one Swift server with the swift.conf of this directory; see tests/support/s3server.py."""
import copy
import json
import os
import sys
import time


class DictCache:
    """The part of swift.common.memcached.MemcacheRing that Swift's middleware uses, in this process's memory."""

    def __init__(self):
        self._data = {}  # key -> (expires or 0, JSON text or raw value)

    def _live(self, key):
        item = self._data.get(key)
        if item is not None and item[0] and item[0] < time.time():
            del self._data[key]
            return None
        return item

    @staticmethod
    def _expiry(timeout):
        timeout = float(timeout or 0)
        return time.time() + timeout if timeout > 0 else 0

    def get(self, key, raise_on_error=False):
        item = self._live(key)
        if item is None:
            return None
        return json.loads(item[1]) if item[2] else copy.deepcopy(item[1])

    def set(self, key, value, serialize=True, time=0, min_compress_len=0, raise_on_error=False):
        self._data[key] = (self._expiry(time), json.dumps(value) if serialize else copy.deepcopy(value), serialize)

    def incr(self, key, delta=1, time=0):
        item = self._live(key)
        value = max(0, int(item[1] if item else 0) + int(delta))
        self._data[key] = (item[0] if item else self._expiry(time), str(value), False)
        return value

    def decr(self, key, delta=1, time=0):
        return self.incr(key, -int(delta), time)

    def delete(self, key, server_key=None):
        self._data.pop(key, None)

    def set_multi(self, mapping, server_key, serialize=True, time=0, min_compress_len=0):
        for key, value in mapping.items():
            self.set(key, value, serialize, time)

    def get_multi(self, keys, server_key):
        return [self.get(key) for key in keys]


def cache_filter_factory(global_conf, **local_conf):
    cache = DictCache()

    def cache_filter(app):
        def middleware(env, start_response):
            env["swift.cache"] = cache
            return app(env, start_response)
        return middleware
    return cache_filter


def build_rings(ports):
    """What swift-ring-builder create 6 1 0 / add / rebalance does, for the three rings in one process (each
    swift-ring-builder run costs ~1 s of imports, nine of them most of the startup time)."""
    from swift.common.ring import RingBuilder
    here = os.path.dirname(os.path.abspath(__file__))
    for name, port in ports.items():
        builder = RingBuilder(6, 1, 0)  # part power 6 (64 partitions), 1 replica, min_part_hours 0
        builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port),
                         "device": "d1", "weight": 100, "meta": ""})
        builder.rebalance()
        builder.save(os.path.join(here, name + ".builder"))
        builder.get_ring().save(os.path.join(here, name + ".ring.gz"))


def main():
    if sys.argv[1] == "rings":  # launch.py rings account=PORT container=PORT object=PORT
        build_rings(dict(arg.split("=", 1) for arg in sys.argv[2:]))
        return
    server, conf_path = sys.argv[1], sys.argv[2]
    from swift.common import utils
    utils.set_swift_dir(os.path.dirname(os.path.abspath(__file__)))  # swift.conf from here, hash conf validated
    from swift.common import constraints, storage_policy
    constraints.reload_constraints()
    storage_policy.reload_storage_policies()
    from swift.common.wsgi import run_wsgi
    kwargs = {}
    if server == "object-server":
        from swift.obj import server as object_server
        kwargs["global_conf_callback"] = object_server.global_conf_callback
    sys.exit(run_wsgi(conf_path, server, verbose=True, **kwargs))


if __name__ == "__main__":
    main()
'''


class S3ServerError(RuntimeError):
    """The Swift S3 server could not be set up or started (the message carries the relevant log tails)."""



def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:])


def _swift_python() -> str:
    """The interpreter Swift is installed for: the one in swift-proxy-server's #! line (python3-swift is a
    Debian package, invisible to this project's virtual environment)."""
    missing = [cmd for cmd in SWIFT_COMMANDS if shutil.which(cmd) is None]
    if missing:
        packages = " ".join(sorted({SWIFT_COMMANDS[cmd] for cmd in missing}))
        raise S3ServerError(f"OpenStack Swift is not installed (missing {', '.join(missing)}): "
                            f"apt-get install {packages}")
    with open(shutil.which("swift-proxy-server") or "", "rb") as f:
        first = f.readline().decode(errors="replace")
    interpreter = first[2:].strip().split()[0] if first.startswith("#!") else "/usr/bin/python3"
    if interpreter.endswith("/env"):  # "#!/usr/bin/env python3"
        interpreter = shutil.which(first[2:].split()[1]) or "/usr/bin/python3"
    return interpreter


class SwiftS3Server:
    """Swift proxy + account/container/object servers with s3api, all on 127.0.0.1, under one temporary directory.

    ``endpoint``, ``access_key``, ``secret_key`` and ``region`` are what an S3 client needs; ``env()`` gives them
    as the standard AWS environment variables, ``client()`` as a boto3 client.
    """

    region = "us-east-1"

    def __init__(self, base_dir: Path | None = None) -> None:
        # base_dir: an existing directory to create the server's directory in (default: the system temp dir).
        self._base_dir = base_dir
        self.root: Path | None = None
        self.account = "test"
        self.user = "tester"
        self.access_key = f"{self.account}:{self.user}"  # tempauth's S3 access key is "account:user"
        # Contains "SECRET" so that tests can check the key never reaches a command line or a log.
        self.secret_key = f"SECRET{secrets.token_hex(12)}"
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_seconds: float | None = None

    # -- public API ----------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if "proxy" not in self.ports:
            raise S3ServerError("the server is not started")
        return f"http://127.0.0.1:{self.ports['proxy']}"

    @property
    def log_dir(self) -> Path:
        assert self.root is not None, "the server is not started"
        return self.root / "logs"

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables for this server, to merge into a subprocess's environment."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (path-style addressing); ``config`` adds botocore Config options."""
        import boto3
        from botocore.config import Config

        options: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "retries": {"max_attempts": 3, "mode": "standard"},
            **config,
        }
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.region, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, config=Config(**options))

    def start(self, timeout: float = STARTUP_TIMEOUT) -> SwiftS3Server:
        """Write configs, build rings, start the servers, wait until S3 answers; raises S3ServerError."""
        if self.procs:
            raise S3ServerError("already started")
        began = time.monotonic()
        python = _swift_python()
        self.root = Path(tempfile.mkdtemp(prefix="swift-s3-", dir=self._base_dir))
        try:
            self.ports = {name: free_port() for name in SERVERS}
            self._write_configs()
            self._build_rings(python)
            for name in SERVERS:
                self._spawn(python, name)
            self._wait_ready(began, timeout)
        except BaseException:
            self.stop(keep_dir=True)  # the logs stay for the error message and for a look afterwards
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM every server, SIGKILL what is left after 10 s, then remove the directory (unless keep_dir)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs = {}
        if self.root is not None and not keep_dir:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> SwiftS3Server:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def logs(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of every server's log, for error messages."""
        if self.root is None:
            return "(no server directory)"
        return "\n".join(f"--- logs/{name}.log (last {lines} lines) ---\n{_tail(self.log_dir / f'{name}.log', lines)}"
                         for name in SERVERS)

    # -- setup ---------------------------------------------------------------------------------------------

    def _write_configs(self) -> None:
        assert self.root is not None
        root = self.root
        (root / "srv" / "d1").mkdir(parents=True)
        (root / "logs").mkdir()
        (root / "launch.py").write_text(_LAUNCHER)
        (root / "swift.conf").write_text(textwrap.dedent(f"""\
            [swift-hash]
            swift_hash_path_prefix = {secrets.token_hex(16)}
            swift_hash_path_suffix = {secrets.token_hex(16)}

            [storage-policy:0]
            name = Policy-0
            default = yes
            """))
        user = pwd.getpwuid(os.getuid()).pw_name
        common = textwrap.dedent(f"""\
            [DEFAULT]
            bind_ip = 127.0.0.1
            workers = 0
            user = {user}
            swift_dir = {root}
            devices = {root / 'srv'}
            mount_check = false
            log_level = INFO
            """)
        for name in ("account", "container", "object"):
            (root / f"{name}-server.conf").write_text(common + textwrap.dedent(f"""\
                bind_port = {self.ports[name]}
                log_name = {name}-server

                [pipeline:main]
                pipeline = {name}-server

                [app:{name}-server]
                use = egg:swift#{name}
                """))
        # The s3api-in-tempauth pipeline of Swift's docs (proxy-server.conf-sample), less the middleware nothing
        # here uses (bulk, tempurl, ratelimit, quotas, symlink): slo is what S3 multipart upload is built on,
        # copy serves CopyObject and UploadPartCopy, dlo and versioned_writes complete what s3api expects.
        (root / "proxy-server.conf").write_text(common + textwrap.dedent(f"""\
            bind_port = {self.ports['proxy']}
            log_name = proxy-server

            [pipeline:main]
            pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo versioned_writes proxy-logging proxy-server

            [app:proxy-server]
            use = egg:swift#proxy
            account_autocreate = true

            [filter:s3api]
            use = egg:swift#s3api
            location = {self.region}

            [filter:tempauth]
            use = egg:swift#tempauth
            user_{self.account}_{self.user} = {self.secret_key} .admin

            [filter:cache]
            paste.filter_factory = launch:cache_filter_factory

            [filter:catch_errors]
            use = egg:swift#catch_errors

            [filter:gatekeeper]
            use = egg:swift#gatekeeper

            [filter:healthcheck]
            use = egg:swift#healthcheck

            [filter:proxy-logging]
            use = egg:swift#proxy_logging

            [filter:listing_formats]
            use = egg:swift#listing_formats

            [filter:copy]
            use = egg:swift#copy

            [filter:slo]
            use = egg:swift#slo

            [filter:dlo]
            use = egg:swift#dlo

            [filter:versioned_writes]
            use = egg:swift#versioned_writes
            """))
        os.chmod(root / "proxy-server.conf", 0o600)  # holds the secret key

    def _build_rings(self, python: str) -> None:
        """One device, one replica, part power 6 (64 partitions): the smallest ring that behaves normally."""
        assert self.root is not None
        done = subprocess.run([python, str(self.root / "launch.py"), "rings",
                               *(f"{name}={self.ports[name]}" for name in ("account", "container", "object"))],
                              capture_output=True, text=True, cwd=self.root, timeout=60)
        if done.returncode != 0:
            raise S3ServerError(f"building the rings failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def _spawn(self, python: str, name: str) -> None:
        assert self.root is not None
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [python, str(self.root / "launch.py"), f"{name}-server", str(self.root / f"{name}-server.conf")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                start_new_session=True)  # own process group: a terminal's ^C reaches pytest, not the servers

    def _wait_ready(self, began: float, timeout: float) -> None:
        """Until each port accepts connections, the proxy's /healthcheck says OK and S3 ListBuckets succeeds."""
        last = "not tried"
        stage = "ports"
        while time.monotonic() < began + timeout:
            dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise S3ServerError(f"Swift server(s) exited during startup: {dead}\n{self.logs()}")
            try:
                if stage == "ports":
                    for port in self.ports.values():
                        with socket.create_connection(("127.0.0.1", port), timeout=1):
                            pass
                    stage = "healthcheck"
                if stage == "healthcheck":
                    with urllib.request.urlopen(f"{self.endpoint}/healthcheck", timeout=5) as resp:
                        body = resp.read()
                    if body != b"OK":
                        raise S3ServerError(f"/healthcheck answered {body!r}")
                    stage = "s3"
                client = self.client(retries={"max_attempts": 1, "mode": "standard"})
                client.list_buckets()
                return
            except (OSError, urllib.error.URLError, S3ServerError) as exc:
                last = f"{stage}: {exc!r}"
            except Exception as exc:  # botocore's errors: the server is up but S3 is not (yet) right
                last = f"{stage}: {exc!r}"
            time.sleep(0.1)
        raise S3ServerError(f"Swift S3 server not ready after {timeout:.0f} s (last: {last})\n{self.logs()}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwiftS3Server]:
    """One Swift S3 server for the whole session. Failing to start it fails the test (never a skip)."""
    server = SwiftS3Server(tmp_path_factory.mktemp("s3server"))
    try:
        server.start()
    except S3ServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


# -- other FUSE filesystems over the same server (for benchmarks) ----------------------------------------------
#
# Both mount read-only, path-style, signature v4, with their default caching otherwise. Their environment is
# cleaned of AWS_* variables: rclone's AWS SDK fails outright on an AWS_CA_BUNDLE in the environment ("unable to
# load custom CA bundle, HTTPClient's transport unsupported type"), and s3fs would pick up stray credentials.
# Their logs go to the server's log directory. Both HEAD every object they stat (s3fs always; rclone to read its
# mtime metadata, unless given --use-server-modtime), so a first ``ls -l`` costs one request per file.


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def _check_mounted(mountpoint: Path, what: str, log: Path, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait for the mount, then list it: both filesystems check the bucket and credentials only once mounted, and
    on failure exit, leaving a dead mount (ENOTCONN) or none."""
    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise S3ServerError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        return is_mounted(mountpoint)

    try:
        wait_for(ready, 30, what=f"{what} on {mountpoint}")
        os.listdir(mountpoint)
    except (OSError, TimeoutError) as exc:
        if is_mounted(mountpoint):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(mountpoint)], capture_output=True)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        raise S3ServerError(f"{what} mount of {mountpoint} failed: {exc}\n{_tail(log)}") from exc


def _check_bucket(server: SwiftS3Server, bucket: str) -> None:
    """rclone mounts a missing bucket as an empty directory: say so instead."""
    from botocore.exceptions import ClientError

    try:
        server.client().head_bucket(Bucket=bucket)
    except ClientError as exc:
        raise S3ServerError(f"bucket {bucket!r} on {server.endpoint}: {exc}") from exc


def mount_s3fs(server: SwiftS3Server, bucket: str, mountpoint: Path, *options: str) -> None:
    """Mount ``bucket`` read-only at ``mountpoint`` with s3fs-fuse; s3fs daemonizes once mounted.

    ``options`` are more ``-o`` options (e.g. "use_cache=/dir", "parallel_count=8"). The credentials are in a
    mode-600 passwd file in the server's directory, in s3fs's key=value form: the "ACCESS:SECRET" form would be
    ambiguous since tempauth's access key "test:tester" itself has a colon. Undo with unmount().
    """
    if shutil.which("s3fs") is None:
        raise S3ServerError("s3fs is not installed: apt-get install s3fs")
    assert server.root is not None, "the server is not started"
    _check_bucket(server, bucket)
    passwd = server.root / "s3fs.passwd"
    fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"AWSAccessKeyId={server.access_key}\nAWSSecretKey={server.secret_key}\n")
    log = server.log_dir / f"s3fs-{Path(mountpoint).name}.log"
    cmd = ["s3fs", bucket, str(mountpoint), "-o", "ro", "-o", f"url={server.endpoint}", "-o", "use_path_request_style",
           "-o", f"endpoint={server.region}", "-o", f"passwd_file={passwd}", "-o", f"logfile={log}"]
    for option in options:
        cmd += ["-o", option]
    done = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise S3ServerError(f"s3fs failed ({done.returncode}): {done.stdout}{done.stderr}\n{_tail(log)}")
    _check_mounted(Path(mountpoint), "s3fs", log)


def mount_rclone(server: SwiftS3Server, bucket: str, mountpoint: Path, *args: str) -> subprocess.Popen[bytes]:
    """Mount ``bucket`` read-only at ``mountpoint`` with ``rclone mount`` in the foreground, as a child process
    (returned, once mounted); ``args`` are more rclone flags (e.g. "--use-server-modtime", "--vfs-cache-mode",
    "full"). The remote is configured by RCLONE_CONFIG_* environment variables only: no config file, no secret on
    the command line. Undo with unmount(mountpoint, proc)."""
    if shutil.which("rclone") is None:
        raise S3ServerError("rclone is not installed: apt-get install rclone")
    _check_bucket(server, bucket)
    env = _clean_env()
    remote = "LIQUIDFSBENCH"
    env.update({
        f"RCLONE_CONFIG_{remote}_TYPE": "s3",
        f"RCLONE_CONFIG_{remote}_PROVIDER": "Other",
        f"RCLONE_CONFIG_{remote}_ENDPOINT": server.endpoint,
        f"RCLONE_CONFIG_{remote}_REGION": server.region,
        f"RCLONE_CONFIG_{remote}_ACCESS_KEY_ID": server.access_key,
        f"RCLONE_CONFIG_{remote}_SECRET_ACCESS_KEY": server.secret_key,
        f"RCLONE_CONFIG_{remote}_FORCE_PATH_STYLE": "true",
    })
    log = server.log_dir / f"rclone-{Path(mountpoint).name}.log"
    cmd = ["rclone", "--config", os.devnull, "mount", f"{remote}:{bucket}", str(mountpoint), "--read-only",
           "--vfs-cache-mode", "off", "--log-file", str(log), "--log-level", "INFO", *args]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _check_mounted(Path(mountpoint), "rclone", log, proc)
    return proc


def unmount(mountpoint: Path, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    """``fusermount3 -u``, then wait for the filesystem's process (when given) to exit, killing it if it will
    not. s3fs's daemon exits by itself once unmounted."""
    if is_mounted(mountpoint):
        done = subprocess.run([FUSERMOUNT, "-u", str(mountpoint)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise S3ServerError(f"{FUSERMOUNT} -u {mountpoint} failed: {done.stderr.strip()}")
    if proc is not None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
