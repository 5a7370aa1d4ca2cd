"""The soak's attackers who share a node with the mount (issue 38): a memcached writer, a lying peer, a job-hopping
user. ``soak.py`` starts them beside its readers and reports what each did; this module only does it.

* ``cluster_writer``: a local user (``nobody``) who reaches the job's memcached over TCP, as anyone on the node
  can: it lists the keys (``lru_crawler metadump all``) and rewrites values, flipping a byte, putting another
  key's value in, cutting one short, or storing random bytes of the same length. Each value it stored is looked
  at again later without touching it (``mg KEY c h u``): fetched since (``h1``, the same cas), or replaced by the
  mount's own (another cas: a mount stores an object only after reading it from storage, so never after serving
  that value).
* ``LyingPeer``: a "memcached" of the ``--cluster`` list that lies to every call: a header announcing a huge value
  followed by a flood, a value of the exact length trickled one byte per 0.3 s, a value of the exact length full
  of random bytes, no answer at all, an answer line of garbage, or an endless line (each connection the next lie).
* ``job_hopper``: ``nobody`` starting short jobs on an ``--allow-other`` mount one after another: each a ``cat`` of
  one image in a new session (``setsid``), a third of them with ``LIQUIDFS_JOB`` set to the readers' own job name.
  ``JobWatch`` samples the mount's per-job counters meanwhile: the readers' job must keep its id and its epochs
  and reads may only count up.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (see drop_to_nobody)
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

#: Who the node's other user is: every attacker here runs as nobody.
NOBODY = 65534


def drop_to_nobody() -> None:
    """This process as ``nobody`` from here on, for good (groups, gid, then uid); refuses to go on otherwise.
    What it still imports must be loaded before (the interpreter's files may be root's alone): the codec that
    ``getaddrinfo`` encodes a host with, loaded lazily, is imported at the top of this module."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if os.getuid() != NOBODY or os.geteuid() != NOBODY or os.getgid() != NOBODY:
        raise RuntimeError("could not become nobody")


def daemon_memory(pid: int) -> dict[str, int | None]:
    """The daemon's resident memory now and at its peak (VmRSS, VmHWM of /proc/PID/status), in KiB."""
    found: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in found:
                    found[name] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return {"rss_kib": found["VmRSS"], "peak_rss_kib": found["VmHWM"]}


class Background:
    """A daemon thread running ``_run`` for the time of a ``with`` block: at its end ``stopping`` is set, ``wake``
    called (for a thread that waits on something else), and the thread joined."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        """Get ``_run`` out of a wait of its own (``stopping`` is set already)."""

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.wake()
        self.thread.join(30)


# -- a memcached writer --------------------------------------------------------------------------------------

TAMPERS = ("flip", "swap", "truncate", "garbage")


class MemcachedText:
    """memcached's text protocol as any client on the node speaks it (the attacker trusts its memcached)."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        send(self.sock, data)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("memcached closed the connection")
        self.buffer += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def keys(self) -> list[str]:
        """Every key it holds (``lru_crawler metadump all``: one line per item, the key URL-encoded)."""
        for _ in range(20):
            self.send(b"lru_crawler metadump all\r\n")
            first = self.line()
            if not first.startswith(b"BUSY"):  # a crawl of its own is running: ask again
                break
            time.sleep(0.05)
        else:
            return []
        keys = []
        # metadump ends its item lines with "\n" alone and the listing with "END\r\n"
        text = first
        while not text.endswith(b"END"):
            text += b"\r\n" + self.line()
        for item in text.split(b"\n"):
            m = re.match(rb"key=(\S+) ", item)
            if m:
                keys.append(urllib.parse.unquote(m.group(1).decode()))
        return keys

    def get(self, key: str) -> bytes | None:
        self.send(b"get " + key.encode() + b"\r\n")
        header = self.line()
        if header == b"END":
            return None
        length = int(header.split()[3])
        value = self.exactly(length + 2)[:-2]
        if self.line() != b"END":
            raise ConnectionError("a value not followed by END")
        return value

    def store(self, key: str, value: bytes) -> int | None:
        """Store ``value`` under ``key`` (meta set); the cas of the item stored, None where it was not."""
        self.send(b"ms %s %d c\r\n%s\r\n" % (key.encode(), len(value), value))
        answer = self.line()
        m = re.fullmatch(rb"HD c(\d+)", answer)
        return int(m.group(1)) if m else None

    def peek(self, key: str) -> tuple[int, bool] | None:
        """The cas of ``key``'s item and whether it was fetched since it was stored, without fetching it (``u``:
        not bumped, not marked); None where it holds no such key."""
        self.send(b"mg " + key.encode() + b" c h u\r\n")
        answer = self.line()
        m = re.fullmatch(rb"HD c(\d+) h([01])", answer)
        return (int(m.group(1)), m.group(2) == b"1") if m else None


