"""The committed gRPC stubs are what `make proto` makes from csi.proto today."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.csi.plugin import REPO

PROTO = os.path.join("blockcache_csi", "proto", "csi.proto")
STUBS = ("csi_pb2.py", "csi_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is the `proto` extra")
    os.makedirs(tmp_path / "blockcache_csi" / "proto")
    shutil.copy(os.path.join(REPO, PROTO), tmp_path / PROTO)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--grpc_python_out=.", PROTO], cwd=tmp_path, check=True, timeout=60)
    for name in STUBS:
        made = (tmp_path / "blockcache_csi" / "proto" / name).read_bytes()
        with open(os.path.join(REPO, "blockcache_csi", "proto", name), "rb") as f:
            assert f.read() == made, f"{name} is stale: run `make proto` and commit it"
