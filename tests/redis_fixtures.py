"""Real Redis servers for the remote-tier tests: one standalone server and a 3-node
local cluster on 127.0.0.1 ports, started and stopped here.

Without ``redis-server`` on PATH the tests skip with the command that installs it;
where they must not skip (``PAGEDKV_REQUIRE_REDIS=1``: ``.ci/run`` sets it once the
server is installed) they fail instead.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time

import pytest

INSTALL = "apt-get update && apt-get install -y redis-server"


def require_redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        why = f"redis-server is not installed (as root: {INSTALL})"
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
            pytest.fail(why + "; PAGEDKV_REQUIRE_REDIS=1 forbids skipping")
        pytest.skip(why)
    pytest.importorskip("redis", reason="the redis client: pip install 'pagedkv[remote]'")
    return exe


def free_port(cluster: bool = False) -> int:
    """A loopback port nobody listens on; for a cluster node, one whose bus port (10000
    higher) is free too and at most 65535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        try:
            for p in (port, port + 10000) if cluster else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port")


class Server:
    """One ``redis-server`` process on a loopback port (its files under ``workdir``)."""

    def __init__(self, exe: str, workdir, *extra: str, port: int | None = None):
        self.exe, self.workdir, self.extra = exe, workdir, extra
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--protected-mode", "no", "--enable-debug-command", "yes",
                "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client(socket_timeout=1).ping():
                    return
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited: "
                                       f"{self.proc.stdout.read().decode(errors='replace')[-2000:]}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.02)

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **dict(dict(socket_timeout=5), **kw))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class Cluster:
    """Three master nodes (no replicas) on loopback ports, slots spread by redis-cli."""

    def __init__(self, exe: str, workdir, *extra: str):
        cli = shutil.which("redis-cli") or os.path.join(os.path.dirname(exe), "redis-cli")
        self.nodes = []
        for i in range(3):
            port = free_port(cluster=True)
            self.nodes.append(Server(exe, os.path.join(workdir, f"n{i}"), "--cluster-enabled", "yes",
                                     "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "1000",
                                     *extra, port=port))
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        r = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        deadline = time.monotonic() + 30
        while not all(n.client().cluster("info").get("cluster_state") == "ok" for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self):
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes], socket_timeout=5)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    exe = require_redis_server()
    s = Server(exe, tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture
def fresh_redis(redis_server):
    """The module's server, emptied (and restarted if a test stopped it)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    c = redis_server.client()
    c.flushall()
    c.config_set("maxmemory", 0)
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory-samples", 5)
    return redis_server


@pytest.fixture
def redis_cluster(tmp_path):
    exe = require_redis_server()
    c = Cluster(exe, tmp_path / "cluster")
    yield c
    c.stop()