def tamper(how: str, value: bytes, other: bytes | None, rng: random.Random) -> bytes:
    """``value`` changed as ``how`` says (``other``: another key's value, for a swap)."""
    if how == "flip":
        at = rng.randrange(len(value))
        return value[:at] + bytes([value[at] ^ (1 << rng.randrange(8))]) + value[at + 1:]
    if how == "swap" and other is not None:
        return other
    if how == "truncate":
        return value[:rng.randrange(len(value))]
    return os.urandom(len(value))  # garbage of the right length (and a swap with nothing to swap with)


def cluster_writer(port: int, seconds: float, seed: int, stop: Callable[[], bool]) -> dict[str, Any]:
    """Rewrite the values of the memcached on ``port`` for ``seconds``; what was done and what became of it."""
    rng = random.Random(seed)
    counts: dict[str, Any] = {name: 0 for name in TAMPERS} | {
        "listings": 0, "keys_seen": 0, "fetched_after": 0, "replaced_after": 0, "failed": 0, "uid": os.getuid()}
    ours: dict[str, int] = {}  # key -> the cas of the value this writer stored there
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    client: MemcachedText | None = None
    while time.monotonic() < deadline and not stop():
        try:
            if client is None:
                client = MemcachedText(port)
            for key, cas in list(ours.items()):
                now = client.peek(key)
                if now is None or now[0] != cas:
                    counts["replaced_after"] += 1
                    del ours[key]
                elif now[1]:
                    counts["fetched_after"] += 1
                    del ours[key]
            keys = [k for k in client.keys() if k.startswith("liquidfs")]
            counts["listings"] += 1
            seen.update(keys)
            if keys:
                key = rng.choice(keys)
                value = client.get(key)
                if value:
                    how = rng.choice(TAMPERS)
                    other_key = rng.choice([k for k in keys if k != key] or [key])
                    other = None
                    if how == "swap" and other_key != key:
                        other = client.get(other_key)
                        ours.pop(other_key, None)  # fetched here: its "fetched since" no longer says the mount's
                    stored = client.store(key, tamper(how, value, other, rng))
                    if stored is not None:
                        counts[how] += 1
                        ours[key] = stored
        except (OSError, ValueError, IndexError) as exc:  # memcached restarting, an item gone meanwhile: again
            counts["failed"] += 1
            counts["last_failure"] = repr(exc)
            if client is not None:
                client.close()
            client = None
            time.sleep(0.1)
        time.sleep(rng.uniform(0.01, 0.05))
    if client is not None:
        client.close()
    counts["keys_seen"] = len(seen)
    counts["rewrites"] = sum(counts[name] for name in TAMPERS)
    return counts


# -- a lying peer --------------------------------------------------------------------------------------------

#: In the order told, one per connection in turn: a peer left out after 3 failures is asked a few times a run, and
#: each lie must be told in the first few.
LIES = ("huge", "trickle", "garbage-body", "silent", "garbage", "endless-line")
#: How long the peer keeps a connection it lies on: far past any client's deadline (the mount's is 1 s).
HOLD = 30.0
#: Connections served at once; past them a connection is closed at once (a peer never grows without bound).
MAX_CONNECTIONS = 64
#: The least share of the cluster's keys each of the two (memcached and peer) is placed: the peer's port is drawn
#: until the mount's own placement (rendezvous hashing of HOST:PORT) splits them so. Left to chance, a small
#: sample's keys can all go to one: CI's soak once had 8, and the peer got no call (1 in 256).
LEAST_SHARE = 0.25
#: Ports drawn at most for that split (each draw meets it with odds near 0.9 at 8 keys).
PORT_DRAWS = 200


def expected_length(key: bytes, seen: dict[bytes, int]) -> int:
    """The length a mount expects for ``key``, as far as a liar can know it: a plaintext key's last field (its
    object's size); a sealed key's (``liquidfs3s-``, which shows nothing of its object) from the ``set`` of it the
    liar was sent (``seen``), else a guess that is wrong (and refused before its body is read)."""
    if key.startswith(b"liquidfs3s-"):
        return seen.get(key, 100)
    return int(key.rsplit(b":", 1)[1])


class LyingPeer(Background):
    """A "memcached" on 127.0.0.1 that lies to every call: each connection the next of ``LIES``, in turn."""

    def __init__(self, server: socket.socket | None = None) -> None:
        super().__init__()
        self.server = server if server is not None else socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.lock = threading.Lock()
        self.counts: dict[str, Any] = {"connections": 0, "refused": 0, "gets": 0, "sets": 0, "other": 0,
                                       "rejectable_sent": 0} | {lie: 0 for lie in LIES}
        self.active = 0
        self.lengths: dict[bytes, int] = {}  # sealed keys' value lengths, from the sets it was sent

    def wake(self) -> None:
        self.server.close()  # accept() returns

    def _count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.counts["connections"] += 1
                full = self.active >= MAX_CONNECTIONS
                self.active += not full
            if full:
                self._count("refused")
                conn.close()
                continue
            lie = LIES[(self.counts["connections"] - 1) % len(LIES)]
            threading.Thread(target=self._serve, args=(conn, lie), daemon=True).start()

    def _serve(self, conn: socket.socket, lie: str) -> None:
        try:
            conn.settimeout(HOLD)
            request = b""
            while b"\r\n" not in request and len(request) < 4096:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            words = request.split(b"\r\n", 1)[0].split()
            command = words[0] if words else b""
            self._count("gets" if command == b"get" else "sets" if command == b"set" else "other")
            self._count(lie)
            key = words[1] if len(words) > 1 else b"x"
            if command == b"set" and len(words) >= 5 and words[4].isdigit():
                with self.lock:
                    if len(self.lengths) < 100_000:
                        self.lengths[key] = int(words[4])  # what a sealed key's get must answer (seen by a liar)
            self._lie(conn, lie, key, command == b"get")
        except (OSError, ValueError, IndexError):
            pass  # the client gave up on it, as it must
        finally:
            conn.close()
            with self.lock:
                self.active -= 1

    def _lie(self, conn: socket.socket, lie: str, key: bytes, is_get: bool) -> None:
        ends = time.monotonic() + HOLD
        length = expected_length(key, self.lengths) if is_get and b":" in key else 100
        if lie == "huge":
            send(conn, b"VALUE %s 0 %d\r\n" % (key, 1 << 40))
            self._count("rejectable_sent")
            block = os.urandom(1 << 16)
            while time.monotonic() < ends and not self.stopping.is_set():
                send(conn, block)  # fails once the client has closed: what a buffering client would take in
        elif lie == "trickle":
            send(conn, b"VALUE %s 0 %d\r\n" % (key, length))
            for _ in range(length + 7):
                if self.stopping.wait(0.3) or time.monotonic() > ends:
                    return
                send(conn, b"\0")
        elif lie == "garbage-body":
            send(conn, b"VALUE %s 0 %d\r\n" % (key, length) + os.urandom(length) + b"\r\nEND\r\n")
            self._count("rejectable_sent")
            self._drain(conn, ends)
        elif lie == "garbage":
            send(conn, os.urandom(64).replace(b"\r\n", b"..") + b"\r\n")
            self._drain(conn, ends)
        elif lie == "endless-line":
            while time.monotonic() < ends and not self.stopping.is_set():
                send(conn, b"VALUE " * 1000)
        else:
            self._drain(conn, ends)

    def _drain(self, conn: socket.socket, ends: float) -> None:
        """Hold the connection, answering nothing more, until the client closes it (or ``HOLD`` passes)."""
        while time.monotonic() < ends and not self.stopping.is_set():
            conn.settimeout(max(0.1, ends - time.monotonic()))
            if not conn.recv(65536):
                return

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.counts, port=self.port)


def cluster_keys(store: Path, key_file: Path | None) -> list[str]:
    """The keys a mount of ``store`` at ``--cluster-size 100%`` asks the cluster for (sealed under the key of
    ``key_file``; else in the clear, and only of files everyone may read), as the mount makes them
    (``held.cluster``)."""
    from liquidfs.catalog.catalog import Catalog
    from liquidfs.held.cluster import EveryoneReadsNow, in_share, key_of
    from liquidfs.held.sealing import read_key_file

    keyed = read_key_file(key_file).id if key_file is not None else ""
    catalog = Catalog.open(store, readonly=True)
    root = -1
    try:
        if key_file is None:  # as the mount asks it: of the source as it is, every directory above it included
            root = os.open(catalog.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        public = EveryoneReadsNow(root) if key_file is None else None
        return [key_of(node, keyed) for node in catalog.files()
                if in_share(node, 1.0) and (public is None or public(node))]
    finally:
        if root >= 0:
            os.close(root)
        catalog.close()


def splitting_listener(memcached_port: int, keys: list[str]) -> tuple[socket.socket, int]:
    """A listening socket on 127.0.0.1 whose port, beside the memcached's, gets the peer at least ``LEAST_SHARE``
    of ``keys`` and leaves the memcached as much, by the mount's own placement (``MemcachedWire.peer_of``); and
    how many of ``keys`` the peer got."""
    from liquidfs.held.memcached import MemcachedWire

    need = LEAST_SHARE * len(keys) if len(keys) >= 2 else 0  # one key cannot be split: it goes where it goes
    for _ in range(PORT_DRAWS):
        server = socket.create_server(("127.0.0.1", 0))
        port = int(server.getsockname()[1])
        wire = MemcachedWire([("127.0.0.1", memcached_port), ("127.0.0.1", port)])
        to_peer = sum(getattr(wire.peer_of(key), "port", None) == port for key in keys)
        if min(to_peer, len(keys) - to_peer) >= need:
            return server, to_peer
        server.close()
    raise RuntimeError(f"no port in {PORT_DRAWS} draws splits the cluster's {len(keys)} keys between the memcached "
                       "and the lying peer")


# -- a job-hopping user --------------------------------------------------------------------------------------


def job_hopper(mount_fd: int, files: list[str], job_name: str, seconds: float, seed: int,
               check: Callable[[str, bytes], str | None], stop: Callable[[], bool]) -> dict[str, Any]:
    """Short jobs one after another for ``seconds``, each ``cat`` of one of ``files`` in a new session (the
    mount reached through ``mount_fd``, a descriptor of its root), as whoever runs this; every third with
    ``LIQUIDFS_JOB=job_name``, every third with a name of its own, the rest with none. ``check(file, bytes)``:
    why what a job read is wrong, or None."""
    rng = random.Random(seed)
    counts: dict[str, Any] = {"jobs": 0, "as_readers_job": 0, "named_own": 0, "sessions_only": 0, "read": 0,
                              "errors": 0, "wrong": [], "stuck": 0, "uid": os.getuid()}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop():
        rel = rng.choice(files)
        env = {"PATH": "/usr/bin:/bin"}
        kind = counts["jobs"] % 3
        if kind == 0:
            env["LIQUIDFS_JOB"] = job_name
            counts["as_readers_job"] += 1
        elif kind == 1:
            env["LIQUIDFS_JOB"] = f"hop-{counts['jobs']}"
            counts["named_own"] += 1
        else:
            counts["sessions_only"] += 1
        counts["jobs"] += 1
        proc = subprocess.Popen(["cat", f"/proc/self/fd/{mount_fd}/{rel}"], env=env, pass_fds=(mount_fd,),
                                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # the watchdog calls the hang; the hopper only stops waiting
            counts["stuck"] += 1
            proc.kill()
            proc.communicate()
            continue
        if proc.returncode != 0:
            counts["errors"] += 1
            continue
        counts["read"] += 1
        why = check(rel, out)
        if why is not None:
            counts["wrong"].append(f"{rel}: {why}")
        time.sleep(rng.uniform(0.0, 0.05))
    return counts


class JobWatch(Background):
    """Samples the mount's per-job counters (its control file, through ``read``) every ``interval`` s: the entry of
    the readers' job (root's, ``LIQUIDFS_JOB=name``) and how many of nobody's jobs read beside it."""

    def __init__(self, read: Callable[[], dict[str, Any]], name: str, interval: float = 0.5) -> None:
        super().__init__()
        self.read = read
        self.label = f"uid 0, LIQUIDFS_JOB={name},"
        self.interval = interval
        self.samples: list[tuple[str, int, int] | None] = []  # (job id, epoch, reads); None: not reading
        self.nobody_jobs_most = 0
        self.nobody_with_name = 0  # samples where nobody had a job of the readers' name (its own, apart)
        self.last: dict[str, Any] = {}
        self.failures = 0

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        try:
            stats = self.read()
        except (OSError, ValueError):
            self.failures += 1
            return
        jobs: dict[str, dict[str, Any]] = stats.get("jobs") or {}
        mine = [(job, e) for job, e in jobs.items() if str(e.get("openers", "")).startswith(self.label)]
        nobody = [e for e in jobs.values() if str(e.get("openers", "")).startswith(f"uid {NOBODY},")]
        self.nobody_jobs_most = max(self.nobody_jobs_most, len(nobody))
        name = self.label.split(", ", 1)[1]
        self.nobody_with_name += any(str(e.get("openers", "")).startswith(f"uid {NOBODY}, {name}") for e in nobody)
        self.samples.append((mine[0][0], int(mine[0][1]["epoch"]), int(mine[0][1]["reads"])) if len(mine) == 1
                            else None)
        self.last = {k: stats.get(k) for k in ("jobs_reading", "jobs_retired", "jobs_refused",
                                               "jobs_uncounted_reads")}

    def summary(self) -> dict[str, Any]:
        """The readers' job through the run: one id, present in every sample from its first on, epochs and reads
        that only count up (``unmoved``)."""
        self.sample()
        seen = [s for s in self.samples if s is not None]
        first = next((i for i, s in enumerate(self.samples) if s is not None), None)
        gaps = sum(1 for s in self.samples[first:] if s is None) if first is not None else 0
        ids = sorted({s[0] for s in seen})
        rising = all(b[1] >= a[1] and b[2] >= a[2] for a, b in itertools.pairwise(seen))
        return {"samples": len(self.samples), "readers_job_ids": ids, "absent_after_first": gaps,
                "epochs": [seen[0][1], seen[-1][1]] if seen else None,
                "reads": [seen[0][2], seen[-1][2]] if seen else None, "only_counted_up": rising,
                "unmoved": len(ids) == 1 and gaps == 0 and rising,
                "nobody_jobs_at_most": self.nobody_jobs_most, "nobody_had_the_name": self.nobody_with_name,
                "read_failures": self.failures, **self.last}


def send(conn: socket.socket, data: bytes) -> None:
    """All of ``data``, without SIGPIPE (the soak restores its default action): a client that hung up is an
    OSError here, which ends that lie."""
    conn.sendall(data, socket.MSG_NOSIGNAL)


# -- the three around one mount ------------------------------------------------------------------------------

#: The attacks of this module, as ``soak.py --attacks`` names them.
NEIGHBOURS = ("cluster-writer", "lying-peer", "job-hopper")
#: How far the daemon's resident memory may rise over a run: far above what a soak's reads hold (a few MiB of
#: a small sample), far below what one lie a client buffered would take (the flood behind a 1 TiB header).
RSS_RISE_KIB = 256 * 1024


class Neighbours:
    """The attackers of ``attacks`` (of ``NEIGHBOURS``) around one mount: a real memcached for the cluster level
    (with the lying peer beside it in ``--cluster``), what the mount needs (``mount_flags``) and its readers
    (``reader_env``); started once the mount serves (``start``), summarised before it is unmounted
    (``finish``), the memcached and the peer stopped after (``close``). ``script``: soak.py, whose hidden
    ``cluster-writer`` and ``job-hopper`` commands run the attackers as processes of nobody. ``store``: the
    prepared store the mount serves, whose keys the peer's port is drawn to get a share of."""

    def __init__(self, attacks: list[str], work: Path, tag: str, script: str, seed: int, keyed: bool,
                 store: Path) -> None:
        self.attacks = [a for a in NEIGHBOURS if a in attacks]
        self.work = work
        self.store = store
        self.script = script
        self.seed = seed
        self.keyed = keyed
        self.job_name = f"soak-readers-{tag}" if "job-hopper" in self.attacks else None
        self.memcached: Any = None
        self.liar: LyingPeer | None = None
        self.liar_keys = (0, 0)  # of the cluster's keys: the peer's, all
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.watch: JobWatch | None = None
        self.daemon_pid: int | None = None
        self.memory_after_mount: dict[str, int | None] = {}

    def __enter__(self) -> Neighbours:
        if "cluster-writer" in self.attacks or "lying-peer" in self.attacks:
            from bench_cluster import Memcached

            binary = shutil.which("memcached") or shutil.which("memcached", path="/usr/bin:/usr/sbin")
            if binary is None:
                raise RuntimeError("--attacks cluster-writer and lying-peer need memcached (apt-get install "
                                   "memcached)")
            self.memcached = Memcached(binary, 64, "2m")
            self.memcached.start()
        if "lying-peer" in self.attacks:
            try:
                keys = cluster_keys(self.store, self._key_file())
                server, placed = splitting_listener(self.memcached.port, keys)
            except BaseException:
                self.close()  # the memcached started above is not left running
                raise
            self.liar_keys = (placed, len(keys))
            self.liar = LyingPeer(server).__enter__()
        return self

    def _key_file(self) -> Path | None:
        """The job's cluster key (made once in the work dir), None without one."""
        if not self.keyed:
            return None
        from bench_cluster import cluster_key

        return cluster_key(self.work)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mount_flags(self) -> list[str]:
        flags = []
        if self.memcached is not None:
            peers = [f"127.0.0.1:{self.memcached.port}"] + ([f"127.0.0.1:{self.liar.port}"] if self.liar else [])
            flags += ["--cluster", "memcached://" + ",".join(peers), "--cluster-size", "100%"]
            key_file = self._key_file()
            if key_file is not None:
                flags += ["--cluster-key-file", str(key_file)]
        if self.job_name is not None:
            flags.append("--allow-other")  # nobody must enter the mount
        return flags

    def reader_env(self) -> dict[str, str]:
        """What the readers' environment adds: the name of their job, which the hopper takes too."""
        return {"LIQUIDFS_JOB": self.job_name} if self.job_name is not None else {}

    def start(self, mountpoint: Path, spec_path: Path, seconds: float, daemon_pid: int,
              read: Callable[[], dict[str, Any]]) -> None:
        self.daemon_pid = daemon_pid
        self.memory_after_mount = daemon_memory(daemon_pid)
        timing = ["--seconds", f"{seconds:.1f}", "--seed", str(self.seed)]
        if "cluster-writer" in self.attacks:
            self.procs["cluster-writer"] = subprocess.Popen(
                [sys.executable, self.script, "cluster-writer", str(self.memcached.port), *timing],
                stdout=subprocess.PIPE, text=True)
        if self.job_name is not None:
            self.watch = JobWatch(read, self.job_name).__enter__()
            # The soak's work directory is private: nobody reaches the mount through a descriptor of its root
            # (as a user reaches a mount under /mnt); the mount's own checks are what is attacked, not the path.
            fd = os.open(mountpoint, os.O_PATH | os.O_DIRECTORY)
            try:
                self.procs["job-hopper"] = subprocess.Popen(
                    [sys.executable, self.script, "job-hopper", str(spec_path), "--mount-fd", str(fd), "--job",
                     self.job_name, *timing],
                    stdout=subprocess.PIPE, text=True, pass_fds=(fd,))
            finally:
                os.close(fd)

    def finish(self, aborted: bool) -> dict[str, Any]:
        """What each did, and the daemon's memory now (the mount still up, unless ``aborted``)."""
        out: dict[str, Any] = {"attacks": self.attacks, "sealed": self.keyed if self.memcached else None}
        for name, proc in self.procs.items():
            found = account(proc, stop_now=aborted)
            out[name] = found if found is not None else {"failed": proc.returncode}
        self.procs = {}
        if self.watch is not None:
            self.watch.__exit__()
            out["readers_job"] = self.watch.summary()
        if self.liar is not None:
            out["lying-peer"] = self.liar.summary() | {"keys_placed": self.liar_keys[0], "keys": self.liar_keys[1]}
        if self.memcached is not None:
            out["memcached"] = self.memcached.stats()
        if self.daemon_pid is not None:
            out["daemon_memory"] = {"after_mount": self.memory_after_mount, "at_end": daemon_memory(self.daemon_pid)}
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.watch is not None:
            self.watch.__exit__()
        if self.liar is not None:
            self.liar.__exit__()
            self.liar = None
        if self.memcached is not None:
            self.memcached.kill()


def account(proc: subprocess.Popen[str], stop_now: bool, grace: float = 60.0) -> dict[str, Any] | None:
    """What an attacker process of the soak printed at its end (JSON), None where it printed nothing or failed. It
    stops by itself; ``stop_now``: SIGTERM at once (the mount is gone). One still running after ``grace`` s gets
    SIGTERM, then, after twice that, SIGKILL."""
    if stop_now:
        proc.send_signal(signal.SIGTERM)
    text = ""
    for then in (signal.SIGTERM, signal.SIGKILL, None):
        try:
            text, _ = proc.communicate(timeout=grace if then is signal.SIGTERM else 2 * grace)
            break
        except subprocess.TimeoutExpired:
            if then is not None:
                proc.send_signal(then)
    return json.loads(text) if proc.returncode == 0 and text.strip() else None


def peak_rise_kib(found: dict[str, Any]) -> int | None:
    """How far the daemon's peak resident memory (VmHWM) rose between the mount and the end of the run."""
    memory = found.get("daemon_memory")
    if not memory or memory["after_mount"]["peak_rss_kib"] is None or memory["at_end"]["peak_rss_kib"] is None:
        return None
    return int(memory["at_end"]["peak_rss_kib"] - memory["after_mount"]["peak_rss_kib"])


def problems(found: dict[str, Any]) -> list[str]:
    """What in ``Neighbours.finish``'s account fails the soak: a wrong read of the hopper's, the readers' job
    moved or joined by nobody, the daemon's memory risen past ``RSS_RISE_KIB``, an attacker that did not run as
    nobody."""
    out = []
    hopper = found.get("job-hopper")
    if hopper is not None:
        out += [f"job hopper read wrong bytes: {w}" for w in hopper.get("wrong", [])]
        if hopper.get("uid") != NOBODY:
            out.append(f"the job hopper did not run as nobody: {hopper}")
    job = found.get("readers_job")
    if job is not None and not job["unmoved"]:
        out.append(f"the readers' job was retired or moved: {job}")
    if job is not None and hopper is not None and hopper.get("as_readers_job") and hopper.get("read") \
            and not job["nobody_had_the_name"]:
        out.append(f"nobody's jobs under the readers' name were never a job of nobody's (they joined it?): {job}")
    writer = found.get("cluster-writer")
    if writer is not None and writer.get("uid") != NOBODY:
        out.append(f"the memcached writer did not run as nobody: {writer}")
    rise = peak_rise_kib(found)
    if rise is not None and rise > RSS_RISE_KIB:
        out.append(f"the daemon's peak RSS rose {rise:,} KiB during the run")
    return out
